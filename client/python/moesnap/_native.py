"""The native library, libmoesnap_c (its C ABI is ``moesnap/moesnap.h``), loaded with ctypes.

It lies in ``_lib/`` beside this file with every library it needs (found through its ``$ORIGIN``
run path), so nothing here depends on the Python version, and nothing of CUDA is loaded until a
GPU region is registered. Calls release the GIL while they run (ctypes does), so a trainer's other
threads go on while one waits for the daemon.
"""

from __future__ import annotations

import ctypes
from ctypes import (POINTER, Structure, c_char_p, c_double, c_int, c_int32, c_int64, c_size_t,
                    c_uint32, c_uint64, c_void_p)
from pathlib import Path

_ABI_VERSION = 2  # MOESNAP_C_ABI_VERSION of the header this module was written against
LIBRARY_PATH = Path(__file__).resolve().parent / "_lib" / f"libmoesnap_c.so.{_ABI_VERSION}"


class Error(Exception):
    """An error from moesnapd or libmoesnap.

    ``code`` is the status code name (for example ``'NOT_FOUND'``); ``message`` says what was wrong,
    naming the region, step and sizes involved.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


Error.__module__ = "moesnap"


class HostRegion(Structure):
    _fields_ = [("name", c_char_p), ("memory", c_uint64), ("offset", c_uint64), ("bytes", c_uint64),
                ("dtype", c_char_p), ("shape", POINTER(c_int64)), ("shape_length", c_size_t)]


class DeviceRegion(Structure):
    _fields_ = [("name", c_char_p), ("device", c_int32), ("address", c_size_t),
                ("bytes", c_uint64), ("stream", c_size_t), ("dtype", c_char_p),
                ("shape", POINTER(c_int64)), ("shape_length", c_size_t)]


class SparseSlot(Structure):
    _fields_ = [("window_first_step", c_int64), ("window_size", c_uint32), ("slot", c_uint32),
                ("buffer", c_uint32), ("operators", POINTER(c_char_p)),
                ("operator_count", c_size_t)]


class Restored(Structure):
    _fields_ = [("step", c_int64), ("regions", c_uint64), ("bytes", c_uint64), ("tier", c_int32),
                ("decoded", c_int32), ("source_node", c_int64)]


class Operator(Structure):
    _fields_ = [("name", c_char_p), ("is_expert", c_int32), ("full_state_bytes", c_uint64),
                ("weight_bytes", c_uint64), ("token_count", c_double)]


class Placement(Structure):
    _fields_ = [("experts", POINTER(c_int32)), ("offsets", POINTER(c_size_t)),
                ("node_count", c_size_t)]


_out = POINTER  # an output parameter
_strings = POINTER(c_char_p)
_STATUS = c_int

# name: (result type, argument types), as moesnap/moesnap.h declares them.
_PROTOTYPES = {
    "moesnap_abi_version": (c_uint32, []),
    "moesnap_version": (c_char_p, []),
    "moesnap_status_name": (c_char_p, [c_int]),
    "moesnap_last_error": (c_char_p, []),
    "moesnap_free": (None, [c_void_p]),
    "moesnap_shared_memory_create": (_STATUS, [c_size_t, _out(c_int)]),
    "moesnap_client_connect": (_STATUS, [c_char_p, c_int64, c_double, c_double, _out(c_void_p)]),
    "moesnap_client_close": (None, [c_void_p]),
    "moesnap_client_rank": (c_uint32, [c_void_p]),
    "moesnap_client_node_id": (c_uint32, [c_void_p]),
    "moesnap_client_share_memory": (_STATUS, [c_void_p, POINTER(c_int), c_size_t,
                                              _out(c_uint64)]),
    "moesnap_client_adopt_memory": (_STATUS, [c_void_p, c_size_t, _out(c_int), _out(c_uint64)]),
    "moesnap_client_register_host_regions": (_STATUS, [c_void_p, POINTER(HostRegion), c_size_t]),
    "moesnap_client_register_device_regions": (_STATUS, [c_void_p, POINTER(DeviceRegion),
                                                         c_size_t]),
    "moesnap_client_set_replica_group": (_STATUS, [c_void_p, c_char_p, POINTER(c_uint32), c_size_t,
                                                   _strings, c_size_t]),
    "moesnap_client_snapshot": (_STATUS, [c_void_p, c_int64, _strings, c_size_t, _out(c_uint64)]),
    "moesnap_client_snapshot_sparse": (_STATUS, [c_void_p, c_int64, _strings, c_size_t,
                                                 POINTER(SparseSlot), _out(c_uint64)]),
    "moesnap_client_wait_captured": (_STATUS, [c_void_p, c_int64]),
    "moesnap_client_wait_committed": (_STATUS, [c_void_p, c_int64]),
    "moesnap_client_commit": (_STATUS, [c_void_p, c_int64]),
    "moesnap_client_restore": (_STATUS, [c_void_p, c_int32, c_int64, _strings, c_size_t,
                                         _out(Restored)]),
    "moesnap_client_restore_from": (_STATUS, [c_void_p, c_uint32, _strings, c_size_t,
                                              _out(Restored)]),
    "moesnap_client_latest_committed": (_STATUS, [c_void_p, _out(c_int32), _out(c_int64)]),
    "moesnap_client_windows": (_STATUS, [c_void_p, _out(c_void_p)]),
    "moesnap_client_take_skipped_steps": (_STATUS, [c_void_p, _out(c_void_p)]),
    "moesnap_client_reconnect": (_STATUS, [c_void_p]),
    "moesnap_client_append_log": (_STATUS, [c_void_p, c_int64, c_uint32, c_int32, c_uint32,
                                            c_char_p, c_size_t]),
    "moesnap_client_fetch_log": (_STATUS, [c_void_p, c_uint32, c_int64, c_int32, c_uint32,
                                           _out(c_void_p)]),
    "moesnap_log_messages_count": (c_size_t, [c_void_p]),
    "moesnap_log_messages_micro_batch": (c_uint32, [c_void_p, c_size_t]),
    "moesnap_log_messages_payload": (c_void_p, [c_void_p, c_size_t, _out(c_size_t)]),
    "moesnap_log_messages_free": (None, [c_void_p]),
    "moesnap_schedule_build": (_STATUS, [POINTER(Operator), c_size_t, c_double, c_double,
                                         c_uint64, _out(c_void_p)]),
    "moesnap_schedule_with_window": (_STATUS, [c_void_p, c_int32, _out(c_void_p)]),
    "moesnap_schedule_free": (None, [c_void_p]),
    "moesnap_schedule_agreed_window": (c_int32, [POINTER(c_int32), c_size_t]),
    "moesnap_schedule_window": (c_int32, [c_void_p]),
    "moesnap_schedule_budget_bytes": (c_uint64, [c_void_p]),
    "moesnap_schedule_operator_count": (c_size_t, [c_void_p]),
    "moesnap_schedule_order": (None, [c_void_p, POINTER(c_int32)]),
    "moesnap_schedule_slot_of_step": (c_int32, [c_void_p, c_int64]),
    "moesnap_schedule_slot": (_STATUS, [c_void_p, c_int32, _out(c_uint64), POINTER(c_int32),
                                        _out(c_size_t)]),
    "moesnap_schedule_captured_by": (_STATUS, [c_void_p, c_int32, c_int32, _out(c_int32)]),
    "moesnap_schedule_needs_reorder": (c_int32, [c_void_p, POINTER(c_double), c_size_t]),
    "moesnap_schedule_needs_regeneration": (c_int32, [c_void_p, c_double]),
    "moesnap_plan": (_STATUS, [POINTER(c_double), c_size_t, c_int32, c_int32, c_int32,
                               POINTER(c_int32), c_size_t, _out(c_void_p)]),
    "moesnap_reconfigure": (_STATUS, [POINTER(c_double), c_size_t, c_int32, c_int32, c_int32,
                                      POINTER(Placement), POINTER(c_int32), c_size_t,
                                      POINTER(c_uint64), _out(c_void_p)]),
    "moesnap_recovery_probabilities": (_STATUS, [POINTER(Placement), c_int32, _out(c_void_p)]),
}


def _load() -> ctypes.CDLL:
    try:
        library = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as error:
        raise ImportError(f"moesnap cannot load its native library {LIBRARY_PATH}: {error} "
                          f"(install the moesnap wheel, or build the project: the package is "
                          f"assembled in build/python)") from error
    for name, (result, arguments) in _PROTOTYPES.items():
        function = getattr(library, name)
        function.restype = result
        function.argtypes = arguments
    found = library.moesnap_abi_version()
    if found != _ABI_VERSION:
        raise ImportError(f"{LIBRARY_PATH} has C ABI version {found}, this package was written "
                          f"for version {_ABI_VERSION}")
    return library


lib = _load()


def check(status: int) -> None:
    """Raises the Error a nonzero status stands for, with this thread's message from the call."""
    if status != 0:
        raise Error(lib.moesnap_status_name(status).decode(),
                    lib.moesnap_last_error().decode("utf-8", errors="replace"))


def take_string(pointer: c_void_p) -> str:
    """A string the library returned, released. Bytes that are not UTF-8 (a path in a reason)
    read as U+FFFD: a reason must never fail to be read."""
    try:
        return ctypes.string_at(pointer).decode("utf-8", errors="replace")
    finally:
        lib.moesnap_free(pointer)


def strings(values) -> ctypes.Array:
    """A C array of the values as UTF-8 strings (it keeps them alive)."""
    encoded = [value.encode("utf-8") for value in values]
    return (c_char_p * len(encoded))(*encoded)


def array(kind, values) -> ctypes.Array:
    values = list(values)
    return (kind * len(values))(*values)
