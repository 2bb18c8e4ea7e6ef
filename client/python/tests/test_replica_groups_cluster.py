"""Data-parallel replicas on a 3-node cluster (k=2, m=1), the issue's test: four ranks of the example
trainer on gloo, ranks 0 and 1 on node 0 and ranks 2 and 3 on node 1, node 2 holding only parity.
Each rank copies 1/4 of the replicated state per step (from the daemons' counters). A rank SIGKILLed
and the job restarted: every rank restores bit-identically, its node's shards from its daemon and
the other node's fetched from that node. Node 1 lost: ranks on node 0 restore the step with ranks 2
and 3's shards decoded from parity. Node 1 replaced (rebuilt from its group) and the job restarted
with three ranks: restored from the four shards, then thirds. Every digest restored is the one the
uninterrupted run printed for that step; `moesnapctl inspect` names the node of each member's
shard."""

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from conftest import ChildProcess, Cluster
from test_replica_groups import ALIGNMENT, TRAINER, digests, finished, killed

# Node 2 runs no trainers: it takes part in every step with its parity alone.
PARITY_ONLY = {2: "[capture]\nparity_only = true\n"}


def launch(cluster: Cluster, nodes: List[int], steps: int, directory: Path) -> List[ChildProcess]:
    """The job: rank r on node nodes[r], on one gloo rendezvous (a new file for each job)."""
    rendezvous = Path(tempfile.mkdtemp(prefix="rendezvous-", dir=directory)) / "store"
    ranks = []
    for rank, node in enumerate(nodes):
        environment = dict(os.environ, MOESNAP_SOCKET=cluster.daemons[node].agent_socket,
                           RANK=str(rank), WORLD_SIZE=str(len(nodes)))
        ranks.append(ChildProcess([sys.executable, str(TRAINER), "--steps", str(steps),
                                   "--rendezvous", str(rendezvous)], env=environment))
    return ranks


def captures(cluster: Cluster, nodes: List[int]) -> Dict[int, dict]:
    """Each rank's last capture, as the daemon of its node counts it."""
    found: Dict[int, dict] = {}
    for node in nodes:
        status = json.loads(cluster.ctl(node, "status", "--json"))
        for capture in status.get("rank_captures", []):
            found[capture.get("rank", 0)] = capture
    return found


def assert_shares(cluster: Cluster, nodes: List[int], step: int) -> None:
    """Each of the job's ranks copied 1/world of the state at its last step, within the alignment
    at both ends of its shard, and the shards add up to one copy."""
    world = len(nodes)
    found = {rank: capture for rank, capture in captures(cluster, sorted(set(nodes))).items()
             if rank < world}
    assert sorted(found) == list(range(world)), found
    for capture in found.values():
        assert capture["step"] == step, found
        assert abs(capture["bytes"] - capture["state_bytes"] / world) <= 2 * ALIGNMENT, found
    assert sum(capture["bytes"] for capture in found.values()) == found[0]["state_bytes"], found


def restored_step(outputs: List[List[str]], printed: Dict[int, str], ranks: int) -> int:
    """The one step every rank restored, each with the digest printed for it before."""
    restored = digests(outputs, "restored")
    assert len(restored) == 1, outputs
    [(step, digest)] = restored.items()
    assert digest == printed[step], (step, printed)
    assert sum(1 for lines in outputs for line in lines
               if line == f"restored {step} digest {digest}") == ranks, outputs
    return step


def test_replicas_on_two_nodes_restore_across_nodes_and_from_parity(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, 3, data_units=2, parity_units=1, node_config=PARITY_ONLY)
    try:
        # Rank 2 is SIGKILLed past step 6; the others fail on their next collective.
        before = digests(killed(launch(cluster, [0, 0, 1, 1], 40, tmp_path), 2,
                                r"step ([6-9]|\d\d+) digest .*"))

        # Restarted: every rank restores the committed step from both nodes' shards.
        second = finished(launch(cluster, [0, 0, 1, 1], 20, tmp_path))
        step = restored_step(second, before, 4)
        assert 1 <= step < 20
        after = digests(second)
        assert_shares(cluster, [0, 0, 1, 1], 20)
        # Inspect says which node holds each member's shard, cluster-wide.
        inspected = cluster.ctl(0, "inspect", "20")
        assert "0: node 0, 1: node 0, 2: node 1, 3: node 1" in inspected, inspected

        # Node 1 lost: ranks 0 and 1 alone on node 0 restore step 20 (no training after it), the
        # shards of ranks 2 and 3 decoded from node 0's data and node 2's parity.
        cluster.lose(1)
        cluster.wait_until_live(2)
        assert restored_step(finished(launch(cluster, [0, 0], 20, tmp_path)), after, 2) == 20

        # Node 1 replaced: it rebuilds ranks 2 and 3's shards from its group. The job restarts
        # with three ranks, restoring from the four shards of step 20, then copies thirds.
        cluster.replace(1)
        cluster.wait_until_live(3)
        third = finished(launch(cluster, [0, 0, 1], 24, tmp_path))
        assert restored_step(third, after, 3) == 20
        assert_shares(cluster, [0, 0, 1], 24)
    finally:
        cluster.remove()
