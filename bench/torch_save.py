#!/usr/bin/python3
"""torch.save of a state of a given size into a directory, synced to disk: the peer the durable
suite compares its drain with. Prints "seconds|S" for the median of the repetitions."""

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--directory", required=True)
    parser.add_argument("--repetitions", type=int, default=3)
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    elements = arguments.bytes // 4 // arguments.tensors
    state = {f"expert{i}": torch.full((elements,), float(i)) for i in range(arguments.tensors)}
    path = os.path.join(arguments.directory, "state.pt")
    times = []
    for _ in range(arguments.repetitions):
        start = time.perf_counter()
        with open(path, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        times.append(time.perf_counter() - start)
        os.remove(path)
    print(f"seconds|{statistics.median(times)}")


if __name__ == "__main__":
    main()
