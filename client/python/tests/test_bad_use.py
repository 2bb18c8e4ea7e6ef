"""Mistakes a training script can make get moesnap.Error naming the tensor, and lose nothing."""

import time

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


def test_a_snapshot_the_daemon_refused_leaves_no_capture_to_wait_for(daemon: Daemon):
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register_tensor("weights", torch.zeros(4))
    with pytest.raises(moesnap.Error) as error:
        client.snapshot(1, ["no such region"])
    assert error.value.code == "NOT_FOUND"
    client.wait_captured()  # the daemon took no step 1: asking it about one would be an error
    assert client.snapshot(2) > 0
    client.wait_captured()
    client.wait_committed(2)


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
    class Growing:
        size = 5000

        def state_dict(self):
            return b"x" * self.size

        def load_state_dict(self, state):
            pass

    client = moesnap.Client(daemon.agent_socket, 0)
    with pytest.raises(moesnap.Error) as error:  # too large already: refused at registration
        client.register_state("big", Growing(), capacity=1024)
    assert error.value.code == "RESOURCE_EXHAUSTED"
    assert "'big'" in error.value.message
    grown = Growing()
    grown.size = 100
    client.register_state("grows", grown, capacity=1024)
    grown.size = 5000
    with pytest.raises(moesnap.Error) as error:
        client.snapshot(1)
    assert error.value.code == "RESOURCE_EXHAUSTED"
    assert "'grows'" in error.value.message


def test_no_daemon_is_a_clear_error_at_once(tmp_path):
    began = time.monotonic()
    with pytest.raises(moesnap.Error) as error:
        moesnap.Client(str(tmp_path / "nothing.sock"), 0)
    assert time.monotonic() - began < 10, "not at once: the default call timeout is 30 s"
    assert error.value.code == "UNAVAILABLE"
    assert "nothing.sock" in error.value.message


def test_an_object_without_state_dict_is_refused_at_registration(daemon: Daemon):
    client = moesnap.Client(daemon.agent_socket, 0)
    with pytest.raises(moesnap.Error) as error:
        client.register("sampler", object())
    assert error.value.code == "INVALID_ARGUMENT"
    assert "'sampler'" in error.value.message and "state_dict" in error.value.message


def test_an_optimizer_over_an_unregistered_parameter_is_refused_by_shape(daemon: Daemon):
    model = torch.nn.Linear(4, 3)
    client = moesnap.Client(daemon.agent_socket, 0)
    with pytest.raises(moesnap.Error) as error:
        client.register("optim", torch.optim.SGD(model.parameters(), lr=0.1))
    assert error.value.code == "INVALID_ARGUMENT"
    assert "parameter 0 of optimizer 'optim'" in error.value.message
    assert "[3, 4]" in error.value.message


def test_a_non_contiguous_tensor_is_refused_by_name(daemon: Daemon):
    client = moesnap.Client(daemon.agent_socket, 0)
    with pytest.raises(moesnap.Error) as error:
        client.register_tensor("transposed", torch.zeros(4, 3).t())
    assert error.value.code == "INVALID_ARGUMENT"
    assert "'transposed'" in error.value.message


def test_a_model_whose_parameters_changed_order_is_refused_by_name(daemon: Daemon):
    class Two(torch.nn.Module):
        def __init__(self, first: str, second: str) -> None:
            super().__init__()
            setattr(self, first, torch.nn.Parameter(torch.ones(2)))
            setattr(self, second, torch.nn.Parameter(torch.ones(2)))

    def trainer(first: str, second: str):
        model = Two(first, second)
        optimizer = torch.optim.SGD([getattr(model, first), getattr(model, second)], lr=0.1,
                                    momentum=0.9)
        client = moesnap.Client(daemon.agent_socket, 0)
        client.register("model", model)
        client.register("optim", optimizer)
        return model, optimizer, client

    model, optimizer, client = trainer("a", "b")
    model.a.grad = torch.ones(2)
    model.b.grad = torch.ones(2)
    optimizer.step()
    client.snapshot(1)
    client.wait_committed(1)

    _, _, swapped = trainer("b", "a")  # the optimizer now holds b first
    with pytest.raises(moesnap.Error) as error:
        swapped.restore()
    assert error.value.code == "INVALID_ARGUMENT"
    assert "parameter 0 is 'model.b' in this trainer but was 'model.a'" in error.value.message


def test_rank_and_socket_come_from_the_launchers_environment(daemon: Daemon, monkeypatch):
    monkeypatch.setenv("MOESNAP_SOCKET", daemon.agent_socket)
    monkeypatch.setenv("RANK", "5")
    assert moesnap.Client().rank == 5
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert moesnap.Client().rank == 2
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(moesnap.Error) as error:
        moesnap.Client()
    assert "RANK" in error.value.message


def test_rewind_goes_back_to_the_last_staged_step_only(daemon: Daemon):
    class Counter:
        def __init__(self) -> None:
            self.position = 0

        def state_dict(self) -> dict:
            return {"position": self.position}

        def load_state_dict(self, state: dict) -> None:
            self.position = state["position"]

    model = torch.nn.BatchNorm1d(3)
    counter = Counter()
    client = moesnap.Client(daemon.agent_socket, 0)
    client.register("model", model)
    client.register("sampler", counter)
    counter.position = 7
    model(torch.randn(4, 3))
    statistics = model.running_mean.clone()
    client.snapshot(1)
    client.wait_captured()
    weight = model.weight.detach().clone()
    # The next step begins, then is cut short: the sampler and the buffers moved, the weights not.
    counter.position = 8
    model(torch.randn(4, 3))
    with pytest.raises(moesnap.Error) as error:
        client.rewind(2)
    assert error.value.code == "FAILED_PRECONDITION" and "step 1" in error.value.message
    client.rewind(1)
    assert counter.position == 7
    assert torch.equal(model.running_mean, statistics)
    assert torch.equal(model.weight, weight)
