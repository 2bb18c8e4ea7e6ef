"""Moves the CPU storages of registered tensors, in place, into shared memory that moesnapd maps.
A storage object stays the same object, so every tensor viewing it keeps viewing it (views of a
flat buffer, tied weights); only where its bytes live changes.

All the storages of one registration go into one shared-memory file, mapped once here and handed
to the daemon by one descriptor, through libmoesnap_torch_storage (``_lib/``; its contract is
client/python/native/torch_storage.h). That library was compiled against the c10 headers of one
torch release, whose storage layout it knows: under another release, or another C++ ABI, it is
not used, and each storage moves into a file of its own as ``Tensor.share_memory_()`` makes it (a
file, a mapping and a descriptor per storage, slower for many tensors), which this module says
once, as a warning.
"""

from __future__ import annotations

import ctypes
import os
import re
import warnings
import weakref
from ctypes import POINTER, byref, c_char_p, c_int, c_int64, c_size_t, c_uint64, c_void_p
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from ._native import Error, check, lib

LIBRARY_PATH = Path(__file__).resolve().parent / "_lib" / "libmoesnap_torch_storage.so"
# Storages start on 64-byte boundaries in a file, as c10's CPU allocator aligns them; so do staged
# tensors in their buffer, so that the daemon's SIMD copies and CRCs stay aligned.
ALIGNMENT = 64

_PROTOTYPES = {
    "moesnap_torch_storage_version": (c_char_p, []),
    "moesnap_torch_storage_cxx11_abi": (c_int, []),
    "moesnap_storage_mapping_open": (c_int, [c_int, c_uint64, POINTER(c_void_p)]),
    "moesnap_storage_mapping_address": (c_size_t, [c_void_p]),
    "moesnap_storage_mapping_release": (None, [c_void_p]),
    "moesnap_storage_move": (c_int64, [POINTER(c_void_p), POINTER(c_size_t), POINTER(c_uint64),
                                       POINTER(c_uint64), c_size_t, c_void_p, c_int]),
}

# The library once it has been found to fit this torch, None once it has been found not to; the
# first registration decides.
_UNDECIDED = object()
_library = _UNDECIDED


def untyped_storage(tensor: torch.Tensor):
    if hasattr(tensor, "untyped_storage"):
        return tensor.untyped_storage()
    return tensor.storage()._storage  # torch 1.x: TypedStorage wraps the untyped storage


def release(version: str) -> str:
    """'1.13.0' of '1.13.0a0' or '1.13.0+cu117': the part a build's headers are versioned by."""
    match = re.match(r"\d+\.\d+\.\d+", version)
    return match.group(0) if match else version


def library() -> Optional[ctypes.CDLL]:
    """The storage library when it fits the running torch, else None (saying why, once)."""
    global _library
    if _library is _UNDECIDED:
        try:
            _library, reason = _load()
        except Exception as error:  # a stale or foreign library: the fallback, never a failure
            _library, reason = None, f"{LIBRARY_PATH.name} could not be used ({error!r})"
        if reason is not None:
            # A warnings filter that turns warnings into errors must not fail a registration.
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.warn(f"moesnap moves each registered storage into a shared-memory file "
                              f"of its own, not all of a registration into one: {reason}",
                              RuntimeWarning, stacklevel=3)
    return _library


def _load():
    if not LIBRARY_PATH.exists():
        return None, f"{LIBRARY_PATH.name} is not installed (the build found no c10 headers)"
    try:
        # PyDLL: calls keep the GIL, so no Python code runs while storages move. Threads inside
        # torch operations (which release the GIL) must not be using them: the package moves
        # storages only within the trainer's own snapshot and restore calls.
        loaded = ctypes.PyDLL(str(LIBRARY_PATH))
    except OSError as error:
        return None, f"{LIBRARY_PATH.name} does not load: {error}"
    for name, (result, arguments) in _PROTOTYPES.items():
        function = getattr(loaded, name)
        function.restype = result
        function.argtypes = arguments
    built_for = loaded.moesnap_torch_storage_version().decode()
    if release(torch.__version__) != built_for:
        return None, (f"it was built for torch {built_for}'s storage layout, this is torch "
                      f"{torch.__version__}")
    if bool(loaded.moesnap_torch_storage_cxx11_abi()) != torch.compiled_with_cxx11_abi():
        return None, "it was built with another C++ ABI (_GLIBCXX_USE_CXX11_ABI) than this torch"
    probe = torch.arange(ALIGNMENT, dtype=torch.uint8)
    file = SharedFile(loaded, ALIGNMENT)
    try:
        file.move([untyped_storage(probe)], [0], copy=True)
    except Error as error:
        return None, f"its check of a storage failed ({error.message})"
    if probe.data_ptr() != file.address or not torch.equal(probe, torch.arange(ALIGNMENT).byte()):
        return None, "a storage it moved did not read back as moved"
    return loaded, None


class SharedFile:
    """A sealed shared-memory file holding ``size`` bytes, mapped once, whole, at ``address``: a
    fresh one, or ``fd``, one the daemon handed back. ``size`` becomes the file's, larger than asked
    when it is made of huge pages (``MOESNAP_HUGE_PAGES=1``). ``fd`` is for handing it to the daemon
    (and again to a restarted one); the file and its mapping stay while this object, or any
    storage moved into it, lives."""

    def __init__(self, library: ctypes.CDLL, size: int, fd: Optional[int] = None) -> None:
        if fd is None:
            created = c_int(-1)
            check(lib.moesnap_shared_memory_create(size, byref(created)))
            fd = created.value
        asked, size = size, os.fstat(fd).st_size
        if size < asked:
            os.close(fd)
            raise Error("DATA_LOSS", f"a shared-memory file of {size} bytes cannot hold {asked}")
        mapping = c_void_p()
        error = library.moesnap_storage_mapping_open(fd, size, byref(mapping))
        if error != 0:
            raise Error("RESOURCE_EXHAUSTED", f"cannot map {size} shared bytes: "
                                              f"{os.strerror(error)}")
        self._library = library
        self._mapping = mapping
        self.fd = fd
        self.size = size
        self.address = library.moesnap_storage_mapping_address(mapping)
        weakref.finalize(self, library.moesnap_storage_mapping_release, mapping)

    def move(self, storages: Sequence, offsets: Sequence[int], copy: bool) -> None:
        """Moves each storage to its offset in this file, its bytes copied there when ``copy``
        (else it takes what the file holds there): all of them, or none when one is not the CPU
        storage Python describes."""
        count = len(storages)
        moved = self._library.moesnap_storage_move(
            (c_void_p * count)(*(storage._cdata for storage in storages)),
            (c_size_t * count)(*(storage.data_ptr() for storage in storages)),
            (c_uint64 * count)(*(storage.nbytes() for storage in storages)),
            (c_uint64 * count)(*offsets), count, self._mapping, int(copy))
        if moved >= 0:
            raise Error("INTERNAL", f"storage {moved} of {count} ({storages[moved].nbytes()} "
                                    f"bytes at {storages[moved].data_ptr():#x}) is not a CPU storage "
                                    f"as torch {torch.__version__} lays it out, or does not fit "
                                    f"at offset {offsets[moved]} of {self.size} bytes")


def layout(sizes: Sequence[int]) -> List[int]:
    """Offsets of storages (or staged tensors) of ``sizes`` bytes laid end to end in one file,
    each aligned; the last entry is the file's size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    offsets.append(max(total, ALIGNMENT))
    return offsets


def share_each(storage) -> int:
    """Moves one storage into a shared-memory file of its own (``Tensor.share_memory_()``'s
    file; one already in one stays there) and returns its descriptor, open while it lives."""
    fd, _ = storage._share_fd_cpu_()
    return fd
