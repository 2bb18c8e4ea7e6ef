"""The core API, without PyTorch: the C++ client one to one over raw shared memory, the sparse
snapshot schedule and the placement planner, all through libmoesnap's C ABI.

``moesnap.Client`` (PyTorch) is built on this; use it directly to snapshot memory that is not a
tensor, or where torch is not installed::

    client = moesnap.core.Client("/run/moesnap/agent.sock", rank=0)
    memory = moesnap.core.SharedBuffer(1 << 20)           # mmap-able, buffer protocol
    (handle,) = client.share_memory([memory.fd])
    client.register_host_regions([("state", handle, 0, memory.size, "uint8", [memory.size])])
    memory[:5] = b"hello"; client.snapshot(1); client.wait_committed(1)
    ...                                                    # in a fresh process after a crash:
    client.restore()                                       # the bytes are back in the buffer
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import weakref
from ctypes import (byref, c_double, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64,
                    c_void_p)
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import _native
from ._native import Error, check, lib

__all__ = ["Client", "Error", "Operator", "Restored", "SharedBuffer", "SparseSchedule", "plan",
           "reconfigure", "recovery_probabilities"]

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # the constant is Python 3.10+; Linux's value
_LOG_DIRECTIONS = {"forward": 0, "backward": 1}


class SharedBuffer(mmap.mmap):
    """Host memory shared with moesnapd: a sealed shared-memory file holding ``bytes`` bytes
    (zeroed, reserved now) mapped here whole. It is an ``mmap``, so it has the buffer protocol:
    wrap it with ``torch.frombuffer`` or ``numpy.frombuffer`` (keep this object alive while they
    use it), and hand ``fd`` to ``Client.share_memory``. Under ``MOESNAP_HUGE_PAGES=1`` the file
    may be made of huge pages and rounded up to whole ones: ``len()`` is the mapping's, ``size``
    the bytes asked for, which is what to register."""

    def __new__(cls, bytes: int) -> SharedBuffer:
        fd = c_int(-1)
        check(lib.moesnap_shared_memory_create(bytes, byref(fd)))
        try:
            # The whole file: one in huge pages unmaps in whole pages only. MAP_POPULATE: page
            # tables filled now (first-touch faults cost about 10 us each on virtual machines).
            self = super().__new__(cls, fd.value, os.fstat(fd.value).st_size,
                                   flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd.value)
            raise
        self._fd = fd.value
        self._size = bytes
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self))
        weakref.finalize(self, os.close, fd.value)
        return self

    @property
    def size(self) -> int:
        """The bytes asked for (the mapping, ``len()``, may hold more: whole huge pages)."""
        return self._size

    @property
    def fd(self) -> int:
        """The file's descriptor, owned by this object: open while it lives."""
        return self._fd

    @property
    def address(self) -> int:
        """Where the bytes are mapped in this process."""
        return self._address


class Restored(NamedTuple):
    """What a restore wrote: the committed step, the regions and bytes written, the tier that
    served it (``"memory"`` or ``"durable"``) and, for ``restore_from``, the node whose snapshot
    served it (None on a daemon without a cluster) and whether it was decoded from parity."""
    step: int
    regions: int
    bytes: int
    tier: str
    node: Optional[int]
    decoded: bool


def _restored(result: _native.Restored) -> Restored:
    return Restored(result.step, result.regions, result.bytes,
                    "durable" if result.tier == 1 else "memory",
                    None if result.source_node < 0 else result.source_node, bool(result.decoded))


def _shape(shape: Sequence[int]):
    return _native.array(c_int64, shape), len(shape)


def _direction(direction: str) -> int:
    if direction not in _LOG_DIRECTIONS:
        raise Error("INVALID_ARGUMENT", f"a log direction is 'forward' (activations sent "
                                        f"downstream) or 'backward' (gradients sent upstream), "
                                        f"not '{direction}'")
    return _LOG_DIRECTIONS[direction]


class Client:
    """A connection of one trainer rank to moesnapd (``moesnap::Client``). ``socket_path``
    defaults to ``MOESNAP_SOCKET`` (else the daemon's default socket) and ``rank`` to ``RANK``
    (else ``LOCAL_RANK``, else 0). Raises ``Error`` ``UNAVAILABLE`` at once, naming the socket,
    when no daemon answers there."""

    def __init__(self, socket_path: Optional[str] = None, rank: Optional[int] = None,
                 call_timeout_s: float = 30.0, wait_timeout_s: float = 600.0) -> None:
        if rank is not None and not 0 <= rank < 1 << 32:
            raise Error("INVALID_ARGUMENT", f"rank {rank} is not in [0, 2^32)")
        path = None if socket_path is None else os.fsencode(socket_path)
        handle = c_void_p()
        check(lib.moesnap_client_connect(path, -1 if rank is None else rank, call_timeout_s,
                                         wait_timeout_s, byref(handle)))
        self._handle = handle
        self._close = weakref.finalize(self, lib.moesnap_client_close, handle)

    def close(self) -> None:
        """Ends the session now (otherwise when the object is collected). A snapshot whose capture
        has not ended is abandoned: its capture is aborted, and the regions may change at once."""
        self._close()

    @property
    def rank(self) -> int:
        return lib.moesnap_client_rank(self._handle)

    @property
    def node_id(self) -> int:
        return lib.moesnap_client_node_id(self._handle)

    def allocate_host(self, bytes: int) -> SharedBuffer:
        """Host memory the daemon can map (``SharedBuffer``)."""
        return SharedBuffer(bytes)

    def share_memory(self, fds: Sequence[int]) -> List[int]:
        """Hands shared-memory files (descriptors the caller keeps open, and unshrunk, while
        regions in them are registered) to the daemon; returns a handle per file, in order."""
        handles = (c_uint64 * len(fds))()
        check(lib.moesnap_client_share_memory(self._handle, _native.array(c_int, fds), len(fds),
                                              handles))
        return list(handles)

    def adopt_memory(self, bytes: int) -> Optional[Tuple[int, int]]:
        """A shared-memory file holding ``bytes`` bytes (of exactly that size, or in huge pages
        rounded up to whole ones: map its whole ``os.fstat`` size) that an exited process of this
        rank left with the daemon, as (descriptor, handle): handed over already, holding that
        process's bytes (restore or write them before reading). None when the daemon keeps
        none."""
        fd, handle = c_int(-1), c_uint64(0)
        check(lib.moesnap_client_adopt_memory(self._handle, bytes, byref(fd), byref(handle)))
        return None if handle.value == 0 else (fd.value, handle.value)

    def register_host_regions(self, regions: Sequence[Tuple[str, int, int, int, str,
                                                            Sequence[int]]]) -> None:
        """Registers (name, memory handle, offset, bytes, dtype, shape) tuples in one call."""
        converted = (_native.HostRegion * len(regions))()
        for slot, (name, memory, offset, size, dtype, shape) in zip(converted, regions):
            dimensions, length = _shape(shape)
            slot.name, slot.memory, slot.offset, slot.bytes = name.encode(), memory, offset, size
            slot.dtype, slot.shape, slot.shape_length = dtype.encode(), dimensions, length
        check(lib.moesnap_client_register_host_regions(self._handle, converted, len(regions)))

    def register_device_regions(self, regions: Sequence[Tuple[str, int, int, int, int, str,
                                                              Sequence[int]]]) -> None:
        """Registers GPU memory (CUDA IPC) in one call: (name, device, address, bytes, stream,
        dtype, shape) tuples, each ``bytes`` at device ``address`` inside memory from cudaMalloc,
        its capture event recorded on ``stream`` (0: the legacy default stream) at each snapshot,
        once per stream. The CUDA driver is loaded by the first such call."""
        converted = (_native.DeviceRegion * len(regions))()
        for slot, (name, device, address, size, stream, dtype, shape) in zip(converted, regions):
            dimensions, length = _shape(shape)
            slot.name, slot.device, slot.address, slot.bytes = name.encode(), device, address, size
            slot.stream, slot.dtype = stream, dtype.encode()
            slot.shape, slot.shape_length = dimensions, length
        check(lib.moesnap_client_register_device_regions(self._handle, converted, len(regions)))

    def set_replica_group(self, name: str, ranks: Sequence[int], regions: Sequence[str] = ()) -> None:
        """Declares ``regions`` (every registered region when empty) identical on ``ranks``, this
        rank among them (every member, in the same order on each): each member's snapshots then
        copy only its shard, and ``restore`` assembles the regions from all of them. No ranks:
        the regions are whole again."""
        check(lib.moesnap_client_set_replica_group(
            self._handle, name.encode(), _native.array(c_uint32, ranks), len(ranks),
            _native.strings(regions), len(regions)))

    def snapshot(self, step: int, regions: Sequence[str] = ()) -> int:
        """Starts capturing ``regions`` (all when empty) at ``step``; returns the bytes the daemon
        copies, 0 for a step it skipped (``take_skipped_steps`` says why)."""
        copied = c_uint64()
        check(lib.moesnap_client_snapshot(self._handle, step, _native.strings(regions),
                                          len(regions), byref(copied)))
        return copied.value

    def snapshot_sparse(self, step: int, regions: Sequence[str], window_first_step: int,
                        window_size: int, slot: int, buffer: int,
                        operators: Sequence[str] = ()) -> int:
        """``snapshot`` of a sparse step: slot ``slot`` of its window."""
        names = _native.strings(operators)
        sparse = _native.SparseSlot(window_first_step, window_size, slot, buffer, names,
                                    len(operators))
        copied = c_uint64()
        check(lib.moesnap_client_snapshot_sparse(self._handle, step, _native.strings(regions),
                                                 len(regions), byref(sparse), byref(copied)))
        return copied.value

    def wait_captured(self, step: int) -> None:
        check(lib.moesnap_client_wait_captured(self._handle, step))

    def wait_committed(self, step: int) -> None:
        check(lib.moesnap_client_wait_committed(self._handle, step))

    def commit(self, step: int) -> None:
        check(lib.moesnap_client_commit(self._handle, step))

    def restore(self, step: Optional[int] = None, regions: Sequence[str] = ()) -> Restored:
        """Writes the latest committed state (or ``step``, which must be the latest) into the
        registered ``regions`` (all when empty), checking every chunk's checksum."""
        result = _native.Restored()
        check(lib.moesnap_client_restore(self._handle, step is not None, step or 0,
                                         _native.strings(regions), len(regions), byref(result)))
        return _restored(result)

    def restore_from(self, source_rank: int, regions: Sequence[str] = ()) -> Restored:
        """Elastic restore: rank ``source_rank``'s latest committed ``regions`` (on any node of the
        cluster; decoded from parity when its node is lost) into this rank's regions."""
        result = _native.Restored()
        check(lib.moesnap_client_restore_from(self._handle, source_rank, _native.strings(regions),
                                              len(regions), byref(result)))
        return _restored(result)

    def latest_committed(self) -> Optional[int]:
        has_step, step = c_int32(), c_int64()
        check(lib.moesnap_client_latest_committed(self._handle, byref(has_step), byref(step)))
        return step.value if has_step.value else None

    def windows(self) -> Dict[str, Optional[Dict[str, Any]]]:
        """This rank's sparse windows: ``{"committed": ..., "open": ...}``, each None or a dict
        with ``first_step``, ``size``, ``buffer``, ``slots`` ((slot, step, committed, operators)
        tuples) and ``failure``."""
        text = c_void_p()
        check(lib.moesnap_client_windows(self._handle, byref(text)))
        windows = json.loads(_native.take_string(text))
        for window in windows.values():
            if window is not None:
                window["slots"] = [(s["slot"], s["step"], s["committed"], s["operators"])
                                   for s in window["slots"]]
        return windows

    def take_skipped_steps(self) -> List[Tuple[int, str]]:
        """Steps asked to snapshot that were not (skipped by the daemon, or lost with a daemon
        that went away), each with the reason; cleared by the call."""
        text = c_void_p()
        check(lib.moesnap_client_take_skipped_steps(self._handle, byref(text)))
        return [(step, reason) for step, reason in json.loads(_native.take_string(text))]

    def reconnect(self) -> None:
        """A new session with a restarted daemon (calls do it by themselves when they find the
        daemon gone)."""
        check(lib.moesnap_client_reconnect(self._handle))

    def append_log(self, step: int, micro_batch: int, direction: str, peer_rank: int,
                   payload: bytes) -> None:
        """Keeps what this rank sent to ``peer_rank`` at a pipeline boundary in the daemon's
        upstream log; ``direction`` is ``"forward"`` or ``"backward"``."""
        check(lib.moesnap_client_append_log(self._handle, step, micro_batch, _direction(direction),
                                            peer_rank, payload, len(payload)))

    def fetch_log(self, sender_rank: int, step: int, direction: str,
                  peer_rank: int) -> List[Tuple[int, bytes]]:
        """What ``sender_rank`` sent to ``peer_rank`` at ``step``: (micro-batch, payload) pairs."""
        messages = c_void_p()
        check(lib.moesnap_client_fetch_log(self._handle, sender_rank, step, _direction(direction),
                                           peer_rank, byref(messages)))
        try:
            fetched = []
            for index in range(lib.moesnap_log_messages_count(messages)):
                length = c_size_t()
                payload = lib.moesnap_log_messages_payload(messages, index, byref(length))
                fetched.append((lib.moesnap_log_messages_micro_batch(messages, index),
                                ctypes.string_at(payload, length.value) if length.value else b""))
            return fetched
        finally:
            lib.moesnap_log_messages_free(messages)


@dataclass
class Operator:
    """One expert of one layer, or a layer's non-expert and gate part."""
    name: str
    is_expert: bool
    full_state_bytes: int
    weight_bytes: int
    token_count: float = 0.0


class SparseSchedule:
    """The MoEtion sparse snapshot schedule: window size, operator order, what each slot
    captures. Immutable."""

    def __init__(self, handle: c_void_p) -> None:
        self._handle = handle
        weakref.finalize(self, lib.moesnap_schedule_free, handle)

    @staticmethod
    def build(operators: Sequence[Operator], iteration_seconds: float,
              copy_bytes_per_second: float, every_step_bytes: int = 0) -> SparseSchedule:
        converted = (_native.Operator * len(operators))(
            *[(op.name.encode(), bool(op.is_expert), op.full_state_bytes, op.weight_bytes,
               op.token_count) for op in operators])
        handle = c_void_p()
        check(lib.moesnap_schedule_build(converted, len(operators), iteration_seconds,
                                         copy_bytes_per_second, every_step_bytes, byref(handle)))
        return SparseSchedule(handle)

    def with_window(self, window: int) -> SparseSchedule:
        handle = c_void_p()
        check(lib.moesnap_schedule_with_window(self._handle, window, byref(handle)))
        return SparseSchedule(handle)

    @staticmethod
    def agreed_window(windows: Sequence[int]) -> int:
        return lib.moesnap_schedule_agreed_window(_native.array(c_int32, windows), len(windows))

    @property
    def window(self) -> int:
        return lib.moesnap_schedule_window(self._handle)

    @property
    def budget_bytes(self) -> int:
        return lib.moesnap_schedule_budget_bytes(self._handle)

    @property
    def order(self) -> List[int]:
        order = (c_int32 * lib.moesnap_schedule_operator_count(self._handle))()
        lib.moesnap_schedule_order(self._handle, order)
        return list(order)

    def slot_of_step(self, step: int) -> int:
        return lib.moesnap_schedule_slot_of_step(self._handle, step)

    def _slot(self, slot: int) -> Tuple[int, List[int]]:
        size, count = c_uint64(), c_size_t()
        captured = (c_int32 * lib.moesnap_schedule_operator_count(self._handle))()
        check(lib.moesnap_schedule_slot(self._handle, slot, byref(size), captured, byref(count)))
        return size.value, list(captured[:count.value])

    def captured_in_slot(self, slot: int) -> List[int]:
        return self._slot(slot)[1]

    def slot_bytes(self, slot: int) -> int:
        return self._slot(slot)[0]

    def captured_by(self, operator_index: int, slot: int) -> bool:
        captured = c_int32()
        check(lib.moesnap_schedule_captured_by(self._handle, operator_index, slot,
                                               byref(captured)))
        return bool(captured.value)

    def needs_reorder(self, token_counts: Sequence[float]) -> bool:
        return bool(lib.moesnap_schedule_needs_reorder(
            self._handle, _native.array(c_double, token_counts), len(token_counts)))

    def needs_regeneration(self, iteration_seconds: float) -> bool:
        return bool(lib.moesnap_schedule_needs_regeneration(self._handle, iteration_seconds))


def _placement(placement: Sequence[Sequence[int]]) -> _native.Placement:
    offsets = [0]
    for node in placement:
        offsets.append(offsets[-1] + len(node))
    experts = _native.array(c_int32, [expert for node in placement for expert in node])
    return _native.Placement(experts, _native.array(c_size_t, offsets), len(placement))


def _json_result(call, *arguments) -> Any:
    text = c_void_p()
    check(call(*arguments, byref(text)))
    return json.loads(_native.take_string(text))


def plan(loads: Sequence[float], nodes: int, slots: int, min_replicas: int = 1,
         failed: Sequence[int] = ()) -> Dict[str, Any]:
    """Expert replica allocation, maximum-rank-overlap placement, recovery probability per number
    of failed nodes (beside a spread placement) and, with ``failed``, the transfers onto the
    survivors ('from' None: from the snapshot cluster)."""
    result = _json_result(lib.moesnap_plan, _native.array(c_double, loads), len(loads), nodes,
                          slots, min_replicas, _native.array(c_int32, failed), len(failed))
    for row in result["recovery"]:
        row["overlap_interval"] = tuple(row["overlap_interval"])
    return result


def reconfigure(loads: Sequence[float], nodes: int, slots: int, min_replicas: int,
                current: Sequence[Sequence[int]], failed: Sequence[int],
                expert_bytes: Sequence[int] = ()) -> Dict[str, Any]:
    """The reconfiguration of placement ``current`` (a list per node) once ``failed`` nodes are
    gone (every node that is gone, earlier losses too): the allocation over the survivors, the
    new placement and the transfers onto them ('from' None: no survivor holds the expert)."""
    if expert_bytes and len(expert_bytes) != len(loads):
        raise Error("INVALID_ARGUMENT",
                    f"{len(expert_bytes)} expert sizes for {len(loads)} experts")
    sizes = _native.array(c_uint64, expert_bytes) if expert_bytes else None
    placement = _placement(current)
    return _json_result(lib.moesnap_reconfigure, _native.array(c_double, loads), len(loads), nodes,
                        slots, min_replicas, byref(placement), _native.array(c_int32, failed),
                        len(failed), sizes)


def recovery_probabilities(placement: Sequence[Sequence[int]],
                           experts: int) -> List[Dict[str, Any]]:
    """For 0..N failed nodes of ``placement`` (experts per node), chosen uniformly: the
    probability that every one of ``experts`` experts keeps a replica (exact over node subsets
    while they are few, else sampled with a 95% interval)."""
    converted = _placement(placement)
    rows = _json_result(lib.moesnap_recovery_probabilities, byref(converted), experts)
    for row in rows:
        row["interval"] = tuple(row["interval"])
    return rows
