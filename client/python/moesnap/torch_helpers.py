"""PyTorch on top of libmoesnap: tensors moved into memory the daemon shares, optimizer state,
and non-tensor state (RNG, data-loader position) serialized into host regions at each snapshot."""

from __future__ import annotations

import pickle
import random
import struct
from typing import Any, Dict, Iterable, List, Optional, Protocol, Tuple

import numpy
import torch

from . import _moesnap
from ._moesnap import Error

_ALIGNMENT = 64  # bytes between tensors in a shared buffer: SIMD copies and CRCs stay aligned
_LENGTH_PREFIX = struct.Struct("<Q")


class StateProvider(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``: a loss scaler, a sampler."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RandomState:
    """The Python, NumPy and PyTorch CPU random generators as one state provider."""

    def state_dict(self) -> Dict[str, Any]:
        return {"python": random.getstate(), "numpy": numpy.random.get_state(),
                "torch": torch.get_rng_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        random.setstate(state["python"])
        numpy.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates Adam/AdamW state now, as their first ``step()`` would, so it can be registered
    before training starts. The values are exactly those of the lazy initialization (zero moments,
    step 0), so a run that calls this trains bit-identically to one that does not."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"initialize_optimizer_state knows Adam and AdamW, not "
                        f"{type(optimizer).__name__}: run one optimizer step before registering")
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state[parameter]
            if state:
                continue
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(parameter,
                                                           memory_format=torch.preserve_format)


class Client:
    """One trainer rank's connection to its node's moesnapd.

    Register everything first (modules, optimizers, other state), then per step: ``snapshot(step)``
    right after ``optimizer.step()`` and ``wait_captured()`` before the next ``optimizer.step()``.
    Not thread-safe: use it from the training thread.
    """

    def __init__(self, socket_path: str, rank: int, *, call_timeout_s: float = 30.0,
                 wait_timeout_s: float = 600.0) -> None:
        self._native = _moesnap.Client(socket_path, rank, call_timeout_s, wait_timeout_s)
        self._tensors: Dict[str, Tuple[torch.Tensor, int, int]] = {}  # name -> (tensor, address, bytes)
        # name -> (buffer, offset) of host tensors, so that aliases can name the same bytes
        self._host_places: Dict[str, Tuple[_moesnap.SharedBuffer, int]] = {}
        self._states: Dict[str, Tuple[StateProvider, memoryview]] = {}
        self._buffers: List[_moesnap.SharedBuffer] = []  # keep shared memory mapped
        self._last_snapshot: Optional[int] = None
        self._restore_tier: Optional[str] = None

    # Registration -------------------------------------------------------------------------------

    def register_module(self, name: str, module: torch.nn.Module) -> None:
        """Registers every parameter and buffer of ``module`` as a region named ``name.<key>``
        (its state-dict key). CPU storage moves into shared memory in place: the module keeps its
        Parameter objects, and optimizers holding them keep working. CUDA tensors stay where they
        are and are shared with the daemon by CUDA IPC."""
        self._register_tensors((f"{name}.{key}", tensor)
                               for key, tensor in module.state_dict(keep_vars=True).items())

    def register_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """Registers the optimizer's state tensors as regions ``name.state.<index>.<key>``. Adam
        and AdamW state is created first if the optimizer has not stepped yet."""
        if not optimizer.state:
            initialize_optimizer_state(optimizer)
        index = 0
        tensors = []
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                for key, value in optimizer.state[parameter].items():
                    if not isinstance(value, torch.Tensor):
                        raise Error("INVALID_ARGUMENT",
                                    f"optimizer state '{name}.state.{index}.{key}' is a "
                                    f"{type(value).__name__}, not a tensor")
                    tensors.append((f"{name}.state.{index}.{key}", value))
                index += 1
        self._register_tensors(tensors)

    def register_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Registers one tensor as region ``name`` (moved into shared memory in place)."""
        self._register_tensors([(name, tensor)])

    def register_alias(self, name: str, alias: str) -> None:
        """Registers ``alias`` as a second region over the bytes of host tensor region ``name``.
        The store keeps each region's own latest version, so snapshotting a tensor under several
        aliases at different steps keeps each of those versions (sparse snapshots use this)."""
        self._check_registration_open(alias)
        if name not in self._host_places:
            raise Error("NOT_FOUND", f"'{name}' is not a registered host tensor region")
        tensor, _, nbytes = self._tensors[name]
        buffer, offset = self._host_places[name]
        self._native.register_host_region(alias, buffer, offset, max(nbytes, 1),
                                          str(tensor.dtype), list(tensor.shape))
        self._tensors[alias] = self._tensors[name]
        self._host_places[alias] = (buffer, offset)

    def register_state(self, name: str, provider: StateProvider, capacity: int = 1 << 20) -> None:
        """Registers non-tensor state: ``provider.state_dict()`` is pickled into a host region of
        ``capacity`` bytes at every snapshot, and handed back to ``load_state_dict`` on restore."""
        self._check_registration_open(name)
        buffer = self._native.allocate_host(capacity + _LENGTH_PREFIX.size)
        self._native.register_host_region(name, buffer, 0, buffer.size, "pickle", [])
        self._buffers.append(buffer)
        self._states[name] = (provider, memoryview(buffer).cast("B"))

    def _check_registration_open(self, name: str) -> None:
        if self._last_snapshot is not None:
            raise Error("FAILED_PRECONDITION",
                        f"cannot register '{name}' after snapshots started (last step "
                        f"{self._last_snapshot}): register every tensor and state first")
        if name in self._tensors or name in self._states:
            raise Error("ALREADY_EXISTS", f"region '{name}' is already registered")

    def _register_tensors(self, named: Iterable[Tuple[str, torch.Tensor]]) -> None:
        unique: List[Tuple[str, torch.Tensor]] = []
        seen = set()
        for name, tensor in named:
            self._check_registration_open(name)
            if id(tensor) in seen:  # tied weights: one region serves every name of the tensor
                continue
            seen.add(id(tensor))
            if tensor.device.type == "cuda":
                self._register_cuda_tensor(name, tensor)
            elif tensor.device.type == "cpu":
                unique.append((name, tensor))
            else:
                raise Error("UNIMPLEMENTED", f"tensor '{name}' is on {tensor.device}: moesnap "
                                             f"shares CPU tensors and CUDA tensors")
        if not unique:
            return
        offsets = []
        total = 0
        for _, tensor in unique:
            offsets.append(total)
            nbytes = tensor.numel() * tensor.element_size()
            total += (nbytes + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT
        buffer = self._native.allocate_host(max(total, _ALIGNMENT))
        self._buffers.append(buffer)
        for (name, tensor), offset in zip(unique, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            shared = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset) \
                if nbytes > 0 else torch.empty(0, dtype=torch.uint8)
            shared = shared.view(tensor.dtype).view(tensor.shape)
            shared.copy_(tensor.detach())
            tensor.data = shared  # the same Parameter/tensor object, now in shared memory
            self._native.register_host_region(name, buffer, offset, max(nbytes, 1),
                                              str(tensor.dtype), list(tensor.shape))
            self._tensors[name] = (tensor, tensor.data_ptr(), nbytes)
            self._host_places[name] = (buffer, offset)

    def _register_cuda_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Shares a CUDA tensor by IPC: the daemon opens its allocation's handle and copies the
        region after waiting on an event recorded on the current stream at each snapshot."""
        storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") \
            else tensor.storage()._storage  # torch 1.x: TypedStorage wraps the untyped storage
        # _share_cuda_ reports the storage's offset inside the cudaMalloc block that holds it.
        storage_offset_in_block = storage._share_cuda_()[3]
        block_base = storage.data_ptr() - storage_offset_in_block
        nbytes = tensor.numel() * tensor.element_size()
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        self._native.register_device_region(name, tensor.device.index, block_base,
                                            tensor.data_ptr() - block_base, nbytes, stream,
                                            str(tensor.dtype), list(tensor.shape))
        self._tensors[name] = (tensor, tensor.data_ptr(), nbytes)

    # Snapshots ----------------------------------------------------------------------------------

    def snapshot(self, step: int, names: Optional[List[str]] = None,
                 sparse: Optional[Dict[str, Any]] = None) -> int:
        """Starts capturing ``names`` (every registered region when None) at ``step``; non-tensor
        state is always included. Returns the bytes the daemon copies; returns at once.
        ``sparse`` places a sparse step in its window: keys ``window_first_step``, ``window_size``,
        ``slot``, ``buffer`` and ``operators`` (see ``moesnap.sparse``)."""
        for name, (tensor, address, nbytes) in self._tensors.items():
            if tensor.data_ptr() != address or tensor.numel() * tensor.element_size() != nbytes:
                raise Error("FAILED_PRECONDITION",
                            f"tensor '{name}' was resized or reallocated after registration "
                            f"(registered {nbytes} bytes, now "
                            f"{tensor.numel() * tensor.element_size()} bytes elsewhere): "
                            f"change tensors in place only")
        for name, (provider, view) in self._states.items():
            payload = pickle.dumps(provider.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
            capacity = len(view) - _LENGTH_PREFIX.size
            if len(payload) > capacity:
                raise Error("RESOURCE_EXHAUSTED",
                            f"state '{name}' pickles to {len(payload)} bytes but its region holds "
                            f"{capacity}: register it with a larger capacity")
            view[:_LENGTH_PREFIX.size] = _LENGTH_PREFIX.pack(len(payload))
            view[_LENGTH_PREFIX.size:_LENGTH_PREFIX.size + len(payload)] = payload
        regions = [] if names is None else list(names) + list(self._states)
        if sparse is None:
            copied = self._native.snapshot(step, regions)
        else:
            copied = self._native.snapshot_sparse(step, regions, **sparse)
        self._last_snapshot = step
        return copied

    def wait_captured(self) -> None:
        """Blocks until the last snapshot's regions are copied (they may then change again)."""
        if self._last_snapshot is not None:
            self._native.wait_captured(self._last_snapshot)

    def wait_committed(self, step: int) -> None:
        """Blocks until ``step`` is committed: restorable after a crash."""
        self._native.wait_committed(step)

    def restore(self, step: Optional[int] = None, names: Optional[List[str]] = None) -> int:
        """Writes the latest committed state (or ``step``, which must be the latest) into the
        registered tensors and state providers, and returns its step. With ``names``, only those
        regions (each at its latest committed version) and no state provider."""
        restored_step, _, self._restore_tier = self._native.restore(
            step, [] if names is None else list(names))
        if names is not None:
            return restored_step
        for name, (provider, view) in self._states.items():
            (length,) = _LENGTH_PREFIX.unpack(bytes(view[:_LENGTH_PREFIX.size]))
            if length == 0:
                continue  # never snapshotted with content
            provider.load_state_dict(
                pickle.loads(bytes(view[_LENGTH_PREFIX.size:_LENGTH_PREFIX.size + length])))
        self._last_snapshot = restored_step
        return restored_step

    def latest_committed(self) -> Optional[int]:
        """The latest committed step of this rank, or None."""
        return self._native.latest_committed()

    @property
    def restore_tier(self) -> Optional[str]:
        """Which tier served this process's last ``restore``: ``"memory"`` (the daemons' memory)
        or ``"durable"`` (the newest step durable on every node, once memory no longer held the
        committed state); None before any restore."""
        return self._restore_tier

    @property
    def last_snapshot(self) -> Optional[int]:
        """The step of this process's latest ``snapshot`` (or ``restore``), or None."""
        return self._last_snapshot

    def windows(self) -> Dict[str, Optional[Dict[str, Any]]]:
        """This rank's sparse windows: ``{"committed": ..., "open": ...}``, each None or a dict
        with ``first_step``, ``size``, ``buffer``, ``slots`` ((slot, step, committed, operators)
        tuples) and ``failure``."""
        return self._native.windows()

    # Upstream log -------------------------------------------------------------------------------

    def append_log(self, step: int, micro_batch: int, direction: str, peer_rank: int,
                   tensor: torch.Tensor) -> None:
        """Logs what this rank sends to ``peer_rank`` at a pipeline boundary: ``direction`` is
        ``"forward"`` (activations) or ``"backward"`` (gradients). Log before sending, so that
        whatever a neighbour received is in the log."""
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype, bf16 too
        self._native.append_log(step, micro_batch, direction, peer_rank, raw.numpy().tobytes())

    def fetch_log(self, sender_rank: int, step: int, direction: str, peer_rank: int,
                  like: torch.Tensor) -> List[torch.Tensor]:
        """What ``sender_rank`` sent to ``peer_rank`` at ``step``, one tensor shaped and typed
        ``like`` per micro-batch in order, from whichever daemon of the cluster holds it."""
        records = self._native.fetch_log(sender_rank, step, direction, peer_rank)
        tensors = []
        for expected, (micro_batch, payload) in enumerate(records):
            if micro_batch != expected or len(payload) != like.numel() * like.element_size():
                raise Error("DATA_LOSS",
                            f"log of step {step} from rank {sender_rank} to rank {peer_rank} "
                            f"({direction}): micro-batch {expected} is missing or has "
                            f"{len(payload)} bytes instead of {like.numel() * like.element_size()}")
            tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                           .view(like.dtype).reshape(like.shape).clone())
        return tensors

    @property
    def rank(self) -> int:
        return self._native.rank
