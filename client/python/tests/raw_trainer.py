"""A trainer of raw memory through moesnap.core, no PyTorch: two regions in shared buffers whose
bytes at step s are a function of (region, s).

    raw_trainer.py train SOCKET     snapshot steps 1, 2, ... (each committed through step 3, then
                                    in flight as they come) until killed
    raw_trainer.py restore SOCKET   restore the latest committed step into fresh buffers and check
                                    every byte; then try a GPU region (the daemon has no CUDA here)
"""

import itertools
import random
import sys
from pathlib import Path

import moesnap
import moesnap.core

REGIONS = {"weights": 4 << 20, "counters": 4096}


def content(name: str, step: int) -> bytes:
    return random.Random(f"{name}:{step}").randbytes(REGIONS[name])


def main() -> int:
    mode, socket = sys.argv[1], sys.argv[2]
    client = moesnap.core.Client(socket, rank=0)
    buffers = {name: moesnap.core.SharedBuffer(size) for name, size in REGIONS.items()}
    handles = client.share_memory([buffer.fd for buffer in buffers.values()])
    client.register_host_regions([(name, handle, 0, buffer.size, "uint8", [buffer.size])
                                  for (name, buffer), handle in zip(buffers.items(), handles)])
    if mode == "train":
        print(f"moesnap from {moesnap.__file__}", flush=True)
        for step in itertools.count(1):
            for name, buffer in buffers.items():
                buffer[:buffer.size] = content(name, step)
            client.snapshot(step)
            if step <= 3:
                client.wait_committed(step)
                print(f"committed {step}", flush=True)
            else:
                print(f"snapshot {step}", flush=True)
            client.wait_captured(step)  # the next step changes the buffers
    latest = client.latest_committed()
    restored = client.restore()
    if restored.step != latest or restored.regions != len(REGIONS):
        print(f"restored {restored} but the latest committed step is {latest}", flush=True)
        return 1
    for name, buffer in buffers.items():
        if bytes(buffer) != content(name, restored.step):
            print(f"region {name} does not hold step {restored.step}'s bytes", flush=True)
            return 1
    try:
        client.register_device_regions([("gpu", 0, 1 << 40, 4096, 0, "", [])])
        gpu = "registered"
    except moesnap.Error as error:
        gpu = error.code
    maps = Path("/proc/self/maps").read_text()
    cuda = "libcuda" in maps or "libcudart" in maps
    print(f"restored {restored.step} gpu {gpu} cuda loaded {cuda}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
