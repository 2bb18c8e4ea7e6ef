"""CUDA tensors shared by IPC, end to end through a real daemon (label gpu in spirit: skipped, with
the reason, wherever torch sees no CUDA device)."""

import re
from pathlib import Path
from typing import List

import pytest
import torch

import moesnap
from conftest import Daemon, start_trainer
from test_training import assert_identical_state, kill_after, losses_of, run_to_end

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")

STEPS = 10
ON_GPU = ["--device", "cuda"]


def test_cuda_module_round_trips_through_the_daemon(daemon: Daemon):
    model = torch.nn.Linear(256, 128).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", model)
    client.register_optimizer("optim", optimizer)
    expected = model.weight.detach().clone()
    client.snapshot(1)
    client.wait_committed(1)
    with torch.no_grad():
        model.weight.zero_()
    torch.cuda.synchronize()
    assert client.restore() == 1
    assert torch.equal(model.weight, expected)


def test_gpu_trainer_killed_resumes_bit_identically(daemon: Daemon, tmp_path: Path):
    """The MoE example on the GPU (parameters and Adam moments in device memory, Adam's step
    counters on the host), SIGKILLed right after a snapshot and mid-step: each fresh process
    restores from the daemon, and every loss and the final state equal an uninterrupted run's."""
    reference_out = tmp_path / "reference.pt"
    reference_lines = run_to_end(STEPS, None, reference_out, ON_GPU)
    expected_losses = {step: values[0] for step, values in losses_of(reference_lines).items()}
    assert sorted(expected_losses) == list(range(1, STEPS + 1)), reference_lines

    all_lines: List[str] = []
    for pattern in [r"snapshot 3", r"step 6 loss \S+"]:
        all_lines += kill_after(start_trainer(STEPS, daemon.agent_socket, extra=ON_GPU), pattern)
    out = tmp_path / "state.pt"
    all_lines += run_to_end(STEPS, daemon.agent_socket, out, ON_GPU)

    restored = [int(match.group(1)) for line in all_lines
                if (match := re.fullmatch(r"restored (\d+)", line))]
    assert len(restored) == 2 and restored[0] == 3 and restored[1] in (5, 6), all_lines
    for step, values in losses_of(all_lines).items():
        assert all(value == expected_losses[step] for value in values), (step, values, all_lines)
    final = torch.load(out)
    assert all(tensor.is_cuda for tensor in final["model"].values())
    assert_identical_state(final, torch.load(reference_out))
