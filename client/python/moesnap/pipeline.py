"""Localized recovery of a pipeline stage from upstream logs.

Every stage logs what it sends across its boundaries (activations downstream, gradients upstream)
in its node's moesnapd before sending it (``StageLink``). When a stage's trainer (or its whole node)
is lost, the other stages keep their state and wait: the replacement restores the stage's last
committed sparse window, replays the window and the steps after it with its inputs read from the
neighbours' logs instead of live neighbours, and the pipeline goes on from the step the most
advanced stage completed (``rejoin``). Survivors never recompute a step they completed; one that
was a step behind finishes that step from the logs too. A survivor's state providers and buffers
(sampler, RNG, LR schedule, counters) go back to the end of the step it completed first, since the
step it had begun may have advanced them; the replacement's come back with its window, and the
replay advances them as the uninterrupted run did.

When a log the replay needs is gone (the neighbour's node was lost with it, the log ran out of
``upstream_log.max_bytes``, or it was dropped), every stage falls back to its last committed window
and the pipeline replays from there live: slower, and still bit-identical.

The protocol needs windows aligned across stages (one window size for the job, which a cluster's
two-phase commit keeps in step) and deterministic kernels.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .sparse import SparseSnapshots
from .torch_helpers import _SYSTEM_FAILURES, Client, Error

_logger = logging.getLogger("moesnap")

# Errors that mean a log the replay needs is not there (or too large for one message): recovery
# falls back to the last window.
_LOG_MISSING = {"NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS", "RESOURCE_EXHAUSTED"}


class StageLink:
    """The boundaries of pipeline stage ``stage``: stage i runs as rank ``ranks[i]``, both in the
    process group and as its moesnap rank. Live, messages go over ``torch.distributed`` and each is
    logged before it is sent; replaying, messages are read from the sender's upstream log (one
    message per step and direction: under 64 MiB) and sends are only logged."""

    def __init__(self, client: Optional[Client], stage: int, ranks: List[int]) -> None:
        self._client = client
        self.stage = stage
        self._ranks = ranks
        self.replaying = False
        self._fetched: Dict[Tuple[int, str], List[torch.Tensor]] = {}
        # Messages not logged (the log full, the daemon gone or failing): a neighbour's recovery
        # that needs one falls back to its last window.
        self.log_refusals = 0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == len(self._ranks) - 1

    def _log(self, step: int, micro_batch: int, direction: str, peer: int,
             tensor: torch.Tensor) -> None:
        if self._client is None:  # training without moesnap
            return
        try:
            self._client.append_log(step, micro_batch, direction, self._ranks[peer], tensor)
        except Error as error:
            if error.code not in _SYSTEM_FAILURES:
                raise
            self.log_refusals += 1  # training goes on, and the message is sent
            if self.log_refusals & (self.log_refusals - 1) == 0:  # the first, then ever more rarely
                _logger.warning("moesnap: the %s message of step %d (micro-batch %d) was not "
                                "logged (%d so far): %s", direction, step, micro_batch,
                                self.log_refusals, error.message)

    def _receive(self, step: int, micro_batch: int, direction: str, peer: int,
                 like: torch.Tensor) -> torch.Tensor:
        if not self.replaying:
            received = torch.empty_like(like)
            dist.recv(received, self._ranks[peer])
            return received
        key = (step, direction)
        if key not in self._fetched:
            self._fetched = {key: self._client.fetch_log(self._ranks[peer], step, direction,
                                                         self._ranks[self.stage], like)}
        messages = self._fetched[key]
        if micro_batch >= len(messages):
            raise Error("DATA_LOSS", f"the log of step {step} from stage {peer} holds "
                                     f"{len(messages)} micro-batches, not {micro_batch + 1}")
        return messages[micro_batch]

    def send_forward(self, step: int, micro_batch: int, activations: torch.Tensor) -> None:
        self._log(step, micro_batch, "forward", self.stage + 1, activations)
        if not self.replaying:
            dist.send(activations.contiguous(), self._ranks[self.stage + 1])

    def receive_forward(self, step: int, micro_batch: int, like: torch.Tensor) -> torch.Tensor:
        return self._receive(step, micro_batch, "forward", self.stage - 1, like)

    def send_backward(self, step: int, micro_batch: int, gradient: torch.Tensor) -> None:
        self._log(step, micro_batch, "backward", self.stage - 1, gradient)
        if not self.replaying:
            dist.send(gradient.contiguous(), self._ranks[self.stage - 1])

    def receive_backward(self, step: int, micro_batch: int, like: torch.Tensor) -> torch.Tensor:
        return self._receive(step, micro_batch, "backward", self.stage + 1, like)


def rejoin(link: StageLink, sparse: SparseSnapshots, run_step: Callable[[int], None],
           completed: Optional[int]) -> Tuple[int, str]:
    """Brings every stage to the same step after a stage was lost; called by every stage once the
    new process group is up. ``completed`` is the last step this stage completed, or None when its
    state is not that of a completed step (the replacement, or a stage whose earlier rejoin was cut
    short). ``run_step(step)`` runs one training step through ``link`` and snapshots it. Returns
    (the step every stage has now completed, how: "logs" or "fallback").

    Every collective here runs under the process group's timeout: it must exceed the time the
    replacement takes to restore and replay a window."""
    if completed is not None:
        # The step after it may have begun (its forward drew from the sampler and the RNG and
        # changed buffers) before the neighbour was lost: it runs again from where it began.
        sparse.rewind(completed)
    gathered: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, completed)
    done = [step for step in gathered if step is not None]
    if not done:
        return _fall_back(sparse, run_step, None), "fallback"
    target = max(done)
    if min(done) < target - 1:
        raise Error("FAILED_PRECONDITION", f"stages completed steps {gathered}: more than one "
                                           f"step apart, which a pipeline cannot be")

    def replay(steps: List[int]) -> Optional[str]:
        link.replaying = True
        try:
            for step in steps:
                run_step(step)
        except Error as error:
            if error.code not in _LOG_MISSING:
                raise
            return f"{error.code}: {error.message}"
        finally:
            link.replaying = False
        return None

    failure: Optional[str] = None
    if completed is None:
        failure = _replay_from_window(sparse, replay, target)
    if _any_failed(failure):
        return _fall_back(sparse, run_step, target), "fallback"
    # Stages a step behind finish it from the logs, the most downstream first (an upstream stage
    # needs the gradients its downstream neighbour sends in that step).
    for stage in reversed(range(dist.get_world_size())):
        failure = None
        if stage == link.stage and completed is not None and completed < target:
            failure = replay([target])
        if _any_failed(failure):
            return _fall_back(sparse, run_step, target), "fallback"
    return target, "logs"


def _replay_from_window(sparse: SparseSnapshots, replay: Callable[[List[int]], Optional[str]],
                        target: int) -> Optional[str]:
    """The replacement: its last committed window rebuilt from the logs, then the steps after it
    up to ``target``. Returns why a log it needed was missing, if one was."""
    failures: List[str] = []

    def train_step(step: int) -> None:
        failure = replay([step])
        if failure:
            failures.append(failure)
            raise Error("DATA_LOSS", failure)

    try:
        end = sparse.recover(train_step)
    except Error as error:
        if not failures and error.code not in _LOG_MISSING:
            raise
        return failures[0] if failures else f"{error.code}: {error.message}"
    return replay(list(range(end + 1, target + 1)))


def _any_failed(failure: Optional[str]) -> bool:
    """Shares each stage's failure (or None) with every stage; also a barrier."""
    failures: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return any(failures)


def _fall_back(sparse: SparseSnapshots, run_step: Callable[[int], None],
               target: Optional[int]) -> int:
    """Every stage restores its last committed window and the pipeline replays it live; the steps
    after it are trained again up to ``target`` (to the window's end when None)."""
    end = sparse.last_window_end()
    ends: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(ends, end)
    if 0 in ends:
        raise Error("FAILED_PRECONDITION", f"stage {ends.index(0)} has no committed window to fall "
                                           f"back to: restart the job from its last checkpoint")
    if len(set(ends)) != 1:
        raise Error("FAILED_PRECONDITION", f"the stages' last committed windows end at different "
                                           f"steps {ends}: no consistent state to fall back to")
    sparse.recover(run_step)
    for step in range(end + 1, (end if target is None else target) + 1):
        run_step(step)
    return end if target is None else target
