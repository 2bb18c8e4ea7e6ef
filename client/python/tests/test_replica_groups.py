"""Data-parallel replicas snapshot one shard each (REFT): the example data-parallel trainer on gloo,
its model and Adam state declared one replica group of the job, on a real moesnapd. Each rank's
daemon copies 1/N of the replicated state per step (from the daemon's counters); a rank SIGKILLed
and the job restarted restores every rank bit-identically from the group's shards; the job
restarted with one rank fewer restores from the old shards, and then snapshots thirds; a daemon
that lost its pool restores the group from the durable tier."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Collection, Dict, List

from conftest import BIN_DIR, ChildProcess, Daemon

TRAINER = Path(__file__).resolve().parents[1] / "examples" / "dp_train.py"
ALIGNMENT = 4096  # shard boundaries fall on 4 KiB of the concatenated regions


def launch(daemon: Daemon, world: int, steps: int) -> List[ChildProcess]:
    """The job: `world` ranks on one gloo rendezvous (a new file: no port to collide on), each a
    trainer of the daemon."""
    rendezvous = Path(tempfile.mkdtemp(prefix="rendezvous-", dir=daemon.directory)) / "store"
    ranks = []
    for rank in range(world):
        environment = dict(os.environ, MOESNAP_SOCKET=daemon.agent_socket, RANK=str(rank),
                           WORLD_SIZE=str(world))
        ranks.append(ChildProcess([sys.executable, str(TRAINER), "--steps", str(steps),
                                   "--rendezvous", str(rendezvous)], env=environment))
    return ranks


def finished(ranks: List[ChildProcess]) -> List[List[str]]:
    """Every rank's lines once all have exited; fails with the output of each rank that failed
    (the first to fail is often not the cause: its peers' lines say why)."""
    codes = [child.process.wait(timeout=180) for child in ranks]
    for child in ranks:
        child._reader.join(10)
    failed = [f"rank {rank} exited with {code}:\n" + "\n".join(child.lines)
              for rank, (child, code) in enumerate(zip(ranks, codes)) if code != 0]
    assert not failed, "\n\n".join(failed)
    return [child.lines for child in ranks]


def killed(ranks: List[ChildProcess], victim: int, once: str) -> List[List[str]]:
    """SIGKILLs rank `victim` once it printed a line matching `once`; the others fail on their next
    collective, as a job does when one of its processes dies. Every rank's lines."""
    ranks[victim].wait_for(once)
    ranks[victim].process.send_signal(signal.SIGKILL)
    for child in ranks:
        child.process.wait(timeout=180)
        child._reader.join()
    return [child.lines for child in ranks]


def digests(outputs: List[List[str]], what: str = "step") -> Dict[int, str]:
    """Step -> the digest every rank printed for it (they must agree: the state is replicated)."""
    found: Dict[int, str] = {}
    for lines in outputs:
        for line in lines:
            match = re.fullmatch(rf"{what} (\d+) digest ([0-9a-f]+)", line)
            if match:
                step, digest = int(match.group(1)), match.group(2)
                assert found.setdefault(step, digest) == digest, (step, outputs)
    return found


def captures(daemon: Daemon) -> Dict[int, dict]:
    answer = subprocess.run([str(BIN_DIR / "moesnapctl"), "--socket", daemon.admin_socket,
                             "status", "--json"], capture_output=True, text=True, check=True)
    return {capture.get("rank", 0): capture
            for capture in json.loads(answer.stdout).get("rank_captures", [])}


def assert_shares(daemon: Daemon, world: int, steps: Collection[int]) -> None:
    """Each rank's last captured step, one of `steps`, copied 1/world of the state it registered,
    within the alignment at both ends of its shard."""
    found = {rank: capture for rank, capture in captures(daemon).items() if rank < world}
    assert sorted(found) == list(range(world)), found
    total = 0
    for capture in found.values():
        assert capture["step"] in steps, found
        share = capture["state_bytes"] / world
        assert abs(capture["bytes"] - share) <= 2 * ALIGNMENT, (capture, share)
        total += capture["bytes"]
    assert total == found[0]["state_bytes"], found  # one copy between them


def test_replicas_copy_one_shard_each_and_restore_bit_identically(daemon: Daemon) -> None:
    # A job of four ranks; rank 2 is SIGKILLed once past step 4.
    before = digests(killed(launch(daemon, 4, steps=30), 2,
                            r"step [4-9] digest .*|step \d\d+ digest .*"))
    # A rank whose process died while its last capture still copied gave that capture up (its
    # client closed): its last capture is then the step before.
    newest = max(capture["step"] for capture in captures(daemon).values())
    assert_shares(daemon, 4, {newest - 1, newest})

    # The job restarted: every rank restores the last committed step, whose shards the four
    # ranks captured, bit-identically; then trains on. Every rank waited for step 3's capture
    # before step 4's optimizer step, so step 3 at least committed; step 4 did unless a rank's
    # process died while its capture copied.
    second = finished(launch(daemon, 4, steps=12))
    restored = digests(second, "restored")
    assert len(restored) == 1, second
    [(step, digest)] = restored.items()
    assert 3 <= step < 30 and digest == before[step], (step, before)
    for lines in second:
        assert f"restored {step} digest {digest}" in lines, lines
    after = digests(second)
    assert_shares(daemon, 4, {12})

    # Restarted with three ranks: restored from the four old shards, then thirds.
    third = finished(launch(daemon, 3, steps=14))
    assert digests(third, "restored") == {12: after[12]}, third
    assert_shares(daemon, 3, {14})


def test_replicas_resume_from_the_durable_tier_after_the_pool_is_lost(tmp_path: Path) -> None:
    # Every rank's restore needs every member's shard: each rank loaded alone from disk would
    # find the others' shards missing until they too had loaded theirs.
    run_directory = tmp_path / "daemon"
    run_directory.mkdir()
    daemon = Daemon(run_directory,
                    extra_config=f'[durable]\ndirectory = "{tmp_path / "durable"}"\nevery_steps = 3\n')
    daemon.start()
    try:
        printed = digests(finished(launch(daemon, 4, steps=7)))
        deadline = time.monotonic() + 60
        while True:  # steps 1, 3 and 6 were due; wait until each was handled and no drain runs
            answer = subprocess.run([str(BIN_DIR / "moesnapctl"), "--socket", daemon.admin_socket,
                                     "status", "--json"], capture_output=True, text=True, check=True)
            status = json.loads(answer.stdout)["durable"]
            if (status.get("drains_completed", 0) + status.get("drains_skipped", 0) >= 3
                    and "draining_step" not in status):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        durable_step = status["latest_step"]
        daemon.remove()  # SIGKILL and the pool deleted: a power loss
        daemon.start()
        restarted = finished(launch(daemon, 4, steps=9))
        assert digests(restarted, "restored") == {durable_step: printed[durable_step]}, restarted
    finally:
        daemon.remove()
