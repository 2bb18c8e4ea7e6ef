"""The durable tier from PyTorch: a trainer whose daemon lost its pool resumes from the newest
durable step bit-identically, and a step exported as safetensors loads into a fresh model with
``moesnap.load`` (no daemon), its files parsed by a reader written here from the format's
description, independent of the writer."""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

import moesnap
from conftest import BIN_DIR, TRAINER, Daemon, start_trainer
from test_training import assert_identical_state, losses_of, run_to_end

sys.path.insert(0, str(TRAINER.parent))
import moe_train  # noqa: E402  (the example's model, for a fresh instance)

STEPS = 12

# The format's dtypes and their element sizes, as its description lists them.
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                      "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
                      "F8_E4M3": 1, "F8_E5M2": 1}


def read_safetensors(path: Path) -> Tuple[Dict[str, Tuple[str, List[int], bytes]], Dict[str, str]]:
    """An independent reader: 8 bytes of little-endian header length N, N bytes of UTF-8 JSON that
    starts with '{' (trailing spaces allowed), then the data, which the tensors' data_offsets cover
    exactly, back to back, from 0. Returns name -> (dtype, shape, bytes) and the metadata."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert 8 + n <= len(data), f"{path}: header of {n} bytes in {len(data)}"
    raw_header = data[8:8 + n]
    assert raw_header[:1] == b"{", f"{path}: the header does not start with '{{'"

    def no_duplicates(pairs):
        keys = [key for key, _ in pairs]
        assert len(keys) == len(set(keys)), f"{path}: duplicate keys"
        return dict(pairs)

    header = json.loads(raw_header.decode("utf-8").rstrip(" "), object_pairs_hook=no_duplicates)
    metadata = header.pop("__metadata__", {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    body = data[8 + n:]
    spans = []
    tensors = {}
    for name, entry in header.items():
        assert set(entry) == {"dtype", "shape", "data_offsets"}, (name, entry)
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        assert dtype in SAFETENSORS_DTYPES, (name, dtype)
        assert all(isinstance(d, int) and d >= 0 for d in shape), (name, shape)
        elements = 1
        for dimension in shape:
            elements *= dimension
        assert end - begin == elements * SAFETENSORS_DTYPES[dtype], (name, dtype, shape, begin, end)
        spans.append((begin, end))
        tensors[name] = (dtype, shape, body[begin:end])
    position = 0
    for begin, end in sorted(spans):
        assert begin == position, f"{path}: a hole or an overlap at byte {position}"
        position = end
    assert position == len(body), f"{path}: {len(body) - position} bytes after the last tensor"
    return tensors, metadata


def ctl(daemon: Daemon, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN_DIR / "moesnapctl"), "--socket", daemon.admin_socket, *arguments],
                          capture_output=True, text=True, timeout=120)


def durable_status(daemon: Daemon) -> dict:
    result = ctl(daemon, "status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["durable"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Tuple[Dict[int, str], dict]:
    out = tmp_path_factory.mktemp("reference") / "state.pt"
    lines = run_to_end(STEPS, None, out)
    return {step: values[0] for step, values in losses_of(lines).items()}, torch.load(out)


def test_pool_lost_with_its_daemon_resumes_from_the_durable_step_bit_identically(tmp_path, reference):
    expected_losses, expected_state = reference
    durable = tmp_path / "durable"
    run_directory = tmp_path / "daemon"
    run_directory.mkdir()
    daemon = Daemon(run_directory, extra_config=f'[durable]\ndirectory = "{durable}"\nevery_steps = 3\n')
    daemon.start()
    try:
        lines = run_to_end(7, daemon.agent_socket, tmp_path / "first.pt")
        deadline = time.monotonic() + 60
        while True:  # steps 1, 3 and 6 were due; wait until each was handled and no drain runs
            status = durable_status(daemon)
            handled = status.get("drains_completed", 0) + status.get("drains_skipped", 0)
            if handled >= 3 and "draining_step" not in status:
                break
            assert time.monotonic() < deadline, json.dumps(status)
            time.sleep(0.05)
        # A due step is skipped when the one before was still draining as it came due (the disk
        # is slower than the schedule): the newest durable step is then an earlier due one.
        durable_step = status["latest_step"]
        assert durable_step in (1, 3, 6), json.dumps(status)
        daemon.remove()  # SIGKILL and the pool deleted: a power loss
        daemon.start()
        tier = ctl(daemon, "restore-tier")
        assert f"durable, step {durable_step}" in tier.stdout, tier.stdout + tier.stderr
        out = tmp_path / "state.pt"
        lines += run_to_end(STEPS, daemon.agent_socket, out)
    finally:
        daemon.remove()
    restored = [int(line.split()[1]) for line in lines if line.startswith("restored ")]
    assert restored == [durable_step], lines
    for step, values in losses_of(lines).items():
        assert all(value == expected_losses[step] for value in values), (step, values)
    assert_identical_state(torch.load(out), expected_state)


def test_exported_step_loads_into_a_fresh_model_without_a_daemon(daemon: Daemon, tmp_path):
    out = tmp_path / "state.pt"
    run_to_end(6, daemon.agent_socket, out)
    expected = torch.load(out)
    export = tmp_path / "export"
    result = ctl(daemon, "export", "--format", "safetensors", "--out", str(export))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", "a progress bar when not on a terminal"
    assert sorted(path.name for path in export.iterdir()) == \
        ["index.json", "rank-0.other.safetensors", "rank-0.safetensors"]

    tensors, metadata = read_safetensors(export / "rank-0.safetensors")
    assert metadata["format"] == "pt" and metadata["moesnap.step"] == "6"
    for key, tensor in expected["model"].items():
        dtype, shape, raw = tensors[f"model.{key}"]
        assert dtype == "F32" and shape == list(tensor.shape), key
        assert raw == tensor.contiguous().numpy().tobytes(), key
    others, _ = read_safetensors(export / "rank-0.other.safetensors")
    assert sorted(others) == ["data", "optim.state_dict", "rng"]
    assert all(dtype == "U8" for dtype, _, _ in others.values())

    state = moesnap.load(export)
    torch.manual_seed(123)  # a fresh model with other weights
    model = moe_train.MoETransformer()
    model.load_state_dict(state["model"])
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected["model"][key]), key
    # Without unpickling, the optimizer's tensors by parameter; with it, its whole state dict.
    names = [f"model.{key}" for key, _ in model.named_parameters()]
    expected_optimizer = expected["optimizer"]["state"]
    assert sorted(state["optim"]["state"]) == sorted(names)
    for index, entries in expected_optimizer.items():
        for key, tensor in entries.items():
            assert torch.equal(state["optim"]["state"][names[index]][key], tensor), (index, key)
    assert isinstance(state["data"], bytes)  # pickles stay bytes unless asked
    trusted = moesnap.load(export, allow_pickle=True)
    assert trusted["data"] == {"next_step": 7}
    assert trusted["optim"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert trusted["optim"]["state"].keys() == expected_optimizer.keys()
    for index, entries in expected_optimizer.items():
        for key, tensor in entries.items():
            assert torch.equal(trusted["optim"]["state"][index][key], tensor), (index, key)
    assert moesnap.exported_step(export) == (6, "memory")


def test_load_refuses_damaged_files(tmp_path, daemon: Daemon):
    run_to_end(2, daemon.agent_socket, None)
    export = tmp_path / "export"
    assert ctl(daemon, "export", "--format", "safetensors", "--out", str(export)).returncode == 0
    path = export / "rank-0.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data))  # a header longer than the file
    path.write_bytes(bytes(data))
    with pytest.raises(moesnap.Error) as error:
        moesnap.load(export)
    assert error.value.code == "DATA_LOSS"
