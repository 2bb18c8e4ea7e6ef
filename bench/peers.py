#!/usr/bin/python3
"""The peers benchmark: one PyTorch model state checkpointed three ways in one run.

A trainer's blocking time per checkpoint with moesnap (the Snapshot call; the copy runs while the
next step computes, so the stall is max(0, copy - compute)) against torch.save of the same state to
/dev/shm (what in-memory checkpointing of other tools does) and to disk with fsync; and the time to
get the state back after a crash: moesnap's restore against torch.load from each. Prints one line
per figure, "name|value|unit|baseline|baseline_value", for moesnap-bench.

Then what a restarted trainer feels end to end: a fresh process connecting, registering a state of
1 GiB in 2,048 tensors and restoring it, against a fresh process's torch.load of the same state
from /dev/shm (each timed from after its imports and model construction, best of 3; both end with
every tensor in memory and usable, the model's for moesnap, the returned state dict's for
torch.load, which is not loaded into a model). Three times: as the rank's first process on the
node (allocating its shared memory), the same in huge pages (MOESNAP_HUGE_PAGES=1; the pages
reserved for the run as root, else the row is left out saying why), and as the process after a
killed one, which takes over the memory the daemon kept from it.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

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


# The restart row's state: 1,024 Linear(512, 512) layers, 2,048 tensors of 1 GiB in all.
RESTART_LAYERS, RESTART_WIDTH, RESTART_RANK = 1024, 512, 1


def restart_model(initialize: bool) -> torch.nn.Module:
    make = torch.nn.Linear if initialize else \
        lambda *shape: torch.nn.utils.skip_init(torch.nn.Linear, *shape)
    return torch.nn.ModuleList(make(RESTART_WIDTH, RESTART_WIDTH) for _ in range(RESTART_LAYERS))


def restart_child(kind: str, socket_path: str, shm_path: str) -> None:
    """A fresh trainer process getting the state back; prints the seconds it took, for moesnap
    after those of its phases (connect, register, restore) and the bytes it took over from the
    daemon; a moesnap trainer then dies by SIGKILL, as a crashed one does."""
    model = restart_model(initialize=False)
    start = time.perf_counter()
    if kind == "moesnap":
        client = moesnap.Client(socket_path, RESTART_RANK)
        connected = time.perf_counter()
        client.register_module("model", model)
        registered = time.perf_counter()
        client.restore()
        end = time.perf_counter()
        print(connected - start, registered - connected, end - registered, client.adopted_bytes,
              registration_page_kb(), end - start, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        torch.load(shm_path)
        print(time.perf_counter() - start, flush=True)


def registration_page_kb() -> int:
    """The page size, in KiB, of this process's largest moesnap shared-memory mapping."""
    largest, page, mapping = 0, 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            mapping = line if "moesnap-region" in line else None
        elif mapping and fields[0] == "KernelPageSize:":
            start, end = (int(address, 16) for address in mapping.split()[0].split("-"))
            if end - start > largest:
                largest, page = end - start, int(fields[1])
    return page


def forget_kept_memory(socket_path: str) -> None:
    """Makes the rank's next process allocate its memory, as on a node where no process of the rank
    ran before: what the daemon keeps for the rank is replaced by the memory of a process that
    still runs (this one), which is never handed on."""
    holder = moesnap.Client(socket_path, RESTART_RANK)
    holder.register_tensor("holder", torch.zeros(1 << 18))  # 1 MiB: a file the daemon keeps
    holder.close()


HUGE_PAGE_POOL = Path("/proc/sys/vm/nr_hugepages")


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def free_huge_pages() -> int:
    """Huge pages free and not promised to a mapping already."""
    return meminfo("HugePages_Free") - meminfo("HugePages_Rsvd")


def reserve_huge_pages(state_bytes: int) -> Optional[int]:
    """Makes room in huge pages for two of the restart's states (a child's, and the one the daemon
    keeps from the child before it until it is replaced); returns vm.nr_hugepages to put back.
    Raises RuntimeError saying why when they cannot be had."""
    page = meminfo("Hugepagesize") * 1024
    if page == 0:
        raise RuntimeError("this kernel has no huge pages")
    needed = 2 * (state_bytes // page + 2)
    missing = needed - free_huge_pages()
    if missing <= 0:
        return None
    if os.geteuid() != 0:
        raise RuntimeError(f"{needed} huge pages must be free, and reserving them needs root")
    try:
        before = int(HUGE_PAGE_POOL.read_text())
        HUGE_PAGE_POOL.write_text(f"{before + missing}\n")
    except OSError as error:
        raise RuntimeError(f"cannot raise vm.nr_hugepages: {error}") from error
    if free_huge_pages() < needed:
        HUGE_PAGE_POOL.write_text(f"{before}\n")
        raise RuntimeError(f"the kernel could not reserve {needed} huge pages")
    return before


def restart_rows(socket_path: str):
    torch.manual_seed(0)
    model = restart_model(initialize=True)
    tensors = len(model.state_dict())
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    client = moesnap.Client(socket_path, RESTART_RANK)
    client.register_module("model", model)
    client.snapshot(1)
    client.wait_committed(1)
    shm_path = f"/dev/shm/moesnap-peers-restart-{os.getpid()}.pt"
    try:
        torch.save(model.state_dict(), shm_path)
        client.close()
        del client, model

        def fresh(kind: str, huge_pages: bool = False):
            """(seconds, the child's figures)."""
            environment = dict(os.environ, MOESNAP_HUGE_PAGES="1" if huge_pages else "0")
            child = subprocess.run([sys.executable, __file__, "--socket", socket_path,
                                    "--restart-child", kind, "--shm-path", shm_path],
                                   capture_output=True, text=True, env=environment)
            if child.returncode != (-signal.SIGKILL if kind == "moesnap" else 0):
                raise RuntimeError(f"the restart child failed: {child.stderr}")
            figures = [float(figure) for figure in child.stdout.split()]
            return figures[-1], figures

        def allocating(huge_pages: bool = False):
            forget_kept_memory(socket_path)
            return fresh("moesnap", huge_pages)

        first_start, first_phases = min(allocating() for _ in range(3))
        huge_start, huge_phases, huge_missing = None, None, None
        try:
            restore_pool = reserve_huge_pages(state_bytes)
        except RuntimeError as error:
            huge_missing = str(error)
        else:
            try:
                huge_start, huge_phases = min(allocating(huge_pages=True) for _ in range(3))
                forget_kept_memory(socket_path)  # gives the last child's huge pages back
            finally:
                if restore_pool is not None:
                    HUGE_PAGE_POOL.write_text(f"{restore_pool}\n")
        # Each child takes the memory the one before it left when it was killed.
        fresh("moesnap")
        restart, restart_phases = min(fresh("moesnap") for _ in range(3))
        torch_restart, _ = min(fresh("torch") for _ in range(3))
    finally:
        os.unlink(shm_path)
    if first_phases[3] != 0 or restart_phases[3] != state_bytes or (
            huge_phases is not None and huge_phases[3] != 0):
        raise RuntimeError(f"a first start took over {first_phases[3]:.0f} bytes and a restart "
                           f"{restart_phases[3]:.0f} of {state_bytes}")
    if huge_phases is not None and huge_phases[4] != meminfo("Hugepagesize"):
        huge_missing = f"the child got pages of {huge_phases[4]:.0f} KiB"
        huge_start, huge_phases = None, None
    shape = f"({state_bytes / (1 << 30):.2f} GiB, {tensors} tensors)"
    baseline = "fresh process: torch.load from /dev/shm"
    rows = [(f"fresh process: connect, register and restore {shape}", first_start * 1e3, "ms",
             baseline, torch_restart * 1e3),
            (f"restarted process, taking over its killed process's memory: connect, register and "
             f"restore {shape}", restart * 1e3, "ms", baseline, torch_restart * 1e3)]
    if huge_start is not None:
        rows.insert(1, (f"fresh process in huge pages: connect, register and restore {shape}",
                        huge_start * 1e3, "ms", baseline, torch_restart * 1e3))

    def by_phase(phases):
        return (f"connect {phases[0] * 1e3:.0f} ms, register {phases[1] * 1e3:.0f} ms, restore "
                f"{phases[2] * 1e3:.0f} ms")

    huge = (f"In huge pages: {by_phase(huge_phases)}." if huge_phases is not None else
            f"In huge pages: not measured ({huge_missing}).")
    note = (f"note|Fresh process (the rank's first), best of 3 by phase: {by_phase(first_phases)}. "
            f"{huge} Restarted process, best of 3: {by_phase(restart_phases)}.")
    return rows, note


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
    parser.add_argument("--restart-child", choices=("moesnap", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--shm-path", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    if arguments.restart_child:
        restart_child(arguments.restart_child, arguments.socket, arguments.shm_path)
        return

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
    del client, model, optimizer, checkpoint  # the restart rows need the memory
    restart, note = restart_rows(arguments.socket)
    for name, value, unit, baseline, baseline_value in rows + restart:
        print(f"{name}|{value:.3f}|{unit}|{baseline}|{baseline_value:.3f}", flush=True)
    print(note, flush=True)


if __name__ == "__main__":
    main()
