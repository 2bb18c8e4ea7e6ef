"""Loading an exported snapshot (``moesnapctl export --format safetensors``) without a daemon.

``moesnap.load(directory)`` reads ``index.json`` and the rank's safetensors files and returns the
state as the trainer registered it, grouped by the name it registered it under::

    state = moesnap.load("/exports/step-1200")
    model.load_state_dict(state["model"])           # client.register_module("model", model)
    optimizer.load_state_dict(state["optim"])       # client.register_optimizer("optim", optimizer)

A region named ``"<name>.<key>"`` lands in ``state[name][key]``. Non-tensor state
(``register_state``: pickled objects) comes back as the pickle's bytes, or unpickled with
``allow_pickle=True`` (only for files you trust: unpickling runs code). An optimizer comes back,
with ``allow_pickle=True``, as exactly its ``optimizer.state_dict()`` (``param_groups`` and
non-tensor state are in its pickled ``"<name>.state_dict"`` region); without, as its state tensors
by parameter, ``state[name]["state"][<parameter region>][key]``, beside the pickle's bytes in
``state[name]["state_dict"]``. Region aliases of sparse snapshots (names with ``@``) are left out.

The files are read as untrusted input: every header is bounded and checked against its file before
any tensor is built.
"""

from __future__ import annotations

import json
import mmap
import pickle
import struct
from pathlib import Path
from typing import Any, Dict, Tuple, Union

import torch

from .core import Error

_MAX_HEADER_BYTES = 100 << 20
_PICKLE_LENGTH = struct.Struct("<Q")  # register_state's prefix: the pickle's length
_TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64,
}
_ELEMENT_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2,
                  "F32": 4, "F64": 8}


def _read_safetensors(path: Path) -> Dict[str, Union[torch.Tensor, bytes]]:
    """Every tensor of a safetensors file (U8 tensors of a ``moesnap-bytes`` file as bytes)."""
    with open(path, "rb") as file:
        size = path.stat().st_size
        if size < 8:
            raise Error("DATA_LOSS", f"{path}: {size} bytes, shorter than a safetensors header")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            (header_bytes,) = struct.unpack("<Q", data[:8])
            if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
                raise Error("DATA_LOSS", f"{path}: a header of {header_bytes} bytes in a file of "
                                         f"{size}")
            try:
                header = json.loads(data[8:8 + header_bytes].decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise Error("DATA_LOSS", f"{path}: the header is not JSON: {error}") from None
            if not isinstance(header, dict):
                raise Error("DATA_LOSS", f"{path}: the header is not a JSON object")
            metadata = header.pop("__metadata__", {}) or {}
            as_bytes = metadata.get("format") == "moesnap-bytes"
            start = 8 + header_bytes
            tensors: Dict[str, Union[torch.Tensor, bytes]] = {}
            for name, entry in header.items():
                try:
                    dtype, shape = entry["dtype"], [int(d) for d in entry["shape"]]
                    begin, end = (int(offset) for offset in entry["data_offsets"])
                except (KeyError, TypeError, ValueError):
                    raise Error("DATA_LOSS", f"{path}: tensor '{name}' has a malformed entry") \
                        from None
                if dtype not in _TORCH_DTYPES:
                    raise Error("UNIMPLEMENTED", f"{path}: tensor '{name}' is {dtype}, which this "
                                                 f"PyTorch cannot hold")
                elements = 1
                for dimension in shape:
                    if dimension < 0:
                        raise Error("DATA_LOSS", f"{path}: tensor '{name}' has shape {shape}")
                    elements *= dimension
                if not 0 <= begin <= end <= size - start or \
                        end - begin != elements * _ELEMENT_BYTES[dtype]:
                    raise Error("DATA_LOSS", f"{path}: tensor '{name}' ({dtype} {shape}) claims "
                                             f"bytes [{begin}, {end}) of {size - start}")
                raw = data[start + begin:start + end]
                if as_bytes:
                    tensors[name] = bytes(raw)
                elif elements == 0:
                    tensors[name] = torch.empty(shape, dtype=_TORCH_DTYPES[dtype])
                else:
                    tensors[name] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) \
                        .view(_TORCH_DTYPES[dtype]).reshape(shape)
            return tensors


def _decode_bytes(region: Dict[str, Any], payload: bytes, allow_pickle: bool) -> Any:
    if region.get("dtype") != "pickle":
        return payload
    if len(payload) < _PICKLE_LENGTH.size:
        raise Error("DATA_LOSS", f"a pickled state of {len(payload)} bytes has no length prefix")
    (length,) = _PICKLE_LENGTH.unpack(payload[:_PICKLE_LENGTH.size])
    if length > len(payload) - _PICKLE_LENGTH.size:
        raise Error("DATA_LOSS", f"a pickled state claims {length} bytes of "
                                 f"{len(payload) - _PICKLE_LENGTH.size}")
    pickled = payload[_PICKLE_LENGTH.size:_PICKLE_LENGTH.size + length]
    return pickle.loads(pickled) if allow_pickle else pickled


def _group(regions: Dict[str, Any]) -> Dict[str, Any]:
    """Regions by the name they were registered under: modules as state dicts, optimizers as
    optimizer state dicts, the rest as they are."""
    prefixes: Dict[str, Dict[str, Any]] = {}
    state: Dict[str, Any] = {}
    for name, value in regions.items():
        if "@" in name:
            continue  # a sparse snapshot's alias of another region
        prefix, dot, key = name.partition(".")
        if dot:
            prefixes.setdefault(prefix, {})[key] = value
        else:
            state[name] = value
    for prefix, entries in prefixes.items():
        if "state_dict" in entries and \
                all(key == "state_dict" or key.startswith("state.") for key in entries):
            state[prefix] = _optimizer(prefix, entries)
        else:
            state[prefix] = dict(sorted(entries.items()))
    return state


def _optimizer(prefix: str, entries: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer's regions as its state dict (see the module)."""
    manifest = entries["state_dict"]
    if isinstance(manifest, bytes):  # not unpickled: the tensors by parameter, the pickle as is
        by_parameter: Dict[str, Dict[str, Any]] = {}
        for key, value in entries.items():
            if key != "state_dict":
                parameter, _, field = key[len("state."):].rpartition(".")
                by_parameter.setdefault(parameter, {})[field] = value
        return {"state": by_parameter, "state_dict": manifest}
    from .torch_helpers import _TensorRef  # pylint: disable=import-outside-toplevel
    state: Dict[int, Dict[str, Any]] = {}
    for index, fields in manifest["state"].items():
        state[index] = {}
        for field, value in fields.items():
            if isinstance(value, _TensorRef):
                key = f"state.{manifest['parameters'][index]}.{field}"
                if key in entries:
                    value = entries[key]
                elif all(value.shape):  # a tensor with elements has a region
                    raise Error("DATA_LOSS", f"optimizer '{prefix}' names state '{prefix}.{key}', "
                                             f"which the export does not hold")
                else:
                    value = torch.empty(value.shape, dtype=value.dtype)
            state[index][field] = value
    return {"state": state, "param_groups": manifest["param_groups"]}


def load(directory: Union[str, Path], rank: int = 0, *, allow_pickle: bool = False) -> Dict[str, Any]:
    """The state of ``rank`` in an export folder, grouped by registered name (see the module)."""
    directory = Path(directory)
    try:
        index = json.loads((directory / "index.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise Error("NOT_FOUND", f"{directory} holds no readable index.json: {error}") from None
    if index.get("format") != "moesnap-export":
        raise Error("INVALID_ARGUMENT", f"{directory}/index.json is not a moesnap export")
    ranks = index.get("ranks", {})
    if str(rank) not in ranks:
        raise Error("NOT_FOUND", f"the export in {directory} holds ranks {sorted(ranks, key=int)}, "
                                 f"not rank {rank}")
    described: Dict[str, Dict[str, Any]] = ranks[str(rank)]["regions"]
    files: Dict[str, Dict[str, Union[torch.Tensor, bytes]]] = {}
    regions: Dict[str, Any] = {}
    for name, region in described.items():
        file_name = region["file"]
        if Path(file_name).name != file_name:
            raise Error("DATA_LOSS", f"index.json names file '{file_name}' outside {directory}")
        if file_name not in files:
            files[file_name] = _read_safetensors(directory / file_name)
        if name not in files[file_name]:
            raise Error("DATA_LOSS", f"region '{name}' is not in {file_name}")
        value = files[file_name][name]
        regions[name] = _decode_bytes(region, value, allow_pickle) if isinstance(value, bytes) \
            else value
    return _group(regions)


def exported_step(directory: Union[str, Path]) -> Tuple[int, str]:
    """The step an export holds and the tier it came from ("memory" or "durable")."""
    index = json.loads((Path(directory) / "index.json").read_text())
    return int(index["step"]), str(index["tier"])
