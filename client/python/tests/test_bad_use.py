"""Mistakes a training script can make get moesnap.Error naming the tensor, and lose nothing."""

import pytest
import torch

import moesnap
from conftest import Daemon


def test_registering_after_snapshots_started_names_the_tensor(daemon: Daemon):
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", torch.nn.Linear(4, 3))
    client.snapshot(1)
    client.wait_captured()
    with pytest.raises(moesnap.Error) as error:
        client.register_module("late", torch.nn.Linear(2, 2))
    assert error.value.code == "FAILED_PRECONDITION"
    assert "'late'" in error.value.message


def test_a_tensor_replaced_after_registration_is_refused_by_name(daemon: Daemon):
    model = torch.nn.Linear(4, 3)
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", model)
    model.bias.data = torch.zeros(5)  # resized: no longer the registered shared memory
    with pytest.raises(moesnap.Error) as error:
        client.snapshot(1)
    assert error.value.code == "FAILED_PRECONDITION"
    assert "model.bias" in error.value.message


def test_restoring_into_a_model_of_another_shape_names_the_tensor(daemon: Daemon):
    original = torch.nn.Linear(4, 3)
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_module("model", original)
    client.snapshot(1)
    client.wait_committed(1)
    expected = original.weight.detach().clone()

    wider = moesnap.Client(daemon.agent_socket, 0)
    wider.register_module("model", torch.nn.Linear(5, 3))
    with pytest.raises(moesnap.Error) as error:
        wider.restore()
    assert error.value.code == "INVALID_ARGUMENT"
    assert "model.weight" in error.value.message

    # Nothing stored was lost: a model of the right shape still restores step 1 exactly.
    same = torch.nn.Linear(4, 3)
    fresh = moesnap.Client(daemon.agent_socket, 0)
    fresh.register_module("model", same)
    assert fresh.restore() == 1
    assert torch.equal(same.weight, expected)


def test_state_larger_than_its_region_is_refused(daemon: Daemon):
    class Big:
        def state_dict(self):
            return b"x" * 5000

        def load_state_dict(self, state):
            pass

    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_state("big", Big(), capacity=1024)
    with pytest.raises(moesnap.Error) as error:
        client.snapshot(1)
    assert error.value.code == "RESOURCE_EXHAUSTED"
    assert "'big'" in error.value.message


def test_no_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(moesnap.Error) as error:
        moesnap.Client(str(tmp_path / "nothing.sock"), 0, call_timeout_s=1)
    assert "nothing.sock" in error.value.message
