"""Sparse snapshots and sparse-to-dense recovery with a real PyTorch MoE trainer, SIGKILLed at
several points for several window sizes, with global gradient clipping on: every loss printed
(replayed steps included) and the final parameters and Adam state must be bit-identical to an
uninterrupted run."""

import signal
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch

import moesnap
import moesnap.sparse
from conftest import Daemon, start_trainer
from test_training import assert_identical_state, kill_after, losses_of

STEPS = 13
CLIP = ["--clip", "0.5"]  # small enough that clipping scales the gradients at every step


@pytest.fixture(scope="module")
def clipped_reference(tmp_path_factory) -> Tuple[Dict[int, str], dict]:
    out = tmp_path_factory.mktemp("clipped") / "state.pt"
    trainer = start_trainer(STEPS, None, out, CLIP)
    lines = trainer.stdout.read().splitlines()
    assert trainer.wait() == 0, lines
    losses = {step: values[0] for step, values in losses_of(lines).items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, torch.load(out)


@pytest.mark.parametrize("window,kill_points,restored", [
    # A kill in the middle of a window recovers the window before it; a kill right after its last
    # step recovers that window itself.
    (3, [r"snapshot 5", r"snapshot 9"], [3, 9]),
    (4, [r"step 7 loss \S+", r"snapshot 12"], [4, 12]),
    (5, [r"snapshot 11"], [10]),
])
def test_sparse_window_recovers_bit_identically(daemon: Daemon, clipped_reference, tmp_path,
                                                window, kill_points, restored):
    expected_losses, expected_state = clipped_reference
    sparse = CLIP + ["--sparse-window", str(window)]
    all_lines: List[str] = []
    for pattern in kill_points:
        all_lines += kill_after(start_trainer(STEPS, daemon.agent_socket, extra=sparse), pattern)
    out = tmp_path / "state.pt"
    trainer = start_trainer(STEPS, daemon.agent_socket, out, sparse)
    lines = trainer.stdout.read().splitlines()
    assert trainer.wait() == 0, lines
    all_lines += lines
    restored_steps = [int(line.split()[1]) for line in all_lines if line.startswith("restored ")]
    assert restored_steps == restored, all_lines
    for step, values in losses_of(all_lines).items():
        assert all(value == expected_losses[step] for value in values), (step, values)
    assert_identical_state(torch.load(out), expected_state)


def test_sparse_steps_copy_a_fraction_of_the_state(daemon: Daemon):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import moe_train

    torch.manual_seed(0)
    model = moe_train.MoETransformer()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    client = moesnap.Client(daemon.agent_socket, 7)
    client.register_module("model", model)
    client.register_optimizer("optim", optimizer)
    operators = moe_train.operators_of(model)
    sparse = moesnap.sparse.SparseSnapshots(client, model, optimizer, operators, window=4)
    weights = sum(p.numel() * 4 for p in model.parameters())
    full = weights * 2 + 4 * len(list(model.parameters()))  # + Adam moments and step counters
    copied = []
    # The logged gradient norms and the optimizer's pickled state dict (with its length prefix).
    parameters = len(list(model.parameters()))
    every_step = 4 * 4 + (64 << 10) + 512 * parameters + 8
    for step in range(1, 5):
        copied.append(sparse.snapshot(step) - every_step)
        client.wait_captured()
    # Slot k copies its operators whole and the later slots' weights: the first slot the most,
    # every slot less than a dense snapshot, and the window adds up to the state once plus the
    # weights of the operators still waiting at each earlier slot.
    assert all(bytes_ < full for bytes_ in copied), (copied, full)
    assert copied == sorted(copied, reverse=True), copied
    captured = sorted(name for k in range(4) for name in sparse.operators_of_slot(k))
    assert captured == sorted(name for name, _ in operators)
    # The daemon committed the window and knows what each slot captured.
    client.wait_committed(4)
    windows = client.windows()
    assert windows["open"] is None
    committed = windows["committed"]
    assert (committed["first_step"], committed["size"], committed["buffer"]) == (1, 4, 0)
    assert [(slot, step, done) for slot, step, done, _ in committed["slots"]] == \
        [(k, k + 1, True) for k in range(4)]
    assert [names for _, _, _, names in committed["slots"]] == \
        [sparse.operators_of_slot(k) for k in range(4)]
    with pytest.raises(moesnap.Error) as error:
        moesnap.sparse.SparseSnapshots(client, model, optimizer, operators[:-1], window=4)
    assert "parameters in no operator" in error.value.message


class _FailedWindowDaemon:
    """What a daemon answers a rank whose window from step 7 (3 steps) failed: slot 0 aborted by
    the cluster, slot 1 captured and waiting for its decision (a wait returns once the cluster
    aborts it), slot 2 skipped with a failure of its own; buffer 0 holds the committed window."""

    def __init__(self) -> None:
        self.calls: List[object] = []
        self.skipped_steps: List[Tuple[int, str]] = []

    def wait_committed(self, step: int) -> None:
        self.calls.append(step)
        raise moesnap.Error("INTERNAL" if step == 9 else "ABORTED", f"step {step} failed")

    def windows(self) -> dict:
        self.calls.append("windows")
        return {"committed": {"first_step": 1, "size": 3, "buffer": 0}, "open": None}


def test_a_window_opens_once_every_slot_of_the_one_before_settled():
    """The next window's slot 0 is refused while a slot of the open one is undecided, so the
    trainer waits for each slot, not for the last alone (skipped, it answers at once), and no
    slot's failure, whatever its code, reaches the training loop."""
    daemon = _FailedWindowDaemon()
    snapshots = moesnap.sparse.SparseSnapshots.__new__(moesnap.sparse.SparseSnapshots)
    snapshots.window, snapshots._client = 3, daemon
    snapshots._window_first, snapshots._buffer = None, 0
    assert snapshots._buffer_for_window(10) == 1
    assert daemon.calls == [7, 8, 9, "windows"]
    daemon.calls.clear()
    assert snapshots._buffer_for_window(10) == 1  # the window's later slots ask nothing again
    assert daemon.calls == []



def small_sparse_trainer(client: moesnap.Client, window: int) -> Callable[[int], int]:
    """A two-layer model under Adam with sparse snapshots of one layer per operator; returns a
    function that trains one step, snapshots it and waits for its capture, returning the bytes
    copied (0: skipped)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.Adam(model.parameters())
    client.register_module("model", model)
    client.register_optimizer("optim", optimizer)
    operators = [(f"layer{index}", list(layer.parameters())) for index, layer in enumerate(model)]
    sparse = moesnap.sparse.SparseSnapshots(client, model, optimizer, operators, window)

    def train_and_snapshot(step: int) -> int:
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        copied = sparse.snapshot(step)
        sparse.wait_captured()
        return copied

    return train_and_snapshot


def wait_until_answering(client: moesnap.Client, timeout: float = 30) -> None:
    """Waits until the client reaches its (restarted) daemon again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.latest_committed()
            return
        except moesnap.Error as error:
            assert error.code == "UNAVAILABLE" and time.monotonic() < deadline, error
            time.sleep(0.02)


@pytest.mark.parametrize("failure", ["hung", "killed"])
def test_a_window_whose_first_step_finds_no_daemon_is_skipped_after_one_wait(daemon: Daemon,
                                                                              failure):
    """At a window's first step the trainer asks the daemon which buffer is free; a daemon that
    does not answer costs one wait (not one per slot of the window before), and the window is
    skipped whole: its later steps ask nothing. The next window commits."""
    wait_timeout = 1.5
    client = moesnap.Client(daemon.agent_socket, 0, call_timeout_s=1, wait_timeout_s=wait_timeout)
    train_and_snapshot = small_sparse_trainer(client, window=4)
    for step in range(1, 5):
        assert train_and_snapshot(step) > 0
    if failure == "hung":
        daemon.process.send_signal(signal.SIGSTOP)
    else:
        daemon.kill()
    try:
        began = time.monotonic()
        for step in range(5, 9):
            assert train_and_snapshot(step) == 0
        elapsed = time.monotonic() - began
    finally:
        if failure == "hung":
            daemon.process.send_signal(signal.SIGCONT)
    assert [step for step, _ in client.skipped_steps] == [5, 6, 7, 8], client.skipped_steps
    assert all("window from step 5" in reason for _, reason in client.skipped_steps), \
        client.skipped_steps
    assert elapsed < 3 * wait_timeout, elapsed
    if failure == "killed":
        daemon.start()
    wait_until_answering(client)  # a hung daemon's client refuses calls until it answers again
    for step in range(9, 13):
        assert train_and_snapshot(step) > 0
    client.wait_committed(12)
    assert client.windows()["committed"]["first_step"] == 9


@pytest.mark.parametrize("daemon_back", ["restarted", "replaced"])
def test_a_window_missing_a_slot_is_skipped_to_its_end_and_the_next_one_commits(daemon: Daemon,
                                                                                 daemon_back):
    """A slot that never reached the daemon (it was down; or a daemon with an empty pool replaced
    it, which knows no open window) leaves its window unable to commit: the window's later steps
    are skipped, saying why, instead of raising the daemon's refusal into the training loop."""
    client = moesnap.Client(daemon.agent_socket, 0)
    train_and_snapshot = small_sparse_trainer(client, window=4)
    assert train_and_snapshot(1) > 0
    client.wait_committed(1)
    if daemon_back == "restarted":  # with its pool: it knows the window and its slot 0
        daemon.kill()
        assert train_and_snapshot(2) == 0  # no daemon
        daemon.start()
        wait_until_answering(client)
    else:
        daemon.remove()
        daemon.start()
        wait_until_answering(client)
        assert train_and_snapshot(2) == 0  # refused: the new daemon has no window open
    for step in (3, 4):
        assert train_and_snapshot(step) == 0
    assert [step for step, _ in client.skipped_steps] == [2, 3, 4], client.skipped_steps
    assert all("window from step 1" in reason for _, reason in client.skipped_steps[1:]), \
        client.skipped_steps
    for step in range(5, 9):
        assert train_and_snapshot(step) > 0
    client.wait_committed(8)
    assert client.windows()["committed"]["first_step"] == 5
