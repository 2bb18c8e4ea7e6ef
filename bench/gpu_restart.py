#!/usr/bin/python3
"""What a restarted GPU trainer feels: a fresh process getting 1 GiB of CUDA state back.

A fresh process connecting to moesnapd, registering a model of 1,024 Linear(512, 512) layers on the
GPU (2,048 tensors, 1 GiB) and restoring it from the daemon's pinned pool, against a fresh
process's torch.load of the same state from /dev/shm onto the GPU (map_location="cuda"). Each is
timed from after its imports, CUDA start and model construction to every tensor on the GPU
(torch.cuda.synchronize), best of 3; the restored bytes are checked against the saved state.
Starts its own moesnapd (--bin-dir) with its pool locked and --capture-threads copy threads.
Prints one line per figure, "name|value|unit|baseline|baseline_value", as moesnap-bench does.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import moesnap

LAYERS, WIDTH, RANK = 1024, 512, 0


def model_on_gpu(initialize: bool) -> torch.nn.Module:
    make = torch.nn.Linear if initialize else \
        lambda *shape: torch.nn.utils.skip_init(torch.nn.Linear, *shape, device="cuda")
    model = torch.nn.ModuleList(make(WIDTH, WIDTH) for _ in range(LAYERS))
    return model.cuda()


def child(kind: str, socket_path: str, shm_path: str) -> None:
    """A fresh trainer process: prints the seconds it took to have the state on the GPU, and
    whether it equals the saved state."""
    model = model_on_gpu(initialize=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if kind == "moesnap":
        client = moesnap.Client(socket_path, RANK)
        client.register_module("model", model)
        client.restore()
        state = model.state_dict()
    else:
        state = torch.load(shm_path, map_location="cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    saved = torch.load(shm_path, map_location="cuda")
    exact = saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in saved)
    print(seconds, int(exact), flush=True)
    if kind == "moesnap":
        os.kill(os.getpid(), signal.SIGKILL)  # as a crashed trainer dies


def start_daemon(bin_dir: Path, directory: Path, threads: int) -> subprocess.Popen:
    config = directory / "moesnapd.toml"
    config.write_text(
        f'[agent]\nsocket = "{directory}/agent.sock"\n[admin]\nsocket = "{directory}/admin.sock"\n'
        f'[http]\naddress = ""\n[pool]\nname = "moesnap-gpu-restart-{os.getpid()}"\n'
        f'bytes = "3GiB"\njournal_bytes = "8MiB"\nlock = "required"\n'
        f'[capture]\nthreads = {threads}\n')
    daemon = subprocess.Popen([str(bin_dir / "moesnapd"), "--config", str(config)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"moesnapd exited with {daemon.returncode}")
        try:
            # A rank the measurement does not use: its connection proves the daemon serves.
            moesnap.Client(str(directory / "agent.sock"), RANK + 1).close()
            return daemon
        except moesnap.Error:
            time.sleep(0.05)
    stop_daemon(daemon)
    raise RuntimeError("moesnapd did not start serving")


def stop_daemon(daemon: subprocess.Popen) -> None:
    daemon.send_signal(signal.SIGTERM)
    daemon.wait()
    for suffix in (".data", ".journal"):  # the pool outlives the daemon, by design
        Path(f"/dev/shm/moesnap-gpu-restart-{os.getpid()}{suffix}").unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", help="where moesnapd is")
    parser.add_argument("--capture-threads", type=int, default=6)
    parser.add_argument("--child", choices=["moesnap", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--shm-path", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        child(arguments.child, arguments.socket, arguments.shm_path)
        return 0

    with tempfile.TemporaryDirectory(prefix="moesnap-gpu-restart-") as name:
        directory = Path(name)
        daemon = start_daemon(Path(arguments.bin_dir), directory, arguments.capture_threads)
        shm_path = f"/dev/shm/moesnap-gpu-restart-{os.getpid()}.pt"
        try:
            torch.manual_seed(0)
            model = model_on_gpu(initialize=True)
            state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            tensors = len(model.state_dict())
            socket_path = str(directory / "agent.sock")
            client = moesnap.Client(socket_path, RANK)
            client.register_module("model", model)
            client.snapshot(1)
            client.wait_committed(1)
            torch.save(model.state_dict(), shm_path)
            client.close()

            def fresh(kind: str) -> float:
                run = subprocess.run([sys.executable, __file__, "--child", kind, "--socket",
                                      socket_path, "--shm-path", shm_path],
                                     capture_output=True, text=True)
                if run.returncode != (-signal.SIGKILL if kind == "moesnap" else 0):
                    raise RuntimeError(f"the {kind} child failed: {run.stderr}")
                seconds, exact = run.stdout.split()
                if exact != "1":
                    raise RuntimeError(f"the {kind} child's state differs from the saved state")
                return float(seconds)

            restored = min(fresh("moesnap") for _ in range(3))
            loaded = min(fresh("torch") for _ in range(3))
        finally:
            if os.path.exists(shm_path):
                os.unlink(shm_path)
            stop_daemon(daemon)
    shape = f"{state_bytes / (1 << 30):.2f} GiB in {tensors} GPU tensors"
    print(f"fresh process: connect, register and restore {shape}, {arguments.capture_threads} "
          f"capture threads|{restored * 1e3:.1f}|ms|fresh process: torch.load from /dev/shm "
          f"onto the GPU|{loaded * 1e3:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
