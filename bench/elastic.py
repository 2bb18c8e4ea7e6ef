#!/usr/bin/python3
"""The elastic benchmark: a node lost by an expert-parallel MoE job, survived without restarting
the survivors (moesnap.elastic), against a restart of the whole job from the last committed
snapshot, both measured in this run.

The job is client/python/examples/elastic_moe_train.py (run, not copied) on four nodes on
loopback: one trainer process and one moesnapd per node, the daemons one group of k = 3, m = 1,
two MoE layers of 8 experts replicated by the placement planner (at least 2 replicas each), so one
lost node leaves every expert a replica. The cluster is started as the Python tests start theirs
(conftest.Cluster).

Each round: the job trains and snapshots every step; after step KILL_AFTER, node 1's trainer and
daemon are SIGKILLed. The survivors notice the failed collective, agree on the members once node
1's keep-alive is silent for LOST_AFTER, re-plan, wait for the snapshot cluster's open steps,
place and register the new replicas, restore the last committed step from their daemons and the
moved experts from the surviving replicas' snapshots, and complete the next step. Every phase ends
when the last survivor finishes it (the next collective waits for it). Then the survivors finish,
and the restart: a replacement daemon for node 1 rebuilds its snapshot from the group, four new
trainer processes start, restore the last committed step, and complete the next step. The restart
is charged the same detection as the elastic path (the job must learn of the loss either way).

Prints one line per figure, "name|value|unit|baseline|baseline_value", and lines "note|text", for
moesnap-bench.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

SOURCE = Path(__file__).resolve().parents[1]
EXAMPLE = SOURCE / "client" / "python" / "examples" / "elastic_moe_train.py"
sys.path.insert(0, str(SOURCE / "client" / "python" / "tests"))
sys.path.insert(0, str(EXAMPLE.parent))
import elastic_moe_train  # noqa: E402 (the example's expert, for its size)

NODES, LOST, KILL_AFTER, LOST_AFTER, ROUNDS = 4, 1, 4, 2.0, 3
# The phases of Recovery.times, in order, with their names in the figures.
PHASES = [("failure", "failed collective noticed"),
          ("membership", f"members agreed (keep-alive silent {LOST_AFTER:g} s), group formed"),
          ("plan", "re-planning"),
          ("settle", "snapshot cluster settled, committed step agreed"),
          ("placement", "new replicas and replica groups placed"),
          ("registration", "new moesnap session, state registered"),
          ("restore", "restore from the own daemon"),
          ("transfer", "expert transfer (restore_from)")]


class Trainer:
    """One node's trainer process; every output line is kept with the time it arrived."""

    def __init__(self, node: int, directory: Path, socket_path: str, steps: int) -> None:
        command = [sys.executable, str(EXAMPLE), "--node", str(node), "--nodes", str(NODES),
                   "--steps", str(steps), "--rendezvous", str(directory / "rendezvous"),
                   "--socket", socket_path, "--lost-after", str(LOST_AFTER)]
        self.started = time.time()
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: List[Tuple[float, str]] = []
        self._condition = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._condition:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._condition.notify_all()
        with self._condition:
            self._condition.notify_all()

    def wait_for(self, pattern: str, after: float = 0.0,
                 timeout: float = 180) -> Tuple[float, re.Match]:
        """The first line matching ``pattern`` that arrived after the time ``after``: when it
        arrived, and the match."""
        deadline = time.monotonic() + timeout
        with self._condition:
            while True:
                for arrived, line in self.lines:
                    match = re.fullmatch(pattern, line) if arrived > after else None
                    if match:
                        return arrived, match
                if not self._reader.is_alive() or time.monotonic() > deadline:
                    text = "\n".join(line for _, line in self.lines)
                    raise RuntimeError(f"no line '{pattern}' from the trainer:\n{text}")
                self._condition.wait(0.5)

    def finish(self) -> None:
        if self.process.wait(180) != 0:
            text = "\n".join(line for _, line in self.lines)
            raise RuntimeError(f"trainer exited with {self.process.returncode}:\n{text}")


def elastic_round(cluster, directory: Path) -> Dict[str, float]:
    """The job loses node LOST; returns the survivors' phase ends, relative to the loss."""
    steps = KILL_AFTER + 2
    trainers = [Trainer(n, directory, cluster.daemons[n].agent_socket, steps)
                for n in range(NODES)]
    try:
        trainers[LOST].wait_for(rf"step {KILL_AFTER} loss \S+")
        lost = time.time()
        trainers[LOST].process.send_signal(signal.SIGKILL)
        cluster.lose(LOST)
        trainers[LOST].process.wait()
        survivors = [t for n, t in enumerate(trainers) if n != LOST]
        phases: Dict[str, float] = {}
        for trainer in survivors:
            recovered_at, recovered = trainer.wait_for(r"recovered at step (\d+) .*every expert "
                                                       r"kept a replica.*")
            committed = int(recovered[1])
            _, times = trainer.wait_for(r"times (.*)")
            for phase, end in json.loads(times[1]).items():
                phases[phase] = max(phases.get(phase, 0.0), end - lost)
            next_step = trainer.wait_for(rf"step {committed + 1} loss \S+", recovered_at)[0]
            phases["next step"] = max(phases.get("next step", 0.0), next_step - lost)
        for trainer in survivors:
            trainer.finish()
        phases["committed"] = committed
        return phases
    finally:
        for trainer in trainers:
            if trainer.process.poll() is None:
                trainer.process.kill()


def restart_round(cluster, directory: Path, committed: int) -> Dict[str, float]:
    """The whole job started again from the committed step, with a replacement daemon for the
    lost node; returns each stage's end, relative to the restart's beginning."""
    begun = time.time()
    cluster.replace(LOST)
    cluster.wait_until_live(NODES, asking=0)
    stages = {"replacement daemon rebuilt the lost node's snapshot": time.time() - begun}
    trainers = [Trainer(n, directory, cluster.daemons[n].agent_socket, committed + 1)
                for n in range(NODES)]
    try:
        ends = {"processes started, group formed, state registered": r"plan \S+ .*",
                "restore of the committed step": rf"resumed at step {committed}",
                "next step": rf"step {committed + 1} loss \S+"}
        for stage, pattern in ends.items():
            stages[stage] = max(trainer.wait_for(pattern)[0] for trainer in trainers) - begun
        for trainer in trainers:
            trainer.finish()
        return stages
    finally:
        for trainer in trainers:
            if trainer.process.poll() is None:
                trainer.process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", required=True, help="moesnapd and moesnapctl are here")
    arguments = parser.parse_args()
    os.environ["MOESNAP_BIN_DIR"] = arguments.bin_dir
    from conftest import Cluster  # noqa: E402 (reads MOESNAP_BIN_DIR)

    elastic: List[Dict[str, float]] = []
    restart: List[Dict[str, float]] = []
    for round_ in range(ROUNDS):
        with tempfile.TemporaryDirectory(prefix="moesnap-bench-elastic-") as name:
            directory = Path(name)
            cluster = Cluster(directory, NODES, data_units=3, parity_units=1,
                              commit_timeout_ms=4000)
            try:
                (directory / "elastic").mkdir()
                (directory / "restart").mkdir()
                elastic.append(elastic_round(cluster, directory / "elastic"))
                restart.append(restart_round(cluster, directory / "restart",
                                             int(elastic[-1]["committed"])))
            finally:
                cluster.remove()

    def median(rows: List[Dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    detection = median(elastic, "membership")
    elastic_total = median(elastic, "next step")
    # A restart cannot begin before the loss is known: charged the elastic path's detection.
    restart_total = detection + median(restart, "next step")
    print(f"node loss to next step, elastic (1 of {NODES} nodes lost)|{elastic_total:.3f}|s|"
          f"whole-job restart from the last committed snapshot|{restart_total:.3f}")
    print(f"node loss to next step, elastic, after detection|{elastic_total - detection:.3f}|s|"
          f"whole-job restart after detection|{restart_total - detection:.3f}")
    previous = 0.0
    for phase, label in PHASES + [("next step", "next training step")]:
        end = median(elastic, phase)
        print(f"elastic: {label}|{1e3 * (end - previous):.1f}|ms|elastic total|"
              f"{1e3 * elastic_total:.1f}")
        previous = end
    previous = 0.0
    for stage in restart[0]:
        end = median(restart, stage)
        print(f"restart: {stage}|{1e3 * (end - previous):.1f}|ms|restart total|"
              f"{1e3 * restart_total:.1f}")
        previous = end
    state_bytes = sum(4 * p.numel() for p in elastic_moe_train.Expert().parameters())  # fp32
    print(f"note|Medians of {ROUNDS} rounds, each phase ending when the last survivor finished "
          f"it. The job: client/python/examples/elastic_moe_train.py, 4 nodes on loopback (one "
          f"trainer process and one moesnapd each; daemons one group of k = 3, m = 1; gloo), 2 "
          f"MoE layers of 8 top-2 experts of {state_bytes} bytes of weights each, at least 2 "
          f"replicas per expert; node {LOST}'s trainer and daemon SIGKILLed after step "
          f"{KILL_AFTER}. Detection is the keep-alive's lost_after ({LOST_AFTER:g} s here, a "
          f"setting), charged to both. The restart is the favourable case: a spare daemon "
          f"already running for the lost node, no scheduler delay, and a small CPU model whose "
          f"process start is mostly importing torch (a GPU job adds CUDA and NCCL set-up).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
