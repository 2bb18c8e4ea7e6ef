"""Every part of a trainer's state comes back exactly: a trainer with AdamW (or SGD with momentum),
an LR warmup, gradient clipping, buffers changed in forward, Python/NumPy/torch randomness and a
sampler is SIGKILLed at random points (during registration and restore too), or has its daemon
SIGKILLed and restarted under it; every loss and lr it prints, and its final parameters, buffers,
optimizer state and param_groups, scheduler and sampler, are bit-identical to an uninterrupted run."""

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from conftest import Daemon

TRAINER = Path(__file__).resolve().parent / "state_trainer.py"
STEPS = 30


def start(socket_path: Optional[str], steps: int = STEPS, out: Optional[Path] = None,
          extra: Optional[List[str]] = None, rank: int = 3) -> subprocess.Popen:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("MOESNAP_SOCKET", "RANK", "LOCAL_RANK")}
    if socket_path:
        environment.update(MOESNAP_SOCKET=socket_path, RANK=str(rank))
    command = [sys.executable, str(TRAINER), "--steps", str(steps)] + (extra or [])
    if out:
        command += ["--out", str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)


def finish(trainer: subprocess.Popen) -> List[str]:
    lines = trainer.stdout.read().splitlines()
    assert trainer.wait() == 0, lines
    return lines


def steps_of(lines: List[str]) -> Dict[int, List[str]]:
    """Step -> every "loss HEX lr HEX" printed for it (a step replayed after a restore prints
    again)."""
    printed: Dict[int, List[str]] = {}
    for line in lines:
        match = re.fullmatch(r"step (\d+) (loss \S+ lr \S+)", line)
        if match:
            printed.setdefault(int(match.group(1)), []).append(match.group(2))
    return printed


def assert_same_steps(lines: List[str], expected: Dict[int, str]) -> None:
    for step, values in steps_of(lines).items():
        assert all(value == expected[step] for value in values), (step, values, expected[step])


def assert_same(actual, expected, where: str = "state") -> None:
    """Bit-identical nested state: tensors by dtype, shape and bytes, everything else by ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), (where, sorted(actual), sorted(expected))
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, (where, actual, expected)


def reference_run(tmp_path_factory, optimizer: str) -> Tuple[Dict[int, str], dict]:
    out = tmp_path_factory.mktemp(f"reference-{optimizer}") / "state.pt"
    lines = finish(start(None, out=out, extra=["--optimizer", optimizer]))
    expected = {step: values[0] for step, values in steps_of(lines).items()}
    assert sorted(expected) == list(range(1, STEPS + 1))
    return expected, torch.load(out)


@pytest.fixture(scope="module")
def adamw_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, "adamw")


@pytest.fixture(scope="module")
def sgd_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, "sgd")


def run_until(trainer: subprocess.Popen, pattern: str) -> Tuple[List[str], Optional[str]]:
    """Reads the trainer's lines until one matches `pattern`, then SIGKILLs it. Returns every line
    it printed, those after the match too (it trains on until the signal lands, and may snapshot
    further), and the line matched: None when it ended first."""
    seen = []
    for line in trainer.stdout:
        seen.append(line.rstrip("\n"))
        if re.fullmatch(pattern, seen[-1]):
            matched = seen[-1]
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            seen += trainer.stdout.read().splitlines()
            return seen, matched
    trainer.wait()
    return seen, None


def killed_at_random_points(daemon: Daemon, reference, options: List[str], kills: int,
                            seed: int, out: Path) -> List[str]:
    """Runs the trainer to the end through `kills` SIGKILLs at points drawn with `seed`, checking
    every printed step against the reference; returns where each kill landed."""
    expected, expected_state = reference
    draw = random.Random(seed)
    landed = []
    progress = 0  # the last step any run printed
    for _ in range(kills):
        kinds = ["registering", "registered", "restoring"]
        if progress < STEPS:  # steps after any a trainer printed are still ahead of it
            kinds += ["step", "snapshot"]
        kind = draw.choice(kinds)
        step = draw.randint(progress + 1, min(progress + 3, STEPS)) if progress < STEPS else STEPS
        pattern = {"registering": "registering", "registered": "registered",
                   # before the first commit there is no restore: kill at the first step instead
                   "restoring": r"restoring|step \d+ .*",
                   "step": rf"step {step} .*", "snapshot": f"snapshot {step}"}[kind]
        lines, killed_at = run_until(start(daemon.agent_socket, extra=options), pattern)
        assert killed_at, f"the trainer ended before '{pattern}' (seed {seed}): {lines}"
        assert_same_steps(lines, expected)
        # A trainer prints a step before it snapshots it, so no step it could have committed is
        # after the last one it printed.
        progress = max([progress] + list(steps_of(lines)))
        landed.append(killed_at)
    lines = finish(start(daemon.agent_socket, out=out, extra=options))
    assert_same_steps(lines, expected)
    assert "done" in lines
    assert_same(torch.load(out), expected_state)
    return landed


def test_adamw_trainer_killed_at_ten_random_points_resumes_bit_identically(
        daemon: Daemon, adamw_reference, tmp_path):
    seed = int(os.environ.get("MOESNAP_TEST_SEED", random.randrange(1 << 30)))
    print(f"kill points drawn with seed {seed} (set MOESNAP_TEST_SEED to draw them again)")
    landed = killed_at_random_points(daemon, adamw_reference, [], 10, seed, tmp_path / "state.pt")
    print("killed at:", landed)


def test_sgd_with_momentum_trainer_killed_resumes_bit_identically(daemon: Daemon, sgd_reference,
                                                                   tmp_path):
    # Momentum buffers appear at the first step: the state registers then, and a fresh process
    # creates it from the snapshot to restore into.
    killed_at_random_points(daemon, sgd_reference, ["--optimizer", "sgd"], 3, 20261123,
                            tmp_path / "state.pt")


@pytest.mark.parametrize("window,kills", [(2, 4), (3, 10), (5, 4)])
def test_sparse_trainer_killed_at_random_points_recovers_bit_identically(
        daemon: Daemon, adamw_reference, tmp_path, window, kills):
    # The replay of the last complete window starts from the sampler, scheduler, optimizer
    # hyper-parameters, random generators and buffers as they were at its first step.
    seed = int(os.environ.get("MOESNAP_TEST_SEED", random.randrange(1 << 30)))
    print(f"kill points drawn with seed {seed} (set MOESNAP_TEST_SEED to draw them again)")
    killed_at_random_points(daemon, adamw_reference, ["--sparse-window", str(window)], kills,
                            seed, tmp_path / "state.pt")


def test_daemon_killed_and_restarted_under_a_running_trainer_is_ridden_through(
        daemon: Daemon, adamw_reference, tmp_path):
    expected, expected_state = adamw_reference
    trainer = start(daemon.agent_socket)
    seen = []
    for line in trainer.stdout:
        seen.append(line.rstrip("\n"))
        if seen[-1] == "snapshot 5":
            break
    trainer.send_signal(signal.SIGSTOP)  # the daemon dies between two of the trainer's calls
    daemon.kill()
    trainer.send_signal(signal.SIGCONT)
    for line in trainer.stdout:  # these steps run against no daemon at all
        seen.append(line.rstrip("\n"))
        if seen[-1] == "snapshot 8":
            break
    daemon.start()  # the same pool: every committed step is still there
    seen += finish(trainer)
    assert_same_steps(seen, expected)
    skipped = {int(line.split()[1]) for line in seen if line.startswith("skipped ")}
    assert {6, 7, 8} <= skipped, seen
    assert "done" in seen

    # The restarted daemon holds the last step, committed at the end: a fresh process restores it
    # exactly as the uninterrupted run ended.
    out = tmp_path / "state.pt"
    lines = finish(start(daemon.agent_socket, out=out))
    assert f"restored {STEPS}" in lines
    assert_same(torch.load(out), expected_state)
