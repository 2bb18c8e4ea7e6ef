"""Never stop training: a failure of the snapshot system (the daemon killed, restarted or replaced)
never raises from a per-step call; the step is skipped, saying why, and snapshots catch up once the
daemon is back. Misuse still raises (test_bad_use.py)."""

import os
from pathlib import Path

import torch
import torch.distributed

import moesnap
from conftest import Daemon
from moesnap.pipeline import StageLink
from test_sparse import wait_until_answering


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
