"""CUDA tensors shared by IPC, end to end through a real daemon (label gpu in spirit: skipped, with
the reason, wherever torch sees no CUDA device)."""

import pytest
import torch

import moesnap
from conftest import Daemon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")


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
