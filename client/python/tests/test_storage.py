"""Storages registered whole move into one shared-memory file per registration (the storage
library, client/python/native/torch_storage.h) and stay the storages every view uses; the file
goes with the last tensor; a restarted trainer takes the file its killed process left (in ordinary
or huge pages); under another torch release each storage gets a file of its own."""

import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

import moesnap
from moesnap import _storage
from conftest import Daemon


def shared_files():
    """(descriptors, mappings) of this process's moesnap shared-memory files."""
    descriptors = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if "moesnap-region" in os.readlink(f"/proc/self/fd/{name}"):
                descriptors.append(name)
        except FileNotFoundError:  # the descriptor listdir read the folder with
            pass
    mappings = [line for line in Path("/proc/self/maps").read_text().splitlines()
                if "moesnap-region" in line]
    return descriptors, mappings


def flat_model():
    """Two parameters viewing one flat buffer, as FSDP's flat parameters do, and a third tied to
    the first (the same Parameter in two modules)."""
    flat = torch.arange(20, dtype=torch.float32)
    model = torch.nn.Module()
    model.first = torch.nn.Module()
    model.first.weight = torch.nn.Parameter(flat[0:12].view(3, 4))
    model.second = torch.nn.Module()
    model.second.weight = torch.nn.Parameter(flat[12:20].view(2, 4))
    model.tied = torch.nn.Module()
    model.tied.weight = model.first.weight
    return model, flat


def test_the_torch_of_this_build_gets_the_storage_library():
    assert _storage.library() is not None, "the build carries no storage library for this torch"


def test_views_of_a_flat_buffer_and_tied_weights_stay_views_of_one_moved_storage(daemon: Daemon):
    model, flat = flat_model()
    storage = _storage.untyped_storage(flat)
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", model)
    before = storage.data_ptr()
    client.snapshot(1)
    client.wait_committed(1)

    assert storage.data_ptr() != before  # moved, as the same storage object
    assert _storage.untyped_storage(model.first.weight)._cdata == storage._cdata
    assert model.first.weight.data_ptr() == flat.data_ptr()
    assert model.second.weight.data_ptr() == flat.data_ptr() + 12 * 4
    assert model.tied.weight is model.first.weight
    assert torch.equal(flat, torch.arange(20, dtype=torch.float32))  # its bytes came along
    with torch.no_grad():
        flat[13] = -1.0
    assert model.second.weight[0, 1] == -1.0
    # The daemon copied what the views hold: a restore brings back step 1 through all of them.
    with torch.no_grad():
        model.first.weight.fill_(7.0)
    client.restore()
    assert torch.equal(flat, torch.arange(20, dtype=torch.float32))
    assert torch.equal(model.tied.weight, torch.arange(12, dtype=torch.float32).view(3, 4))


def test_one_file_holds_a_registration_and_goes_with_its_last_tensor(daemon: Daemon):
    gc.collect()
    descriptors_before, mappings_before = (len(found) for found in shared_files())
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(50)))  # 100 tensors
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", model)
    client.snapshot(1)
    client.wait_committed(1)
    descriptors, mappings = shared_files()
    assert (len(descriptors), len(mappings)) == (descriptors_before + 1, mappings_before + 1), \
        (descriptors, mappings)
    weight = model[3].weight
    del client, model
    gc.collect()
    assert len(shared_files()[1]) == mappings_before + 1  # a tensor still uses it
    del weight
    gc.collect()
    assert tuple(len(found) for found in shared_files()) == (descriptors_before, mappings_before)


def test_a_first_restore_writes_the_file_and_copies_only_storages_it_does_not_cover(
        daemon: Daemon, monkeypatch):
    saved = torch.nn.Linear(8, 4)
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", saved)
    backing = torch.arange(40, dtype=torch.float32)
    client.register_tensor("part", backing[8:24])  # bytes 0-31 and 96-159 are in no region
    client.snapshot(1)
    client.wait_committed(1)
    expected = {key: value.detach().clone() for key, value in saved.state_dict().items()}

    copies = []
    move = _storage.SharedFile.move

    def recording(file, storages, offsets, copy):
        copies.extend((storage.nbytes(), copy) for storage in storages)
        move(file, storages, offsets, copy)

    monkeypatch.setattr(_storage.SharedFile, "move", recording)
    fresh = torch.nn.Linear(8, 4)
    backing = torch.full((40,), -1.0)
    restarted = moesnap.Client(daemon.agent_socket, 0)
    restarted.register_module("model", fresh)
    restarted.register_tensor("part", backing[8:24])
    assert copies == []  # nothing moves at registration
    assert restarted.restore() == 1
    assert sorted(copies) == [(16, False), (128, False), (160, True)]
    assert all(torch.equal(value, expected[key]) for key, value in fresh.state_dict().items())
    assert torch.equal(backing[8:24], torch.arange(8, 24, dtype=torch.float32))
    assert torch.equal(backing[:8], torch.full((8,), -1.0))  # kept: no region names them
    assert torch.equal(backing[24:], torch.full((16,), -1.0))


def test_a_failed_restore_leaves_the_tensors_where_and_as_they_were(daemon: Daemon):
    model = torch.nn.Linear(4, 3)
    expected = model.weight.detach().clone()
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", model)
    address = model.weight.data_ptr()
    with pytest.raises(moesnap.Error) as error:
        client.restore()  # nothing committed yet
    assert error.value.code == "NOT_FOUND"
    assert model.weight.data_ptr() == address
    assert torch.equal(model.weight, expected)
    client.snapshot(1)  # and they move, with their bytes, at the first snapshot
    client.wait_committed(1)
    assert model.weight.data_ptr() != address
    assert torch.equal(model.weight, expected)


def test_a_storage_in_shared_memory_already_stays_in_its_own_file(daemon: Daemon):
    model = torch.nn.Linear(4, 3)
    model.share_memory()  # other processes may map it (Hogwild): it must not move
    address = model.weight.data_ptr()
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", model)
    client.snapshot(1)
    client.wait_committed(1)
    assert model.weight.data_ptr() == address
    assert _storage.untyped_storage(model.weight).is_shared()


def test_under_another_torch_release_each_storage_gets_a_file_of_its_own(daemon: Daemon,
                                                                         monkeypatch):
    monkeypatch.setattr(_storage, "_library", _storage._UNDECIDED)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    model, flat = flat_model()
    client = moesnap.Client(daemon.agent_socket, 0)
    with pytest.warns(RuntimeWarning, match=r"built for torch \d+\.\d+\.\d+'s storage layout, "
                                            r"this is torch 9\.9\.9"):
        client.register_module("model", model)
    assert _storage.library() is None  # decided once: no second warning
    assert _storage.untyped_storage(flat).is_shared()
    assert model.second.weight.data_ptr() == flat.data_ptr() + 12 * 4
    client.snapshot(1)
    client.wait_committed(1)
    with torch.no_grad():
        flat.zero_()
    client.restore()
    assert torch.equal(flat, torch.arange(20, dtype=torch.float32))


# A trainer process for the test below: registers a model of LAYERS linear layers of WIDTH
# (initialized from SEED) and prints what it took over from the daemon, then:
#   crash:    snapshots step 1, prints the digest of every parameter's bytes, scribbles over the
#             parameters (what the next steps would do) and dies by SIGKILL;
#   restore:  restores and prints the step and the digest;
#   snapshot: prints the digest, snapshots step 2, prints the digest again (its own values, kept);
#   register: registers only.
_TRAINER = """
import hashlib, os, signal, sys
import torch
import moesnap
socket_path, mode, layers, width, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
torch.manual_seed(seed)
model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
def digest():
    hashed = hashlib.sha256()
    for name, value in model.state_dict().items():
        hashed.update(name.encode() + value.detach().numpy().tobytes())
    return hashed.hexdigest()
client = moesnap.Client(socket_path, 0)
client.register_module("model", model)
print("adopted", client.adopted_bytes, flush=True)
with open("/proc/self/smaps") as smaps:  # the page size of the registration's file
    mapping = ""
    for line in smaps:
        if line[:1] in "0123456789abcdef" and " " in line:
            mapping = line
        elif line.startswith("KernelPageSize:") and "moesnap-region" in mapping:
            print("pages", line.split(":", 1)[1].strip(), flush=True)
            break
if mode == "crash":
    client.snapshot(1)
    client.wait_committed(1)
    print("digest", digest(), flush=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(7.0)
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "restore":
    print("restored", client.restore(), flush=True)
    print("digest", digest(), flush=True)
elif mode == "snapshot":
    print("before", digest(), flush=True)
    client.snapshot(2)
    client.wait_committed(2)
    print("digest", digest(), flush=True)
"""


def run_trainer(daemon: Daemon, mode: str, layers: int, width: int, seed: int,
                huge_pages: bool = False) -> dict:
    """Runs _TRAINER to its end (with MOESNAP_HUGE_PAGES=1 when ``huge_pages``); returns its
    printed values by key."""
    environment = dict(os.environ, MOESNAP_HUGE_PAGES="1" if huge_pages else "0")
    finished = subprocess.run([sys.executable, "-c", _TRAINER, daemon.agent_socket, mode,
                               str(layers), str(width), str(seed)],
                              capture_output=True, text=True, timeout=300, env=environment)
    assert finished.returncode == (-9 if mode == "crash" else 0), finished.stderr
    return dict(line.split(" ", 1) for line in finished.stdout.splitlines())


def test_a_restarted_trainer_takes_the_memory_its_killed_process_left(daemon: Daemon):
    # One file holds the registration: 16 weights and 16 biases, laid out as the client does.
    file_bytes = _storage.layout([4 * 128 * 128, 4 * 128] * 16)[-1]
    crashed = run_trainer(daemon, "crash", layers=16, width=128, seed=1)
    assert crashed["adopted"] == "0"
    # The same model (other initial weights): its registration takes the killed process's file,
    # which holds what the killed process scribbled, and the restore gives back exactly step 1.
    restarted = run_trainer(daemon, "restore", layers=16, width=128, seed=2)
    assert int(restarted["adopted"]) == file_bytes
    assert restarted["restored"] == "1"
    assert restarted["digest"] == crashed["digest"]
    # A process that takes the file over and trains on without restoring keeps its own values.
    trained = run_trainer(daemon, "snapshot", layers=16, width=128, seed=3)
    assert int(trained["adopted"]) == file_bytes
    assert trained["digest"] == trained["before"] != crashed["digest"]
    # A model of another size finds no file of its size: it allocates, as a first process does.
    other = run_trainer(daemon, "register", layers=32, width=128, seed=4)
    assert other["adopted"] == "0"
    assert restarted["pages"] == other["pages"] == "4 kB"


@pytest.fixture
def huge_pages() -> Iterator[int]:
    """At least 48 huge pages of 2 MiB free while the test runs (vm.nr_hugepages raised as root,
    and put back), as the C++ tests' HugePageReservation makes them; their size in bytes. Skips,
    saying why, where they cannot be had."""
    def meminfo(field: str) -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    def free() -> int:  # free and not promised to a mapping already
        return max(0, meminfo("HugePages_Free") - meminfo("HugePages_Rsvd"))

    needed, page, pool = 48, meminfo("Hugepagesize") * 1024, Path("/proc/sys/vm/nr_hugepages")
    if page != 2 << 20:
        pytest.skip(f"the test's sizes are made for huge pages of 2 MiB; this system's are "
                    f"{page} bytes")
    missing, before = needed - free(), None
    if missing > 0:
        if os.geteuid() != 0:
            pytest.skip(f"{needed} huge pages must be free, and reserving them "
                        f"(vm.nr_hugepages) needs root")
        try:
            before = int(pool.read_text())
            pool.write_text(f"{before + missing}\n")
        except OSError as error:
            pytest.skip(f"cannot raise vm.nr_hugepages: {error}")
    try:
        if free() < needed:
            pytest.skip(f"the kernel found {free()} of the {needed} huge pages needed")
        yield page
    finally:
        if before is not None:
            pool.write_text(f"{before}\n")


def test_a_trainer_in_huge_pages_restarts_into_the_huge_pages_its_killed_process_left(
        daemon: Daemon, huge_pages: int):
    # 64 MiB of weights and 64 KiB of biases: the file rounds up to whole huge pages.
    file_bytes = _storage.layout([4 * 1024 * 1024, 4 * 1024] * 16)[-1]
    assert file_bytes % huge_pages != 0
    crashed = run_trainer(daemon, "crash", layers=16, width=1024, seed=1, huge_pages=True)
    assert crashed["pages"] == f"{huge_pages // 1024} kB"
    restarted = run_trainer(daemon, "restore", layers=16, width=1024, seed=2, huge_pages=True)
    assert int(restarted["adopted"]) == file_bytes
    assert restarted["pages"] == f"{huge_pages // 1024} kB"
    assert restarted["restored"] == "1"
    assert restarted["digest"] == crashed["digest"]


def test_a_shared_buffer_in_huge_pages_is_mapped_whole_and_sized_as_asked(huge_pages: int,
                                                                          monkeypatch):
    monkeypatch.setenv("MOESNAP_HUGE_PAGES", "1")
    asked = 8 * huge_pages + 100
    buffer = moesnap.SharedBuffer(asked)
    assert buffer.size == asked
    assert len(buffer) == os.fstat(buffer.fd).st_size == 9 * huge_pages
    assert "KernelPageSize:     2048 kB" in mapping_of(buffer.address)
    buffer[len(buffer) - 1:] = b"\x01"  # the whole file is mapped
    buffer.close()  # unmapped whole: a huge-page mapping unmaps in whole pages only


def test_state_registered_in_huge_pages_restores_into_ordinary_pages(daemon: Daemon,
                                                                    huge_pages: int,
                                                                    monkeypatch):
    """A region is the bytes asked for whichever pages hold it, so a process that got huge pages
    and its successor that did not register the same region."""
    class State:
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    capacity = 8 * huge_pages + 1000  # rounded up by most of a page in huge pages
    monkeypatch.setenv("MOESNAP_HUGE_PAGES", "1")
    first = moesnap.Client(daemon.agent_socket, 0)
    state = State(41)
    first.register_state("counters", state, capacity=capacity)
    first.snapshot(1)
    first.wait_committed(1)
    # A state grown past its capacity is refused, though the file's last page has room for it.
    state.value = b"x" * capacity
    with pytest.raises(moesnap.Error) as error:
        first.snapshot(2)
    assert error.value.code == "RESOURCE_EXHAUSTED"
    first.close()
    monkeypatch.setenv("MOESNAP_HUGE_PAGES", "0")
    second = moesnap.Client(daemon.agent_socket, 0)
    restored = State(0)
    second.register_state("counters", restored, capacity=capacity)
    assert second.restore() == 1
    assert restored.value == 41


def mapping_of(address: int) -> str:
    """This process's /proc/self/smaps entry of the mapping at ``address``."""
    entries = Path("/proc/self/smaps").read_text().split("\n")
    for i, line in enumerate(entries):
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            start = int(line.split("-", 1)[0], 16)
            if start == address:
                following = entries[i + 1:]
                end = next((j for j, entry in enumerate(following)
                            if entry[:1] in "0123456789abcdef" and "-" in entry.split(" ", 1)[0]),
                           len(following))
                return "\n".join([line] + following[:end])
    raise AssertionError(f"no mapping at {address:#x}")
