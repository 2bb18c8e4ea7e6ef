"""Never stop training: a failure of the snapshot system (the daemon killed, restarted or replaced)
never raises from a per-step call; the step is skipped, saying why, and snapshots catch up once the
daemon is back. Misuse still raises (test_bad_use.py)."""

import os
import signal
import time
from pathlib import Path
from typing import Callable, Tuple

import pytest
import torch
import torch.distributed

import moesnap
from conftest import Daemon
from moesnap.pipeline import StageLink
from test_sparse import wait_until_answering


def adam_trainer(client: moesnap.Client) -> Tuple[torch.optim.Optimizer, Callable[[], None]]:
    """A linear layer under Adam registered with ``client``, and a function training one step.
    Adam creates its state at its first step, which the next snapshot registers: its weight's
    moments shared, its bias's and step counters staged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    client.register_module("model", model)
    client.register_optimizer("optim", optimizer)

    def train() -> None:
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return optimizer, train


def assert_restarted_trainer_restores(daemon: Daemon, step: int,
                                      optimizer: torch.optim.Optimizer) -> None:
    restarted = moesnap.Client(daemon.agent_socket, 0)
    restored_optimizer, _ = adam_trainer(restarted)
    assert restarted.restore() == step
    expected, restored = optimizer.state_dict()["state"], restored_optimizer.state_dict()["state"]
    assert restored.keys() == expected.keys()
    for index, entries in expected.items():
        for key, tensor in entries.items():
            assert torch.equal(restored[index][key], tensor), (index, key)


def assert_next_step_is_snapshotted_whole(daemon: Daemon, client: moesnap.Client,
                                          optimizer: torch.optim.Optimizer,
                                          train: Callable[[], None]) -> None:
    """After a step skipped for want of the daemon, the next step snapshots everything: a new
    process of the rank restores all of the optimizer's state from it."""
    client.wait_captured()
    train()
    assert client.snapshot(2) > 0
    client.wait_committed(2)
    client.close()
    assert_restarted_trainer_restores(daemon, 2, optimizer)


def test_optimizer_state_created_with_the_daemon_down_is_snapshotted_once_it_is_back(
        daemon: Daemon, monkeypatch):
    client = moesnap.Client(daemon.agent_socket, 0)
    optimizer, train = adam_trainer(client)
    train()
    daemon.kill()
    # The state's shared memory is allocated once it can be handed over, not at every snapshot.
    allocated = []
    original = moesnap._storage.SharedFile
    monkeypatch.setattr(moesnap._storage, "SharedFile",
                        lambda *args: allocated.append(args[1]) or original(*args))
    for step in (1, 2):
        assert client.snapshot(step) == 0
    assert allocated == []
    assert [step for step, _ in client.skipped_steps] == [1, 2]
    assert "registered" in client.skipped_steps[0][1], client.skipped_steps
    daemon.start()
    wait_until_answering(client)
    assert_next_step_is_snapshotted_whole(daemon, client, optimizer, train)


def test_a_final_commit_with_the_daemon_down_says_why_and_a_later_one_commits_everything(
        daemon: Daemon, caplog):
    client = moesnap.Client(daemon.agent_socket, 0)
    optimizer, train = adam_trainer(client)
    train()
    daemon.kill()
    assert client.commit(1) is False
    assert "could not commit step 1" in caplog.text
    daemon.start()
    wait_until_answering(client)
    assert client.commit(1) is True
    client.close()
    assert_restarted_trainer_restores(daemon, 1, optimizer)


def test_a_hung_daemon_costs_the_training_loop_one_timeout_not_one_every_step(daemon: Daemon):
    """A daemon that serves nothing (stopped) costs one call's timeout: the steps after it are
    skipped at once, saying why, until it answers again, and then the rank snapshots whole as
    before."""
    call_timeout = 2.0  # long enough for a loaded machine to answer what it should
    client = moesnap.Client(daemon.agent_socket, 0, call_timeout_s=call_timeout)
    optimizer, train = adam_trainer(client)
    train()
    assert client.snapshot(1) > 0
    client.wait_committed(1)
    steps = range(3, 13)
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        train()
        assert client.snapshot(2) == 0  # the one timeout
        began = time.monotonic()
        for step in steps:
            train()
            assert client.snapshot(step) == 0
        elapsed = time.monotonic() - began
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert elapsed < len(steps) * call_timeout / 2, elapsed  # each would have waited it out
    assert [step for step, _ in client.skipped_steps] == [2, *steps], client.skipped_steps
    assert all("answered nothing since Snapshot" in reason
               for _, reason in client.skipped_steps[1:]), client.skipped_steps
    wait_until_answering(client)
    step = steps[-1]
    deadline = time.monotonic() + 60
    while True:  # taken once the daemon answers this client's calls again
        step += 1
        train()
        if client.snapshot(step) > 0:
            break
        assert time.monotonic() < deadline, client.skipped_steps
    client.wait_committed(step)
    client.close()
    assert_restarted_trainer_restores(daemon, step, optimizer)


@pytest.mark.parametrize("refused_call", [0, 1])  # the shared moments', the staged tensors'
def test_optimizer_state_whose_registration_failed_half_way_is_registered_whole_later(
        daemon: Daemon, monkeypatch, refused_call):
    client = moesnap.Client(daemon.agent_socket, 0)
    optimizer, train = adam_trainer(client)
    train()
    # The daemon goes away after taking the memory, before registering the regions in it.
    register_host_regions = client._native.register_host_regions
    calls = []

    def register_or_refuse(specs):
        calls.append(specs)
        if len(calls) - 1 == refused_call:
            raise moesnap.Error("UNAVAILABLE", "moesnapd went away")
        register_host_regions(specs)

    monkeypatch.setattr(client._native, "register_host_regions", register_or_refuse)
    assert client.snapshot(1) == 0
    assert len(calls) == refused_call + 1
    monkeypatch.undo()
    assert_next_step_is_snapshotted_whole(daemon, client, optimizer, train)


def test_a_skip_reason_with_bytes_that_are_not_utf8_is_read_with_replacements(daemon: Daemon):
    # The reason names the socket, here through a link whose name is not UTF-8.
    directory = os.fsencode(Path(daemon.agent_socket).parent)
    link = directory + b"/link-\xff"
    os.symlink(directory, link)
    client = moesnap.Client(os.fsdecode(link + b"/agent.sock"), 0)
    client.register_tensor("weights", torch.zeros(4))
    assert client.snapshot(1) > 0
    daemon.remove()  # its pool too: the daemon replacing it never took step 1
    daemon.start()
    wait_until_answering(client)
    client.wait_captured()
    assert [step for step, _ in client.skipped_steps] == [1], client.skipped_steps
    assert "link-\ufffd" in client.skipped_steps[0][1], client.skipped_steps


def test_a_stage_whose_daemon_is_gone_still_sends_what_it_could_not_log(daemon: Daemon,
                                                                         monkeypatch, caplog):
    sent = []
    monkeypatch.setattr(torch.distributed, "send",
                        lambda tensor, rank: sent.append((rank, tensor.tolist())))
    client = moesnap.Client(daemon.agent_socket, 1)
    client.register_tensor("weights", torch.zeros(4))
    link = StageLink(client, 1, [0, 1, 2])
    daemon.kill()
    link.send_forward(1, 0, torch.ones(4))
    link.send_backward(1, 0, torch.full((4,), 2.0))
    assert sent == [(2, [1.0] * 4), (0, [2.0] * 4)]
    assert link.log_refusals == 2
    assert "not logged" in caplog.text
