#!/usr/bin/python3
"""The peers benchmark: one PyTorch model state checkpointed three ways in one run.

A trainer's blocking time per checkpoint with moesnap (the Snapshot call; the copy runs while the
next step computes, so the stall is max(0, copy - compute)) against torch.save of the same state to
/dev/shm (what in-memory checkpointing of other tools does) and to disk with fsync; and the time to
get the state back after a crash: moesnap's restore against torch.load from each. Prints one line
per figure, "name|value|unit|baseline|baseline_value", for moesnap-bench.
"""

import argparse
import os
import tempfile
import time

import torch

import moesnap


def state_of(megabytes: int):
    """Expert-shaped Linear layers holding `megabytes` of fp32 weights, with Adam state."""
    torch.manual_seed(0)
    experts = max(1, megabytes * (1 << 20) // (4 * 2 * 1024 * 2048))
    model = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(1024, 2048, bias=False),
                                                    torch.nn.Linear(2048, 1024, bias=False))
                                for _ in range(experts))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    moesnap.initialize_optimizer_state(optimizer)
    return model, optimizer


def best(repetitions, body):
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        body()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--megabytes", type=int, default=256, help="fp32 weights; the state is 3x")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir())
    arguments = parser.parse_args()
    torch.set_num_threads(2)

    model, optimizer = state_of(arguments.megabytes)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    client = moesnap.Client(arguments.socket, 0)
    client.register_module("model", model)
    client.register_optimizer("optim", optimizer)

    step = [0]
    snapshot_calls = []
    copy_times = []
    for _ in range(5):
        step[0] += 1
        start = time.perf_counter()
        client.snapshot(step[0])
        snapshot_calls.append(time.perf_counter() - start)
        client.wait_captured()
        copy_times.append(time.perf_counter() - start)
    client.wait_committed(step[0])
    snapshot_call = sorted(snapshot_calls)[len(snapshot_calls) // 2]
    copy = min(copy_times)

    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    shm_path = f"/dev/shm/moesnap-peers-{os.getpid()}.pt"
    disk_path = os.path.join(arguments.disk_dir, f"moesnap-peers-{os.getpid()}.pt")

    def save_shm():
        torch.save(checkpoint, shm_path)

    def save_disk():
        with open(disk_path, "wb") as out:
            torch.save(checkpoint, out)
            out.flush()
            os.fsync(out.fileno())

    try:
        shm_save = best(3, save_shm)
        disk_save = best(3, save_disk)
        moesnap_restore = best(3, lambda: client.restore())
        shm_load = best(3, lambda: torch.load(shm_path))
        disk_load = best(3, lambda: torch.load(disk_path))  # from the page cache: a lower bound
    finally:
        for path in (shm_path, disk_path):
            if os.path.exists(path):
                os.unlink(path)

    mib = state_bytes / (1 << 20)
    rows = [
        (f"trainer blocked per checkpoint, moesnap Snapshot() ({mib:.0f} MiB)", snapshot_call * 1e3,
         "ms", "torch.save to /dev/shm", shm_save * 1e3),
        (f"trainer blocked per checkpoint, moesnap Snapshot() ({mib:.0f} MiB)", snapshot_call * 1e3,
         "ms", "torch.save to disk + fsync", disk_save * 1e3),
        (f"moesnap copy in the background ({mib:.0f} MiB)", copy * 1e3, "ms",
         "torch.save to /dev/shm", shm_save * 1e3),
        (f"state back after a crash, moesnap restore ({mib:.0f} MiB)", moesnap_restore * 1e3, "ms",
         "torch.load from /dev/shm", shm_load * 1e3),
        (f"state back after a crash, moesnap restore ({mib:.0f} MiB)", moesnap_restore * 1e3, "ms",
         "torch.load from disk (page cache)", disk_load * 1e3),
    ]
    for name, value, unit, baseline, baseline_value in rows:
        print(f"{name}|{value:.3f}|{unit}|{baseline}|{baseline_value:.3f}", flush=True)


if __name__ == "__main__":
    main()
