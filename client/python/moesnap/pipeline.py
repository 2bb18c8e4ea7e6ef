"""Localized recovery of a pipeline stage from upstream logs.

Every stage logs what it sends across its boundaries (activations downstream, gradients upstream)
in its node's moesnapd before sending it (``StageLink``). When a stage's trainer (or its whole node)
is lost, the other stages keep their state and wait: the replacement restores the stage's last
committed sparse window, replays the window and the steps after it with its inputs read from the
neighbours' logs instead of live neighbours, and the pipeline goes on from the step the most
advanced stage completed (``rejoin``). Survivors never recompute a step they completed; one that
was a step behind finishes that step from the logs too.

When a log the replay needs is gone (the neighbour's node was lost with it, the log ran out of
``upstream_log.max_bytes``, or it was dropped), every stage falls back to its last committed window
and the pipeline replays from there live: slower, and still bit-identical.

The protocol needs windows aligned across stages (one window size for the job, which a cluster's
two-phase commit keeps in step) and deterministic kernels.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .sparse import SparseSnapshots
from .torch_helpers import Client, Error

# Errors that mean a log the replay needs is not there: recovery falls back to the last window.
_LOG_MISSING = {"NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS"}


class StageLink:
    """The boundaries of pipeline stage ``stage`` of ``stages`` (stage i runs as rank
    ``ranks[i]``). Live, messages go over ``torch.distributed`` and each is logged before it is
    sent; replaying, messages are read from the sender's upstream log and sends are only logged."""

    def __init__(self, client: Optional[Client], stage: int, ranks: List[int]) -> None:
        self._client = client
        self.stage = stage
        self._ranks = ranks
        self.replaying = False
        self._fetched: Dict[Tuple[int, str], List[torch.Tensor]] = {}
        self.log_refusals = 0  # appends the daemon refused (log full): those steps cannot replay

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
            if error.code != "RESOURCE_EXHAUSTED":
                raise
            self.log_refusals += 1  # training goes on; a neighbour's recovery falls back

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
    new process group is up. ``completed`` is the last step this stage completed (None for the
    replacement). ``run_step(step)`` runs one training step through ``link`` and snapshots it.
    Returns (the step every stage now completed, how: "logs" or "fallback")."""
    gathered: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, completed)
    target = max(step for step in gathered if step is not None)
    failure: Optional[str] = None
    if completed is None:
        link.replaying = True
        try:
            end = sparse.recover(run_step)
            for step in range(end + 1, target + 1):
                run_step(step)
        except Error as error:
            if error.code not in _LOG_MISSING:
                raise
            failure = f"{error.code}: {error.message}"
        finally:
            link.replaying = False
    failures: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    if any(failures):
        return _fall_back(sparse, run_step, target), "fallback"
    # Stages a step behind finish it from the logs, the most downstream first (an upstream stage
    # needs the gradients its downstream neighbour sends in that step).
    for stage in reversed(range(dist.get_world_size())):
        if stage == link.stage and completed is not None and completed < target:
            link.replaying = True
            try:
                run_step(target)
            finally:
                link.replaying = False
        dist.barrier()
    return target, "logs"


def _fall_back(sparse: SparseSnapshots, run_step: Callable[[int], None], target: int) -> int:
    """Every stage restores its last committed window and the pipeline replays it live; the steps
    after it are trained again up to ``target``."""
    end = sparse.recover(run_step)
    ends: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(ends, end)
    if 0 in ends:
        raise Error("FAILED_PRECONDITION", f"stage {ends.index(0)} has no committed window to fall "
                                           f"back to: restart the job from its last checkpoint")
    if len(set(ends)) != 1:
        raise Error("FAILED_PRECONDITION", f"the stages' last committed windows end at different "
                                           f"steps {ends}: no consistent state to fall back to")
    for step in range(end + 1, target + 1):
        run_step(step)
    return target
