"""The trainer-state test on a 3-node cluster (k=2, m=1), one rank per node: the whole job is
SIGKILLed at random points and restarted, each rank restoring its committed step (even where its
node had captured later steps: the restore starts a new timeline); and a job whose commits lag behind its steps, in pools
too small to hold its steps in flight, runs 200 steps without a trainer error. Every loss and lr,
and every rank's final state, are bit-identical to an uninterrupted run."""

import json
import os
import random
import signal
import tempfile
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from conftest import Cluster
from test_trainer_state import (assert_same, assert_same_steps, finish, reference_run, start,
                                steps_of)

NODES = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, "adamw")


def start_job(cluster: Cluster, steps: int, directory: Path, save: bool = False) -> List:
    """The job's ranks, one per node; they end together (at a barrier in ``directory``), as ranks
    in lockstep do. With ``save``, each writes its final state to ``directory/rank<r>.pt``."""
    barrier = Path(tempfile.mkdtemp(prefix="barrier-", dir=directory))
    return [start(cluster.daemons[rank].agent_socket, steps,
                  directory / f"rank{rank}.pt" if save else None, rank=rank,
                  extra=["--barrier", str(barrier), str(NODES)]) for rank in range(NODES)]


def test_whole_job_killed_at_random_points_restarts_from_the_committed_step(tmp_path, reference):
    expected, expected_state = reference
    seed = int(os.environ.get("MOESNAP_TEST_SEED", random.randrange(1 << 30)))
    print(f"kill points drawn with seed {seed} (set MOESNAP_TEST_SEED to draw them again)")
    draw = random.Random(seed)
    cluster = Cluster(tmp_path, NODES, data_units=2, parity_units=1)
    try:
        progress = 0
        for _ in range(3):
            job = start_job(cluster, 30, tmp_path)
            # The job dies as a whole (a node's power, a scheduler's preemption) once rank 0 has
            # printed this step: the other ranks may be ahead of it or behind.
            kill_at = draw.randint(progress + 2, progress + 8)
            seen: List[str] = []
            for line in job[0].stdout:
                seen.append(line.rstrip("\n"))
                if seen[-1] == f"snapshot {kill_at}":
                    break
            for trainer in job:
                trainer.send_signal(signal.SIGKILL)
                trainer.wait()
            outputs = [seen] + [trainer.stdout.read().splitlines() for trainer in job[1:]]
            for lines in outputs:
                assert_same_steps(lines, expected)
            progress = kill_at
        job = start_job(cluster, 30, tmp_path, save=True)
        outputs = [finish(trainer) for trainer in job]
        # A rank's restore waits for the decision of a step its node voted to commit, so ranks
        # restarting together restore the same step, unless a restarted rank captures anew a step
        # that the other nodes had prepared from the dead job's captures: the step then commits
        # after the others restored the one before. Ranks in lockstep cannot (that step needs
        # their collectives); these trainers are independent, so each rank is checked against
        # the step it restored.
        for rank, lines in enumerate(outputs):
            assert any(line.startswith("restored ") for line in lines), (rank, lines)
            assert_same_steps(lines, expected)
            assert_same(torch.load(tmp_path / f"rank{rank}.pt"), expected_state, f"rank {rank}")
    finally:
        cluster.remove()


def test_commits_lagging_behind_training_skip_steps_and_never_stop_a_trainer(tmp_path):
    steps = 200
    # Pools of 24 MiB: the committed state, its parity and a few steps in flight per rank; the
    # ranks' steps outrun the cluster's commits, so captures wait, the pool fills, and snapshots
    # are skipped.
    cluster = Cluster(tmp_path, NODES, data_units=2, parity_units=1, pool_bytes="24MiB")
    try:
        reference_losses = reference_for(tmp_path, steps)
        job = start_job(cluster, steps, tmp_path)
        outputs = [finish(trainer) for trainer in job]
        for lines in outputs:
            assert_same_steps(lines, reference_losses)
            assert sorted(steps_of(lines)) == list(range(1, steps + 1))
            assert "done" in lines  # commit(200) made the end state committed
        for node in range(NODES):
            status = json.loads(cluster.ctl(node, "--json", "status"))
            assert status["pool_used_bytes"] + status["pool_in_flight_bytes"] <= status["pool_bytes"]
            print(f"node {node}: {status.get('snapshots_skipped', 0)} snapshots skipped, last: "
                  f"{status.get('last_skip', '')}")
        # A fresh job restores step 200 exactly where the uninterrupted run ended.
        job = start_job(cluster, steps, tmp_path, save=True)
        for rank, trainer in enumerate(job):
            lines = finish(trainer)
            assert f"restored {steps}" in lines
            reference_state = torch.load(tmp_path / "reference.pt")
            assert_same(torch.load(tmp_path / f"rank{rank}.pt"), reference_state, f"rank {rank}")
    finally:
        cluster.remove()


def reference_for(tmp_path: Path, steps: int) -> Dict[int, str]:
    lines = finish(start(None, steps, tmp_path / "reference.pt"))
    return {step: values[0] for step, values in steps_of(lines).items()}
