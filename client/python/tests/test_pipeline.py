"""Localized recovery of a pipeline stage: three stages of examples/pipeline_train.py as separate
processes (torch.distributed with gloo on loopback), each on its own node of a three-daemon cluster
(k = 2, m = 1), sparse snapshots and upstream logs on. Each stage keeps a sampler on Python's
``random``, a warmup LR schedule, dropout and a buffer changed in forward. One stage is SIGKILLed at a
random step; its replacement recovers from its window and the neighbours' logs while the other
stages wait. Every loss and lr printed, and each stage's whole final state (parameters, buffers,
optimizer state and param_groups, scheduler, sampler, RNG), must be bit-identical to an
uninterrupted run, and no surviving stage may complete a step twice."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from conftest import ChildProcess, Cluster
from test_trainer_state import assert_same

PIPELINE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_train.py"
STAGES = 3
STEPS = 12
WINDOW = 3


class Stage(ChildProcess):
    """A stage process whose output lines are collected as they come."""

    def __init__(self, stage: int, rendezvous: Path, socket_path: Optional[str],
                 out: Optional[Path], generation: int = 0, replacement: bool = False,
                 crash_at: Optional[int] = None) -> None:
        command = [sys.executable, str(PIPELINE), "--stage", str(stage), "--stages", str(STAGES),
                   "--steps", str(STEPS), "--rendezvous", str(rendezvous), "--window", str(WINDOW),
                   "--generation", str(generation)]
        if socket_path:
            command += ["--socket", socket_path]
        if out:
            command += ["--out", str(out)]
        if replacement:
            command.append("--replacement")
        if crash_at:
            command += ["--crash-mid-backward", str(crash_at)]
        super().__init__(command)

    def steps_completed(self) -> List[int]:
        return [int(line.split()[1]) for line in self.lines if re.fullmatch(r"step \d+.*", line)]


def finish_together(stages: List[Stage], timeout: float) -> List[Optional[int]]:
    """Each stage's exit code, None for one still running at the deadline (then killed), so that
    a hang reports every stage's lines."""
    deadline = time.monotonic() + timeout
    codes: List[Optional[int]] = []
    for stage in stages:
        try:
            codes.append(stage.process.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for stage, code in zip(stages, codes):
        if code is None:
            stage.process.kill()
            stage.process.wait()
    return codes


def printed_steps(lines: List[str]) -> Dict[int, List[str]]:
    """What a stage printed for each step it completed (its lr, and on the last stage its loss),
    every time it completed it."""
    printed: Dict[int, List[str]] = {}
    for line in lines:
        match = re.fullmatch(r"step (\d+) (.*)", line)
        if match:
            printed.setdefault(int(match.group(1)), []).append(match.group(2))
    return printed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run without moesnap: what each stage printed per step, and its final
    state."""
    directory = tmp_path_factory.mktemp("pipeline-reference")
    stages = [Stage(s, directory, None, directory / f"stage{s}.pt") for s in range(STAGES)]
    printed = []
    for stage in stages:
        steps = printed_steps(stage.finish())
        assert sorted(steps) == list(range(1, STEPS + 1))
        printed.append({step: values[0] for step, values in steps.items()})
    assert all(line.startswith("loss ") for line in printed[-1].values())
    return printed, [torch.load(directory / f"stage{s}.pt") for s in range(STAGES)]


def run_with_a_lost_stage(reference, tmp_path, victim: int, lose_node: bool,
                          log_bytes: Optional[Dict[int, str]] = None, mid_backward: bool = False):
    """Trains the pipeline with stage ``victim`` SIGKILLed at a random step: from outside after it
    printed the step, or (``mid_backward``) by itself in the next step's backward pass, after it
    received the last gradient and before passing it upstream."""
    seed = int(os.environ.get("MOESNAP_TEST_SEED", time.time_ns() % 1000003))
    # Not in the last window: a node lost while the window's first step is encoded aborts that
    # window, and a run ending in it has no complete window after it to commit.
    kill_after = random.Random(seed).randint(WINDOW + 1, STEPS - WINDOW)
    context = (f"seed {seed}: stage {victim} killed "
               + (f"in the backward pass of step {kill_after + 1}" if mid_backward
                  else f"after step {kill_after}"))
    expected_printed, expected_states = reference
    cluster = Cluster(tmp_path, STAGES, data_units=2, parity_units=1,
                      node_config={node: f'[upstream_log]\nmax_bytes = "{size}"\n'
                                   for node, size in (log_bytes or {}).items()})
    try:
        rendezvous = tmp_path / "rendezvous"
        rendezvous.mkdir()
        outs = [tmp_path / f"stage{s}.pt" for s in range(STAGES)]
        stages = [Stage(s, rendezvous, cluster.daemons[s].agent_socket, outs[s],
                        crash_at=kill_after + 1 if mid_backward and s == victim else None)
                  for s in range(STAGES)]
        if not mid_backward:
            stages[victim].wait_for(rf"step {kill_after} .*")
            stages[victim].process.send_signal(signal.SIGKILL)
        assert stages[victim].process.wait(120) == -signal.SIGKILL, context
        if lose_node:  # the node goes with its memory; a replacement daemon rebuilds from parity
            cluster.lose(victim)
            cluster.replace(victim)
            cluster.wait_until_live(STAGES)
        replacement = Stage(victim, rendezvous, cluster.daemons[victim].agent_socket,
                            outs[victim], generation=1, replacement=True)
        survivors = [stage for s, stage in enumerate(stages) if s != victim]
        codes = finish_together(survivors + [replacement], timeout=240)
        assert codes == [0] * STAGES, "\n\n".join(
            f"exit {code}:\n" + "\n".join(stage.lines)
            for code, stage in zip(codes, survivors + [replacement]))
        lines = [stage.finish() for stage in survivors] + [replacement.finish()]
        windows = cluster.ctl(victim, "inspect")
    finally:
        cluster.remove()

    for s in range(STAGES):
        stage_lines = stages[s].lines + (replacement.lines if s == victim else [])
        printed = printed_steps(stage_lines)
        assert set(printed) == set(range(1, STEPS + 1)), (context, s, stage_lines)
        for step, values in printed.items():
            assert all(value == expected_printed[s][step] for value in values), \
                (context, f"stage {s} step {step}", values, expected_printed[s][step])
        assert_same(torch.load(outs[s]), expected_states[s], f"stage {s}")
    rejoined = [line for block in lines for line in block if line.startswith("rejoined ")]
    assert len(rejoined) == STAGES and len(set(rejoined)) == 1, (context, rejoined)
    assert "committed" in windows and "expert0" in windows, windows  # moesnapctl inspect
    return context, rejoined[0], survivors, replacement


def report(context: str, rejoined: str, replacement: Stage) -> None:
    """One line for the main job (deploy/demo.sh) and the test log."""
    first_replayed = replacement.steps_completed()[0]
    target, how = rejoined.split()[1:]
    source = ("from its last window and the neighbours' upstream logs" if how == "logs"
              else "with every stage falling back to its last window")
    print(f"pipeline: {context}; its replacement replayed steps {first_replayed}-{target} "
          f"{source}, all stages rejoined at step {target} and trained to {STEPS}; every loss and "
          f"lr and each stage's whole state bit-identical to an uninterrupted run",
          flush=True)


@pytest.mark.parametrize("victim", [1])
def test_a_killed_stage_replays_from_its_neighbours_logs(reference, tmp_path, victim):
    context, rejoined, survivors, replacement = run_with_a_lost_stage(reference, tmp_path, victim,
                                                                      lose_node=False)
    assert rejoined.endswith(" logs"), (context, rejoined)
    for survivor in survivors:  # they waited: no step computed twice
        completed = survivor.steps_completed()
        assert completed == list(range(1, STEPS + 1)), (context, survivor.lines)
    report(context + " (trainer SIGKILLed)", rejoined, replacement)


def test_a_stage_lost_mid_backward_leaves_its_upstream_neighbour_a_step_behind(reference,
                                                                             tmp_path):
    # Stage 2 finished the step, stage 0 never got its last gradient: the replacement replays to
    # stage 2's step, then stage 0 finishes that step from the replacement's log.
    context, rejoined, survivors, replacement = run_with_a_lost_stage(reference, tmp_path, 1,
                                                                      lose_node=False,
                                                                      mid_backward=True)
    assert rejoined.endswith(" logs"), (context, rejoined)
    target = int(rejoined.split()[1])
    assert "lost a neighbour after step " + str(target - 1) in " ".join(survivors[0].lines), \
        (context, survivors[0].lines)
    for survivor in survivors:
        assert survivor.steps_completed() == list(range(1, STEPS + 1)), (context, survivor.lines)
    report(context, rejoined, replacement)


def test_a_lost_node_is_rebuilt_and_its_stage_replays_from_the_logs(reference, tmp_path):
    context, rejoined, survivors, replacement = run_with_a_lost_stage(reference, tmp_path, 2,
                                                                      lose_node=True)
    assert rejoined.endswith(" logs"), (context, rejoined)
    for survivor in survivors:
        assert survivor.steps_completed() == list(range(1, STEPS + 1)), (context, survivor.lines)
    report(context + " (its node lost with its memory and rebuilt from parity)", rejoined,
           replacement)


def test_a_missing_log_falls_back_to_the_last_window_of_every_stage(reference, tmp_path):
    # Stage 0's daemon keeps less than a step of activations: its appends are refused, and stage
    # 1's replacement cannot replay from the log.
    context, rejoined, survivors, replacement = run_with_a_lost_stage(
        reference, tmp_path, 1, lose_node=False, log_bytes={0: "8KiB"})
    assert rejoined.endswith(" fallback"), (context, rejoined)
    assert any(line.startswith("log refusals ") and line != "log refusals 0"
               for line in survivors[0].lines), survivors[0].lines
    report(context + " (stage 0's upstream log full)", rejoined, replacement)
