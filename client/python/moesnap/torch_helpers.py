"""PyTorch on top of libmoesnap: a rank's training state, exactly as ``torch.save`` of its state
dicts would keep it, snapshotted into the node's moesnapd and restored after a crash.

How each kind of state reaches the daemon, and why:

* Parameters (and other tensors registered whole) are shared in place: their storages move into
  shared memory that the daemon maps (``_storage``: one file per registration, else one per
  storage). A storage is shared once, whatever number of tensors view it, and stays the same
  storage object, so flat buffers and their views (FSDP flat parameters, fused optimizers'
  buffers) and tied weights keep working. Registering N tensors of B bytes costs O(B + N): one
  file of B bytes, one descriptor handed over and one call registering the regions. The storages
  move at the first snapshot (copying their bytes) or the first restore (which writes them, so
  a storage its regions cover whole is not copied at all), and only once that restore succeeded:
  a failed one leaves the tensors as they were. Parameters change only in the optimizer step, so
  the daemon may copy them while the next forward and backward run.
* Module buffers change in ``forward`` (running statistics, token or load counters), so they are
  staged: ``snapshot(step)`` copies each buffer into shared memory the daemon copies from, and
  ``restore`` copies them back. Buffers are small; one staging copy per step costs little and
  is the only way to capture them as of the step without pausing the next forward.
* Optimizer state is ``optimizer.state_dict()`` whole: ``param_groups`` (lr, betas, weight decay,
  momentum...) and non-tensor per-parameter state are pickled into a region at every snapshot,
  beside a manifest naming every state tensor; state tensors are shared in place as regions
  ``<optimizer>.state.<parameter>.<key>`` (small ones, such as Adam's ``step``, staged). State an
  optimizer creates lazily at its first ``step()`` is registered at the first snapshot after it
  appears, and a fresh process restoring creates it from the manifest, so any optimizer works.
* Anything with ``state_dict()``/``load_state_dict()`` (a scheduler, a sampler, RNG) is pickled
  into a region of its own at every snapshot.

A failure of the snapshot system (the daemon gone or restarting, commits lagging, a full pool)
never raises from ``snapshot``/``wait_captured``: the step is skipped, ``skipped_steps`` says
why, and training goes on.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import resource
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Protocol, Tuple

import numpy
import torch

from . import _storage, core
from .core import Error

_log = logging.getLogger("moesnap")

_LENGTH_PREFIX = struct.Struct("<Q")
# Optimizer state tensors smaller than a page are staged rather than shared: a shared storage
# costs a file, a descriptor and a mapping on both sides, which for Adam's scalar `step` per
# parameter would double the mappings of a large model for 4 bytes each.
_STAGE_BELOW_BYTES = 4096
# Pickled state is copied whole at every snapshot, so its regions are small unless asked: enough
# for a scheduler, a sampler's position or the random generators (about 12 KiB).
_STATE_CAPACITY = 64 << 10
# An optimizer's pickled state dict grows with its parameters (each one's index and name).
_OPTIMIZER_CAPACITY_PER_PARAMETER = 512
# What a failure of the snapshot system looks like from the trainer: the step is skipped, never
# raised. Other codes (a region unknown, a tensor reallocated) are misuse and raise.
_SYSTEM_FAILURES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED",
                              "DATA_LOSS", "INTERNAL", "UNKNOWN", "CANCELLED"})


class StateProvider(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (PyTorch's ``Stateful``):
    an LR scheduler, a sampler, a loss scaler."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RestoredFrom(NamedTuple):
    """What ``Client.restore_from`` restored: the committed step, the node whose snapshot served
    it (None on a daemon without a cluster) and whether that node was lost, so that its regions
    were decoded from its group's parity."""
    step: int
    node: Optional[int]
    decoded: bool


class RandomState:
    """The Python, NumPy, PyTorch CPU and (once CUDA is in use) every CUDA device's random
    generators, as one state provider."""

    def state_dict(self) -> Dict[str, Any]:
        state = {"python": random.getstate(), "numpy": numpy.random.get_state(),
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        random.setstate(state["python"])
        numpy.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates Adam/AdamW state now, as their first ``step()`` would (zero moments, step 0), so
    that it exists before training starts. Only sparse snapshots need this (they name every
    operator's state up front); dense snapshots register state whenever the optimizer creates it."""
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _compatible(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device


@dataclass(frozen=True)
class _TensorRef:
    """A state tensor in an optimizer's pickled manifest: how to create it in a process whose
    optimizer has not made it yet (its bytes are in region ``<optimizer>.state.<parameter>.<key>``,
    the parameter named by the manifest's ``parameters``)."""
    dtype: torch.dtype
    shape: Tuple[int, ...]
    device: str


@dataclass(eq=False)
class _SharedStorage:
    """A CPU storage shared with the daemon: bytes [offset, offset + size) of memory ``handle``,
    at ``address`` in this process once moved. ``file`` is the registration's shared file it moves
    into (None: the storage has a file of its own already, and has moved); ``ranges`` are the
    byte ranges of it that registered regions name."""
    storage: Any
    name: str  # the first region in it, to name it in errors
    handle: int
    offset: int
    size: int
    address: int
    file: Optional[_storage.SharedFile] = None
    ranges: List[Tuple[int, int]] = field(default_factory=list)

    def covered(self) -> bool:
        """Whether the regions in it name every byte of it (a restore then writes all of it)."""
        end = 0
        for start, stop in sorted(self.ranges):
            if start > end:
                return False
            end = max(end, stop)
        return end >= self.size


@dataclass
class _Region:
    """A registered region. `tensor` is the memory the daemon copies: the live tensor when shared
    in place, a staging view when staged (`live` then finds the live tensor)."""
    name: str
    tensor: torch.Tensor
    address: int
    live: Optional[Callable[[], torch.Tensor]] = None  # staged regions only
    memory: Optional[Tuple[int, int]] = None  # (memory handle, offset) of host regions
    base: Optional[str] = None  # an alias: the region whose bytes it names
    pickled: bool = False  # a state provider's pickle, rewritten at each snapshot


class _OptimizerRegistration:
    def __init__(self, name: str, optimizer: torch.optim.Optimizer, fqns: List[str]) -> None:
        self.name = name
        self.optimizer = optimizer
        self.fqns = fqns  # parameter index in state_dict order -> its region name

    def parameters(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def region(self, index: int, key: Any) -> str:
        return f"{self.name}.state.{self.fqns[index]}.{key}"

    @property
    def manifest_region(self) -> str:
        return f"{self.name}.state_dict"


def _process_group_ranks(process_group: Any) -> List[int]:
    """The global ranks of a torch.distributed group, in group-rank order (the default group's
    when None)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise Error("FAILED_PRECONDITION", "a replica group from a process group needs "
                                           "torch.distributed initialized (or give the ranks)")
    if process_group is None or process_group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    if hasattr(dist, "get_process_group_ranks"):  # torch >= 2.0
        return list(dist.get_process_group_ranks(process_group))
    group_ranks = dist.distributed_c10d._pg_group_ranks[process_group]  # torch 1.13
    return [rank for rank, _ in sorted(group_ranks.items(), key=lambda item: item[1])]


class Client:
    """One trainer rank's connection to its node's moesnapd.

    ``socket_path`` defaults to ``MOESNAP_SOCKET`` (else the daemon's default socket) and ``rank``
    to ``RANK`` (else ``LOCAL_RANK``, else 0), as torchrun and Slurm set them. Register everything
    first (``register`` takes modules, optimizers, tensors and anything with ``state_dict()``),
    then per step: ``snapshot(step)`` right after ``optimizer.step()`` and ``wait_captured()``
    before the next ``optimizer.step()``; ``commit(last_step)`` at the end. Not thread-safe: use
    it from the training thread.
    """

    def __init__(self, socket_path: Optional[str] = None, rank: Optional[int] = None, *,
                 call_timeout_s: float = 30.0, wait_timeout_s: float = 600.0) -> None:
        _raise_open_file_limit()
        self._native = core.Client(socket_path, rank, call_timeout_s, wait_timeout_s)
        self._regions: Dict[str, _Region] = {}
        self._registrations: Dict[str, List[str]] = {}  # registration name -> its regions
        # id(tensor) -> (its region name, the tensor, kept alive so that its id stays its own):
        # tied weights register once, and optimizers name their state by it
        self._registered_tensors: Dict[int, Tuple[str, torch.Tensor]] = {}
        self._storages: Dict[int, _SharedStorage] = {}  # by storage (its StorageImpl address)
        self._unmoved: List[_SharedStorage] = []  # they move at the first snapshot or restore
        self._buffers: List[core.SharedBuffer] = []  # staging memory stays mapped
        self._states: Dict[str, Tuple[StateProvider, memoryview]] = {}
        self._optimizers: List[_OptimizerRegistration] = []
        self._last_snapshot: Optional[int] = None
        self._captured_through: Optional[int] = None
        self._staged_step: Optional[int] = None  # the step whose end the staging memory holds
        self._restore_tier: Optional[str] = None
        # Replica groups: (group name, member ranks, the registrations or regions named), and
        # the regions declared to the daemon so far (optimizer state registers later).
        self._replica_groups: List[Tuple[str, List[int], List[str]]] = []
        self._replicated: set = set()
        self.skipped_steps: List[Tuple[int, str]] = []
        # Bytes of shared memory this process took over from an exited process of its rank
        # (kept by the daemon for [agent] exited_trainer_memory_seconds) instead of allocating.
        self.adopted_bytes = 0

    def close(self) -> None:
        """Ends the session with the daemon now (otherwise when this object is collected).
        Registered tensors keep their memory and their values; a snapshot whose capture has not
        ended is abandoned (aborted), so they may change at once."""
        self._native.close()

    # Registration -------------------------------------------------------------------------------

    def register(self, name: str, obj: Any, **options: Any) -> None:
        """Registers ``obj`` under ``name``: a module, an optimizer, a tensor, or anything with
        ``state_dict()`` and ``load_state_dict()`` (an LR scheduler, a sampler,
        ``moesnap.RandomState()``).

        The CPU storages of registered tensors move into a shared-memory file at the next
        snapshot or whole restore (see the README): views and parameters follow, but a raw
        pointer taken before then (``tensor.numpy()``, DLPack, ctypes) keeps the old memory, and
        no other thread may use the tensors during those calls."""
        if isinstance(obj, torch.nn.Module):
            self.register_module(name, obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self.register_optimizer(name, obj, **options)
        elif isinstance(obj, torch.Tensor):
            self.register_tensor(name, obj)
        else:
            self.register_state(name, obj, **options)

    def register_module(self, name: str, module: torch.nn.Module) -> None:
        """Registers every entry of ``module.state_dict()`` as a region ``name.<key>``: parameters
        shared in place (the module keeps its Parameter objects and every view of their storage),
        persistent buffers staged at each snapshot. Register modules before their optimizers."""
        self._check_registration_open(name)
        parameters = {id(p) for p in module.parameters()}
        shared, staged = [], []
        for key, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in parameters:
                shared.append((f"{name}.{key}", tensor))
            else:
                staged.append((f"{name}.{key}", tensor, _buffer_getter(module, key)))
        regions = self._share(shared, internal=False) + self._stage(staged)
        self._registrations[name] = regions

    def register_optimizer(self, name: str, optimizer: torch.optim.Optimizer,
                           capacity: Optional[int] = None) -> None:
        """Registers everything ``optimizer.state_dict()`` holds: state tensors as regions
        ``name.state.<parameter region>.<key>`` (registered as the optimizer creates them), and
        ``param_groups`` and non-tensor state pickled into ``name.state_dict`` (``capacity``
        bytes, by default 64 KiB + 512 bytes per parameter) at each snapshot. Every parameter
        must belong to a module or tensor registered before, which names it."""
        self._check_registration_open(name)
        fqns = []
        for index, parameter in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            if id(parameter) not in self._registered_tensors:
                raise Error("INVALID_ARGUMENT",
                            f"parameter {index} of optimizer '{name}' (shape "
                            f"{list(parameter.shape)}) is in no registered module or tensor: "
                            f"register its module first")
            fqns.append(self._registered_tensors[id(parameter)][0])
        registration = _OptimizerRegistration(name, optimizer, fqns)
        if capacity is None:
            capacity = _STATE_CAPACITY + _OPTIMIZER_CAPACITY_PER_PARAMETER * len(fqns)
        self.register_state(registration.manifest_region, _OptimizerManifest(self, registration),
                            capacity)
        self._optimizers.append(registration)
        self._registrations[name] = [registration.manifest_region] + \
            self._adopt_optimizer_state(registration)

    def register_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Registers one tensor as region ``name``, shared in place: change it in place only, and
        only between ``wait_captured()`` and the next ``snapshot()``."""
        self._check_registration_open(name)
        self._registrations[name] = self._share([(name, tensor)], internal=False)

    def register_alias(self, name: str, alias: str) -> None:
        """Registers ``alias`` as a second region over the bytes of host region ``name``. The
        store keeps each region's own latest version, so snapshotting a tensor under several
        aliases at different steps keeps each of those versions (sparse snapshots use this)."""
        self._check_registration_open(alias)
        region = self._regions.get(name)
        if region is None or region.memory is None:
            raise Error("NOT_FOUND", f"'{name}' is not a registered host tensor region")
        tensor = region.tensor
        dtype, shape = ("pickle", []) if region.pickled else (str(tensor.dtype), list(tensor.shape))
        self._native.register_host_regions([(alias, region.memory[0], region.memory[1],
                                             max(_nbytes(tensor), 1), dtype, shape)])
        self._regions[alias] = _Region(alias, tensor, region.address, memory=region.memory,
                                       base=region.base or name, pickled=region.pickled)
        self._registrations[alias] = [alias]

    def register_state(self, name: str, provider: StateProvider,
                       capacity: int = _STATE_CAPACITY) -> None:
        """Registers non-tensor state: ``provider.state_dict()`` is pickled into a region of
        ``capacity`` bytes at every snapshot and handed to ``load_state_dict`` on restore. The
        region is copied whole at each snapshot: give a capacity fitting the state's growth."""
        self._check_registration_open(name)
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(provider, method, None)):
                raise Error("INVALID_ARGUMENT",
                            f"'{name}' is a {type(provider).__name__}, which has no {method}(): "
                            f"register modules, optimizers, tensors, or objects with "
                            f"state_dict() and load_state_dict()")
        size = len(pickle.dumps(provider.state_dict(), protocol=pickle.HIGHEST_PROTOCOL))
        if size > capacity:
            raise Error("RESOURCE_EXHAUSTED",
                        f"state '{name}' pickles to {size} bytes but its region would hold "
                        f"{capacity}: register it with a larger capacity")
        # The region is the bytes asked for, not the buffer's (larger in huge pages): a restarted
        # process registers the same size whichever pages it gets.
        region_bytes = capacity + _LENGTH_PREFIX.size
        buffer = self._native.allocate_host(region_bytes)
        (handle,) = self._native.share_memory([buffer.fd])
        self._native.register_host_regions([(name, handle, 0, region_bytes, "pickle", [])])
        self._buffers.append(buffer)
        self._states[name] = (provider, memoryview(buffer).cast("B")[:region_bytes])
        self._regions[name] = _Region(name, torch.frombuffer(buffer, dtype=torch.uint8,
                                                             count=region_bytes),
                                      buffer.address, memory=(handle, 0), pickled=True)
        self._registrations[name] = [name]

    def set_replica_group(self, names: Iterable[str], ranks: Optional[Iterable[int]] = None, *,
                          process_group: Any = None, group_name: Optional[str] = None) -> None:
        """Declares the registrations (or regions) ``names``, e.g. ``["model", "optim"]``,
        identical on a group of data-parallel ranks: each member's snapshots then copy only its
        1/N shard of them, a step commits only with every member's shard, and ``restore``
        assembles them from all of them. The members are ``ranks`` (global ranks, the same list
        on every member), or those of ``process_group`` (a ``torch.distributed`` group; the
        default group when neither is given). Every member makes the same call. Declare only
        state that is byte-identical on every member: parameters and optimizer state under
        data-parallel training, not samplers or RNG (nor buffers that each rank updates)."""
        if ranks is None:
            ranks = _process_group_ranks(process_group)
        members = [int(rank) for rank in ranks]
        if group_name is None:
            group_name = f"ranks-{zlib.crc32(struct.pack(f'<{len(members)}I', *members)):08x}"
        self._replica_groups.append((group_name, members, list(names)))
        self._declare_replica_groups()

    def _declare_replica_groups(self) -> None:
        """Tells the daemon about every region of the declared groups not declared yet (optimizer
        state registers at the first snapshot after the optimizer created it)."""
        for group_name, members, names in self._replica_groups:
            regions = [region for region in self.registered_regions() if region not in
                       self._replicated and any(region == name or region.startswith(name + ".")
                                                for name in names)]
            if regions:
                self._native.set_replica_group(group_name, members, regions)
                self._replicated.update(regions)

    def registered_regions(self) -> List[str]:
        """Every registered region that is not an alias of another."""
        return [name for name, region in self._regions.items() if region.base is None]

    def window_state_regions(self) -> List[str]:
        """The regions that are neither parameters nor optimizer state tensors: state providers'
        pickles (optimizers' state dicts among them) and staged module buffers. Sparse snapshots
        capture them whole at the first step of each window."""
        optimizer_state = tuple(f"{registration.name}.state." for registration in self._optimizers)
        return [name for name, region in self._regions.items()
                if region.base is None and (region.pickled or (
                    region.live is not None and not name.startswith(optimizer_state)))]

    def regions_of(self, registration: str) -> List[str]:
        """The regions that the ``register_*`` call named ``registration`` created (so far, for an
        optimizer): the names to give ``snapshot``, ``restore`` or ``restore_from``."""
        if registration not in self._registrations:
            raise Error("NOT_FOUND", f"nothing was registered as '{registration}'")
        return list(self._registrations[registration])

    def optimizer_state_regions(self, optimizer_name: str, parameter: torch.Tensor) -> List[str]:
        """The regions of ``parameter``'s state in the optimizer registered as
        ``optimizer_name`` (registering state the optimizer created since the last snapshot)."""
        for registration in self._optimizers:
            if registration.name != optimizer_name:
                continue
            self._adopt_optimizer_state(registration)
            for index, candidate in enumerate(registration.parameters()):
                if candidate is parameter:
                    return [registration.region(index, key)
                            for key, value in registration.optimizer.state[parameter].items()
                            if registration.region(index, key) in self._regions]
        raise Error("NOT_FOUND", f"no optimizer registered as '{optimizer_name}' holds that "
                                 f"parameter")

    def _check_registration_open(self, name: str) -> None:
        if self._last_snapshot is not None:
            raise Error("FAILED_PRECONDITION",
                        f"cannot register '{name}' after snapshots started (last step "
                        f"{self._last_snapshot}): register every tensor and state first")
        if name in self._regions or name in self._registrations:
            raise Error("ALREADY_EXISTS", f"region '{name}' is already registered")

    def _share(self, named: Iterable[Tuple[str, torch.Tensor]], internal: bool) -> List[str]:
        """Registers tensors shared in place: CPU storages move into shared memory (each once)
        and are handed to the daemon in one call; CUDA tensors are shared by IPC. Zero-size
        tensors hold no bytes and are skipped. Returns the region names registered."""
        host: List[Tuple[str, torch.Tensor]] = []
        device: List[Tuple[str, torch.Tensor]] = []
        names: List[str] = []
        for name, tensor in named:
            if not internal:
                self._check_registration_open(name)
                if id(tensor) in self._registered_tensors:  # tied weights: one region for all names
                    continue
                self._registered_tensors[id(tensor)] = (name, tensor)
            if _nbytes(tensor) == 0:
                continue
            if not tensor.is_contiguous():
                raise Error("INVALID_ARGUMENT",
                            f"tensor '{name}' is not contiguous (strides {list(tensor.stride())}): "
                            f"moesnap registers a tensor as one range of its storage")
            if tensor.device.type == "cuda":
                device.append((name, tensor))
                names.append(name)
            elif tensor.device.type == "cpu":
                host.append((name, tensor))
            else:
                raise Error("UNIMPLEMENTED", f"tensor '{name}' is on {tensor.device}: moesnap "
                                             f"shares CPU tensors and CUDA tensors")
        self._register_cuda_tensors(device)
        if not host:
            return names
        fresh: Dict[int, Tuple[str, Any]] = {}
        for name, tensor in host:
            storage = _storage.untyped_storage(tensor)
            if storage._cdata not in self._storages:
                fresh.setdefault(storage._cdata, (name, storage))
        self._share_storages(list(fresh.values()))
        specs, placed = [], []
        for name, tensor in host:
            shared = self._storages[_storage.untyped_storage(tensor)._cdata]
            start = tensor.data_ptr() - shared.storage.data_ptr()
            memory = (shared.handle, shared.offset + start)
            specs.append((name, *memory, _nbytes(tensor), str(tensor.dtype), list(tensor.shape)))
            placed.append((shared, start,
                           _Region(name, tensor, shared.address + start, memory=memory)))
        self._native.register_host_regions(specs)
        # Kept once the daemon took them: a registration that failed (optimizer state registered
        # during a snapshot) is made again whole at the next one.
        for shared, start, region in placed:
            shared.ranges.append((start, start + _nbytes(region.tensor)))
            self._regions[region.name] = region
            names.append(region.name)
        return names

    def _share_storages(self, storages: List[Tuple[str, Any]]) -> None:
        """Hands CPU storages (each with the first region in it) to the daemon: those not in
        shared memory yet in one file, which they move into at the first snapshot or restore;
        those in a file of their own already (``share_memory_()``, which other processes may map
        too) in theirs. Without the storage library for this torch, each moves into a file of its
        own now."""
        library = _storage.library()
        own_file = [(name, storage) for name, storage in storages
                    if library is None or storage.is_shared()]
        if own_file:
            fds = []
            for name, storage in own_file:
                try:
                    fds.append(_storage.share_each(storage))
                except RuntimeError as error:
                    raise Error("RESOURCE_EXHAUSTED",
                                f"cannot move the storage of '{name}' into shared memory: "
                                f"{error} (raise the open-file limit, ulimit -n, for many "
                                f"tensors)") from error
            for (name, storage), handle in zip(own_file, self._native.share_memory(fds)):
                self._storages[storage._cdata] = _SharedStorage(
                    storage, name, handle, 0, storage.nbytes(), storage.data_ptr())
        shared_file = [(name, storage) for name, storage in storages
                       if library is not None and not storage.is_shared()]
        if not shared_file:
            return
        offsets = _storage.layout([storage.nbytes() for _, storage in shared_file])
        # A restarted trainer takes the file its rank's exited process left, when its layout has
        # the same size: no fresh memory to allocate, fill and map (the daemon's mapping stays).
        # The storages move into it as into a fresh one: copying their bytes, or after a whole
        # restore wrote them, so nothing the exited process left is ever read. Taking it over is
        # only a shortcut: when it fails, the file is allocated as a first start does. Not while
        # the daemon is gone or hung: the file could not be handed over either, and allocating
        # (and dropping) the state's bytes at every snapshot until it is back costs the trainer.
        try:
            adopted = self._native.adopt_memory(offsets[-1])
        except Error as error:
            if error.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                raise
            adopted = None
        if adopted is None:
            file = _storage.SharedFile(library, offsets[-1])
            (handle,) = self._native.share_memory([file.fd])
        else:
            fd, handle = adopted
            # The mapping owns its descriptor; the client keeps the one it was handed, open, to
            # hand the file over again to a restarted daemon.
            file = _storage.SharedFile(library, offsets[-1], os.dup(fd))
            self.adopted_bytes += offsets[-1]
        for (name, storage), offset in zip(shared_file, offsets):
            shared = _SharedStorage(storage, name, handle, offset, storage.nbytes(),
                                    file.address + offset, file)
            self._storages[storage._cdata] = shared
            self._unmoved.append(shared)

    def _move_storages(self, copy: bool = True, leave_covered: bool = False) -> None:
        """Moves the storages registered since into their shared files, copying their bytes
        there; ``leave_covered``: only those whose regions do not cover them whole (a whole
        restore is to write the others). ``copy`` False: a whole restore wrote every storage left,
        which moves as it is in the file."""
        moving = [shared for shared in self._unmoved if not (leave_covered and shared.covered())]
        if not moving:
            return
        by_file: Dict[int, Tuple[_storage.SharedFile, List[_SharedStorage]]] = {}
        for shared in moving:
            if shared.storage.nbytes() != shared.size:
                raise Error("FAILED_PRECONDITION",
                            f"the storage of tensor '{shared.name}' was resized after "
                            f"registration (from {shared.size} to {shared.storage.nbytes()} "
                            f"bytes): change registered tensors in place only")
            by_file.setdefault(id(shared.file), (shared.file, []))[1].append(shared)
        for file, group in by_file.values():
            file.move([shared.storage for shared in group], [shared.offset for shared in group],
                      copy)
            # Each file's group is done once moved: a later file's failure leaves it moved.
            moved = {id(shared) for shared in group}
            self._unmoved = [shared for shared in self._unmoved if id(shared) not in moved]

    def _stage(self, named: List[Tuple[str, torch.Tensor, Callable[[], torch.Tensor]]]) -> List[str]:
        """Registers tensors staged at each snapshot: host ones packed into one shared buffer,
        CUDA ones each into a staging tensor on their device."""
        host = [(name, tensor, live) for name, tensor, live in named
                if _nbytes(tensor) > 0 and tensor.device.type != "cuda"]
        names = []
        device = []
        live_of = {}
        for name, tensor, live in named:
            if _nbytes(tensor) > 0 and tensor.device.type == "cuda":
                staging = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                staging.copy_(tensor)
                device.append((name, staging))
                live_of[name] = live
                names.append(name)
        self._register_cuda_tensors(device)
        for name, live in live_of.items():
            self._regions[name].live = live
        if not host:
            return names
        *offsets, total = _storage.layout([_nbytes(tensor) for _, tensor, _ in host])
        buffer = self._native.allocate_host(total)
        (handle,) = self._native.share_memory([buffer.fd])
        specs, staged = [], []
        for (name, tensor, live), offset in zip(host, offsets):
            staging = torch.frombuffer(buffer, dtype=torch.uint8, count=_nbytes(tensor),
                                       offset=offset).view(tensor.dtype).view(tensor.shape)
            staging.copy_(tensor.detach())
            specs.append((name, handle, offset, _nbytes(tensor), str(tensor.dtype),
                          list(tensor.shape)))
            staged.append(_Region(name, staging, staging.data_ptr(), live=live,
                                  memory=(handle, offset)))
        self._native.register_host_regions(specs)
        self._buffers.append(buffer)  # kept once the daemon took its regions, as in _share
        for region in staged:
            self._regions[region.name] = region
            names.append(region.name)
        return names

    def _register_cuda_tensors(self, named: List[Tuple[str, torch.Tensor]]) -> None:
        """Shares CUDA tensors by IPC, in one call: the daemon opens each allocation's handle once
        and copies the regions after waiting on an event recorded on their stream (the current
        one now) at each snapshot."""
        if not named:
            return
        self._native.register_device_regions([
            (name, tensor.device.index, tensor.data_ptr(), _nbytes(tensor),
             torch.cuda.current_stream(tensor.device).cuda_stream, str(tensor.dtype),
             list(tensor.shape)) for name, tensor in named])
        for name, tensor in named:
            self._regions[name] = _Region(name, tensor, tensor.data_ptr())

    def _adopt_optimizer_state(self, registration: _OptimizerRegistration) -> List[str]:
        """Makes every state tensor of the optimizer one the daemon copies: registers state that
        appeared since the last call (shared in place, or staged when small), and puts the
        registered tensor back where the optimizer replaced it (``load_state_dict`` copies).
        Returns the regions registered now."""
        optimizer = registration.optimizer
        fresh_shared: List[Tuple[str, torch.Tensor]] = []
        fresh_staged: List[Tuple[str, torch.Tensor, Callable[[], torch.Tensor]]] = []
        for index, parameter in enumerate(registration.parameters()):
            state = optimizer.state.get(parameter)
            if not state:
                continue
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor):
                    continue
                name = registration.region(index, key)
                region = self._regions.get(name)
                if region is None:
                    if _nbytes(value) == 0:
                        continue
                    if _nbytes(value) < _STAGE_BELOW_BYTES:
                        fresh_staged.append((name, value, _state_getter(optimizer, parameter, key)))
                    else:
                        fresh_shared.append((name, value))
                elif region.live is not None:
                    continue  # staged: read from the optimizer at each snapshot
                elif value is not region.tensor:
                    if _compatible(value, region.tensor):
                        region.tensor.copy_(value)
                        state[key] = region.tensor
                    else:  # the optimizer changed the state's shape or dtype: register it anew
                        self._regions.pop(name)
                        fresh_shared.append((name, value))
        return self._share(fresh_shared, internal=True) + self._stage(fresh_staged)

    # Snapshots ----------------------------------------------------------------------------------

    def snapshot(self, step: int, names: Optional[List[str]] = None,
                 sparse: Optional[Dict[str, Any]] = None) -> int:
        """Starts capturing ``names`` (every registered region when None) at ``step``; non-tensor
        state and optimizer state dicts are always included. Returns the bytes the daemon copies,
        at once; 0 when the step is skipped (``skipped_steps`` says why), which is no error:
        training goes on. ``sparse`` places a sparse step in its window: keys
        ``window_first_step``, ``window_size``, ``slot``, ``buffer`` and ``operators``."""
        unregistered = self._prepare_snapshot()
        self._staged_step = step
        self._last_snapshot = step
        if unregistered is not None:
            self._captured_through = step  # nothing to wait for
            self._skip(step, unregistered)
            return 0
        regions = [] if names is None else list(names) + list(self._states)
        try:
            if sparse is None:
                copied = self._native.snapshot(step, regions)
            else:
                copied = self._native.snapshot_sparse(step, regions, **sparse)
        except Error as error:
            self._captured_through = step  # the daemon took nothing to wait for, raised or not
            if error.code not in _SYSTEM_FAILURES and not _refuses_sparse_slot(error, sparse):
                raise
            self._skip(step, error.message)
            return 0
        self._collect_skipped()
        return copied

    def skip(self, step: int, reason: str) -> None:
        """Skips the snapshot of ``step`` without asking the daemon, saying ``reason`` in
        ``skipped_steps``, and stages as ``snapshot(step)`` would (``rewind`` can come back to its
        end): for a step the daemon could not use, such as one of a sparse window that can no
        longer commit."""
        self.stage(step)
        self._last_snapshot = step
        self._captured_through = step
        self._skip(step, reason)

    def stage(self, step: int) -> None:
        """Stages buffers and pickles state providers as ``snapshot(step)`` would, without taking
        a snapshot: for a step whose snapshot is stored already (a replay), so that ``rewind``
        can go back to its end."""
        self._prepare_snapshot()  # state it could not register is registered by a later snapshot
        self._staged_step = step

    def rewind(self, step: int) -> None:
        """Puts every state provider (not optimizers) and module buffer back as it was at the end
        of ``step``, the last step snapshotted or staged, from this process's memory: a step cut
        short (a pipeline neighbour lost in its forward or backward pass) may have drawn from a
        sampler or an RNG and changed buffers before it failed. Parameters and optimizer state
        are left alone: a step changes them only in ``optimizer.step()``, after its last
        exchange with other ranks."""
        if self._staged_step != step:
            raise Error("FAILED_PRECONDITION",
                        f"cannot rewind to the end of step {step}: this process last staged "
                        f"{'no step' if self._staged_step is None else f'step {self._staged_step}'}")
        manifests = {registration.manifest_region for registration in self._optimizers}
        regions = [name for name in self.window_state_regions() if name not in manifests]
        self._unstage(regions)
        self._load_states(regions)

    def _prepare_snapshot(self) -> Optional[str]:
        """Makes every region hold what the next snapshot takes: moves storages registered since
        into shared memory, checks that shared tensors did not move, registers optimizer state
        created since, stages buffers and pickles state. Returns why the state created since
        could not be registered (see ``_register_new_state``), None when it was."""
        self._move_storages()
        for name, region in self._regions.items():
            if region.live is None and region.base is None and \
                    region.tensor.data_ptr() != region.address:
                raise Error("FAILED_PRECONDITION",
                            f"tensor '{name}' was reallocated after registration (its bytes moved "
                            f"from {region.address:#x} to {region.tensor.data_ptr():#x}): change "
                            f"registered tensors in place only")
        # The previous capture reads the staging memory: it must be done before it is rewritten.
        self._wait_for_capture()
        unregistered = self._register_new_state()
        self._move_storages()  # of state the optimizers created since
        for region in self._regions.values():
            if region.live is not None:
                live = region.live()
                if _compatible(live, region.tensor):
                    region.tensor.copy_(live)
                else:
                    raise Error("FAILED_PRECONDITION",
                                f"buffer '{region.name}' changed from {region.tensor.dtype} "
                                f"{list(region.tensor.shape)} to {live.dtype} {list(live.shape)} "
                                f"after registration")
        for name, (provider, view) in self._states.items():
            payload = pickle.dumps(provider.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
            capacity = len(view) - _LENGTH_PREFIX.size
            if len(payload) > capacity:
                raise Error("RESOURCE_EXHAUSTED",
                            f"state '{name}' pickles to {len(payload)} bytes but its region holds "
                            f"{capacity}: register it with a larger capacity")
            view[:_LENGTH_PREFIX.size] = _LENGTH_PREFIX.pack(len(payload))
            view[_LENGTH_PREFIX.size:_LENGTH_PREFIX.size + len(payload)] = payload
        return unregistered

    def _register_new_state(self) -> Optional[str]:
        """Registers the optimizer state created since the last snapshot and declares it to its
        replica groups. When the snapshot system fails at it (the daemon gone, shared memory
        full), returns why: the step is skipped, since its snapshot would miss that state, and
        the next one registers what is still missing. Misuse (a tensor that cannot be shared)
        raises."""
        try:
            for registration in self._optimizers:
                self._adopt_optimizer_state(registration)
            self._declare_replica_groups()
        except Error as error:
            if error.code not in _SYSTEM_FAILURES:
                raise
            return (f"the state created since the last snapshot could not be registered: "
                    f"{error.message}")
        return None

    def wait_captured(self) -> None:
        """Blocks until the last snapshot's regions are copied (they may then change again).
        Never raises for a failure of the snapshot system: the step counts as skipped."""
        self._wait_for_capture()

    def _wait_for_capture(self) -> None:
        step = self._last_snapshot
        if step is None or self._captured_through == step:
            return
        try:
            self._native.wait_captured(step)
        except Error as error:
            if error.code not in _SYSTEM_FAILURES:
                raise
            self._skip(step, error.message)
        finally:
            self._captured_through = step
        self._collect_skipped()

    def wait_committed(self, step: int) -> None:
        """Blocks until ``step`` is committed: restorable after a crash. Raises when it will
        not be (skipped, aborted): for tests and tools; trainers end with ``commit``."""
        self._native.wait_committed(step)
        if step == self._last_snapshot:
            self._captured_through = step  # committed is captured: nothing left to wait for

    def commit(self, step: int) -> bool:
        """Makes the present state committed as ``step``: call it for the last step of training
        (or before a planned stop) instead of ``snapshot``. The rank's earlier steps settle first,
        so that the pool has room; ``step`` is taken again if the daemon skipped it. Returns False,
        saying why in the log, when it could not (the daemon gone, the cluster aborted the step),
        never raises for it."""
        self._wait_for_capture()
        unregistered = self._prepare_snapshot()
        self._staged_step = step
        if unregistered is not None:
            _log.error("moesnap could not commit step %d: %s", step, unregistered)
            return False
        try:
            self._native.commit(step)
            return True
        except Error as error:
            if error.code not in _SYSTEM_FAILURES:
                raise
            _log.error("moesnap could not commit step %d: %s", step, error.message)
            return False

    def _skip(self, step: int, reason: str) -> None:
        self.skipped_steps.append((step, reason))
        count = len(self.skipped_steps)
        if count & (count - 1) == 0:  # the first, then ever more rarely under a sustained failure
            _log.warning("moesnap skipped the snapshot of step %d (%d so far): %s", step, count,
                         reason)

    def _collect_skipped(self) -> None:
        for step, reason in self._native.take_skipped_steps():
            self._skip(step, reason)

    # Restore ------------------------------------------------------------------------------------

    def restore(self, step: Optional[int] = None, names: Optional[List[str]] = None) -> int:
        """Writes the latest committed state (or ``step``, which must be the latest) into
        everything registered, creating optimizer state the optimizer has not made yet, and
        returns its step. With ``names``, only those regions (each at its latest committed
        version) and the state providers among them (or aliased by them)."""
        if names is not None:
            self._move_storages()
            restored = self._native.restore(step, list(names))
            restored_step, self._restore_tier = restored.step, restored.tier
            self._staged_step = None  # the staging memory now mixes steps
            self._unstage(names)
            self._load_states(names)
            return restored_step
        for _ in range(3):
            manifests_step = self._restore_optimizer_manifests(step)
            self._move_storages(leave_covered=True)
            restored = self._native.restore(step, [])
            restored_step, self._restore_tier = restored.step, restored.tier
            if manifests_step is None or manifests_step == restored_step:
                break
            # A step committed between the two restores (the previous process's last one): the
            # manifests must be that step's, so read them again.
        else:
            raise Error("ABORTED", "the committed step kept changing during the restore: "
                                   "restore while no snapshot of this rank is in flight")
        self._move_storages(copy=False)  # the restore wrote every byte of those left
        self._unstage(self._regions)
        self._load_states(self._states)
        for registration in self._optimizers:
            self._adopt_optimizer_state(registration)  # load_state_dict copied the tensors
        self._last_snapshot = restored_step
        self._captured_through = restored_step
        self._staged_step = restored_step
        return restored_step

    def _restore_optimizer_manifests(self, step: Optional[int]) -> Optional[int]:
        """Restores the optimizers' pickled state dicts and creates, in each optimizer, the state
        tensors they name that it has not made yet, so that the whole restore can fill them.
        Returns the step restored, None without optimizers."""
        if not self._optimizers:
            return None
        restored_step = self._native.restore(
            step, [registration.manifest_region for registration in self._optimizers]).step
        for registration in self._optimizers:
            manifest = self._load_pickle(registration.manifest_region)
            if manifest is None:
                continue
            _check_parameters(registration, manifest)
            parameters = registration.parameters()
            for index, entries in manifest["state"].items():
                state = registration.optimizer.state[parameters[index]]
                for key, value in entries.items():
                    if isinstance(value, _TensorRef) and key not in state:
                        state[key] = torch.zeros(value.shape, dtype=value.dtype,
                                                 device=value.device)
            self._adopt_optimizer_state(registration)
        return restored_step

    def _load_states(self, names: Iterable[str]) -> None:
        """Hands the restored pickles of the state regions among ``names`` (or aliased by them)
        to their providers, in registration order."""
        named = set()
        for name in names:
            region = self._regions.get(name)
            named.add(region.base if region is not None and region.base else name)
        for name, (provider, _) in self._states.items():
            if name in named:
                state = self._load_pickle(name)
                if state is not None:  # None: never snapshotted with content
                    provider.load_state_dict(state)

    def _load_pickle(self, name: str) -> Any:
        view = self._states[name][1]
        (length,) = _LENGTH_PREFIX.unpack(bytes(view[:_LENGTH_PREFIX.size]))
        if length == 0:
            return None
        return pickle.loads(bytes(view[_LENGTH_PREFIX.size:_LENGTH_PREFIX.size + length]))

    def _unstage(self, names: Iterable[str]) -> None:
        """Copies restored staging memory into the live tensors it stands for."""
        for name in names:
            region = self._regions.get(name)
            if region is not None and region.base is not None:
                region = self._regions[region.base]
            if region is not None and region.live is not None:
                live = region.live()
                with torch.no_grad():
                    live.copy_(region.tensor)

    def restore_from(self, source_rank: int, names: List[str]) -> RestoredFrom:
        """Elastic restore: writes the latest committed regions ``names`` that rank
        ``source_rank`` snapshotted (on any node of the cluster; decoded from parity when that
        node is lost) into this rank's registered regions of the same names, checking every
        chunk's CRC-32C. An expert moved onto this rank after a failure takes its weights and
        optimizer state this way."""
        if not names:
            raise Error("INVALID_ARGUMENT", "restore_from needs the names of the regions to restore")
        self._move_storages()
        restored = self._native.restore_from(source_rank, list(names))
        self._unstage(names)
        return RestoredFrom(restored.step, restored.node, restored.decoded)

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
            if micro_batch != expected or len(payload) != _nbytes(like):
                raise Error("DATA_LOSS",
                            f"log of step {step} from rank {sender_rank} to rank {peer_rank} "
                            f"({direction}): micro-batch {expected} is missing or has "
                            f"{len(payload)} bytes instead of {_nbytes(like)}")
            tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                           .view(like.dtype).reshape(like.shape).clone())
        return tensors

    @property
    def rank(self) -> int:
        return self._native.rank


class _OptimizerManifest:
    """The pickled part of an optimizer's state dict: ``param_groups``, non-tensor state, and a
    ``_TensorRef`` for each state tensor (its bytes are in their own region)."""

    def __init__(self, client: Client, registration: _OptimizerRegistration) -> None:
        self._client = client
        self._registration = registration

    def state_dict(self) -> Dict[str, Any]:
        state_dict = self._registration.optimizer.state_dict()
        state = {}
        for index, entries in state_dict["state"].items():
            state[index] = {
                key: _TensorRef(value.dtype, tuple(value.shape), str(value.device))
                if isinstance(value, torch.Tensor) else value
                for key, value in entries.items()}
        return {"state": state, "param_groups": state_dict["param_groups"],
                "parameters": self._registration.fqns}

    def load_state_dict(self, manifest: Dict[str, Any]) -> None:
        registration = self._registration
        _check_parameters(registration, manifest)
        parameters = registration.parameters()
        # The state tensors hold the restored bytes already: load_state_dict deep-copies what it
        # gets, which for them would cost the state's size again, so it gets empty stand-ins (of
        # the same dtype, for optimizers that look at them), and the tensors go back after it.
        state, tensors = {}, []
        for index, entries in manifest["state"].items():
            live = registration.optimizer.state[parameters[index]]
            state[index] = {}
            for key, value in entries.items():
                if isinstance(value, _TensorRef):
                    tensors.append((parameters[index], key, live[key]))
                    state[index][key] = torch.empty(0, dtype=value.dtype)
                else:
                    state[index][key] = value
        registration.optimizer.load_state_dict({"state": state,
                                                "param_groups": manifest["param_groups"]})
        for parameter, key, tensor in tensors:
            registration.optimizer.state[parameter][key] = tensor


def _refuses_sparse_slot(error: Error, sparse: Optional[Dict[str, Any]]) -> bool:
    """Whether the daemon refused a sparse slot after a window's first because its open window is
    not the one the slot continues: a slot before it never reached the daemon, or was lost with a
    daemon that restarted. That window can no longer commit; the slot is skipped like any step the
    snapshot system could not take. (What a trainer can get wrong in a sparse snapshot the daemon
    refuses at the window's first slot already.)"""
    return sparse is not None and sparse["slot"] > 0 and error.code == "FAILED_PRECONDITION"


def _check_parameters(registration: _OptimizerRegistration, manifest: Dict[str, Any]) -> None:
    """Refuses, by name, an optimizer whose parameters are not those the snapshot was taken of."""
    stored = manifest["parameters"]
    if stored == registration.fqns:
        return
    for index, (expected, found) in enumerate(zip(stored, registration.fqns)):
        if expected != found:
            raise Error("INVALID_ARGUMENT",
                        f"optimizer '{registration.name}': parameter {index} is '{found}' in this "
                        f"trainer but was '{expected}' in the snapshot")
    raise Error("INVALID_ARGUMENT",
                f"optimizer '{registration.name}' has {len(registration.fqns)} parameters in this "
                f"trainer but had {len(stored)} in the snapshot")


def _buffer_getter(module: torch.nn.Module, key: str) -> Callable[[], torch.Tensor]:
    """The live buffer ``key`` of ``module``, looked up at each use: modules may replace a buffer
    object (``self.count = self.count + 1``)."""
    path, _, leaf = key.rpartition(".")
    owner = module.get_submodule(path) if path else module
    return lambda: getattr(owner, leaf)


def _state_getter(optimizer: torch.optim.Optimizer, parameter: torch.Tensor,
                  key: Any) -> Callable[[], torch.Tensor]:
    return lambda: optimizer.state[parameter][key]


def _raise_open_file_limit() -> None:
    """Each storage in a shared-memory file of its own keeps a descriptor open: allow as many as
    the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
