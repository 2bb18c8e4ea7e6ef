"""Sparse snapshots of a Mixture-of-Experts model and their sparse-to-dense recovery (MoEtion).

Operators (an expert of a layer, or the non-expert part of a layer) are split over a window of W
steps in capture order: slot k of window j is step j*W + k + 1. At slot k the operators of slot k
are captured whole (weights and optimizer state), the operators of later slots as weights only, and
the step's global gradient norm is logged. Nothing else is copied, so a step moves a fraction of the
model's bytes.

Recovery from the last complete window (the one the crash did not interrupt): load slot 0's
operators whole and the others' weights as of slot 0; for each later slot k replay its step with the
operators of slots >= k frozen (weights of step k - 1, no weight gradient, no update), scaling the
promoted operators' gradients by the logged norm (what global gradient clipping needs from the
frozen ones), then promote slot k's operators by loading them whole. At the window's last step every
operator is promoted: a dense, consistent state, bit-identical to the uninterrupted run with fp32 and
deterministic kernels. Training goes on from there; steps up to the daemon's latest committed one
are not snapshotted again (their snapshots are already stored and identical).

Every window writes one of two sets of region aliases (buffers), never the one holding the last
committed window: the daemon tracks windows (a window commits when all its slots have, and
``moesnapctl inspect`` lists them), and before the first slot of a window the trainer waits for the
previous window's slots to settle (commit or fail) and asks the daemon which buffer its last
committed window holds. A window that failed (a slot aborted) leaves its buffer free for the next.
When the daemon does not answer there (gone, or hung), the window is skipped whole, and the next
window asks again: a failure of the snapshot system never reaches the training loop.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .torch_helpers import Client, Error, initialize_optimizer_state


class SparseSnapshots:
    """Sparse snapshots of ``model`` and ``optimizer`` through ``client``.

    ``operators`` lists (name, parameters) in capture order; every parameter of the model belongs
    to exactly one. Register the model as ``model_name`` and the optimizer as ``optimizer_name``
    with the client first; this registers the aliases it snapshots under.
    """

    def __init__(self, client: Client, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 operators: Sequence[Tuple[str, Sequence[torch.nn.Parameter]]], window: int,
                 model_name: str = "model", optimizer_name: str = "optim") -> None:
        if window < 1:
            raise Error("INVALID_ARGUMENT", f"a window has at least 1 step, got {window}")
        self.window = window
        self._client = client
        self._optimizer = optimizer
        parameter_names = {id(p): f"{model_name}.{key}" for key, p in model.named_parameters()}
        # Every operator's state is named up front, so it must exist before the first step.
        initialize_optimizer_state(optimizer)
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        state_names = {id(p): client.optimizer_state_regions(optimizer_name, p) for p in ordered}
        owner: Dict[int, str] = {}
        # operator -> (slot, parameters, weight regions, full-state regions)
        self._operators: List[Tuple[str, int, List[torch.nn.Parameter], List[str], List[str]]] = []
        for position, (name, parameters) in enumerate(operators):
            slot = position * window // len(operators)
            weights, full = [], []
            for parameter in parameters:
                if id(parameter) not in parameter_names:
                    raise Error("INVALID_ARGUMENT", f"operator '{name}' holds a tensor that is "
                                                    f"not a parameter of the model")
                if id(parameter) in owner:
                    raise Error("INVALID_ARGUMENT", f"a parameter of operator '{name}' also "
                                                    f"belongs to '{owner[id(parameter)]}'")
                owner[id(parameter)] = name
                weights.append(parameter_names[id(parameter)])
                full += [parameter_names[id(parameter)]] + state_names[id(parameter)]
            self._operators.append((name, slot, list(parameters), weights, full))
        missing = [key for key, p in model.named_parameters() if id(p) not in owner]
        if missing:
            raise Error("INVALID_ARGUMENT", f"parameters in no operator: {', '.join(missing)}")

        # Everything else (state providers, optimizers' state dicts, module buffers) is captured
        # whole at each window's first step: the replay starts from it and advances it as the
        # uninterrupted run did.
        self._window_state = client.window_state_regions()
        covered = set(self._window_state) | {region for _, _, _, _, full in self._operators
                                             for region in full}
        uncovered = [name for name in client.registered_regions() if name not in covered]
        if uncovered:
            raise Error("INVALID_ARGUMENT",
                        f"regions in no operator, which no sparse step would capture: "
                        f"{', '.join(uncovered)}")
        self._norms = torch.zeros(window, dtype=torch.float32)
        client.register_tensor("sparse.grad_norm", self._norms)
        for buffer in (0, 1):
            client.register_alias("sparse.grad_norm", self._norm_region(buffer))
            for region in self._window_state:
                client.register_alias(region, self._window_state_region(region, buffer))
            for _, slot, _, weights, full in self._operators:
                for region in full:
                    client.register_alias(region, self._full_region(region, buffer))
                for k in range(slot):
                    for region in weights:
                        client.register_alias(region, self._weight_region(region, k, buffer))
        self._replaying = False
        self._skip_through = 0  # steps up to here are stored already (see recover)
        self._window_first: Optional[int] = None  # the window being written, and its buffer
        self._buffer = 0
        self._window_failure: Optional[str] = None  # why that window is skipped, if it is
        # Where the client's skipped_steps stood when that window opened: a skip after it of one
        # of the window's slots leaves the window unable to commit.
        self._skips_before_window = 0

    # Names ---------------------------------------------------------------------------------------
    @staticmethod
    def _full_region(region: str, buffer: int) -> str:
        return f"{region}@full{buffer}"

    @staticmethod
    def _weight_region(region: str, slot: int, buffer: int) -> str:
        return f"{region}@w{slot}.{buffer}"

    @staticmethod
    def _window_state_region(region: str, buffer: int) -> str:
        return f"{region}@s{buffer}"

    @staticmethod
    def _norm_region(buffer: int) -> str:
        return f"sparse.grad_norm@{buffer}"

    def _slot(self, step: int) -> int:
        return (step - 1) % self.window

    def _buffer_for_window(self, first: int) -> Optional[int]:
        """The buffer the window from step ``first`` writes: not the last committed window's.
        None when the window is skipped whole (``_window_failure`` says why): the daemon did not
        answer which buffer that is, and writing the wrong one would overwrite the last committed
        window."""
        if self._window_first == first:
            return None if self._window_failure else self._buffer
        self._window_first = first
        self._window_failure = None
        self._skips_before_window = len(self._client.skipped_steps)
        # Every slot of the previous window settles (commits or fails) before its buffer is judged
        # and the daemon opens the next one: its last slot may have been skipped, the window
        # failed, while an earlier slot still waits for the cluster's decision.
        for step in range(max(1, first - self.window), first):
            try:
                self._client.wait_committed(step)
            except Error as error:
                if error.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    # The daemon is gone or hung (or the slot still undecided, which the daemon
                    # would refuse the window for): asking about the other slots would cost a
                    # wait each.
                    self._window_failure = (f"the window from step {first} is skipped: step "
                                            f"{step} of the window before did not settle: "
                                            f"{error.message}")
                    return None
                # Any other answer: that slot did not commit, and the committed window's buffer
                # stays safe.
        try:
            committed = self._client.windows()["committed"]
        except Error as error:  # no argument a trainer could get wrong: the daemon failed
            self._window_failure = (f"the window from step {first} is skipped: moesnapd did not "
                                    f"say which buffer holds its last committed window: "
                                    f"{error.message}")
            return None
        self._buffer = 0 if committed is None else 1 - committed["buffer"]
        return self._buffer

    def _skipped_slot(self, first: int, step: int) -> Optional[str]:
        """Why the window from step ``first`` can no longer commit when one of its slots before
        ``step`` was skipped (the daemon gone, or one that restarted and lost it): the daemon
        refuses the window's later slots, which are skipped without asking it."""
        for skipped, _ in self._client.skipped_steps[self._skips_before_window:]:
            if first <= skipped < step:
                return (f"the window from step {first} can no longer commit: its step {skipped} "
                        f"(slot {skipped - first}) was skipped")
        return None

    def last_window_end(self) -> int:
        """The last step of the last committed window (0 when none has committed)."""
        committed = self._client.windows()["committed"]
        return 0 if committed is None else committed["first_step"] + committed["size"] - 1

    def operators_of_slot(self, slot: int) -> List[str]:
        return [name for name, s, _, _, _ in self._operators if s == slot]

    # Training ------------------------------------------------------------------------------------
    def clip_grad_norm_(self, parameters, max_norm: float, step: int) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that logs the step's total norm; during a replay it
        scales the promoted operators' gradients by the logged norm instead, as the full model's
        clipping did."""
        slot = self._slot(step)
        if not self._replaying:
            total = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
            self._norms[slot] = total
            return total
        total = self._norms[slot].clone()
        clip_coef = float(max_norm) / (total + 1e-6)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.detach().mul_(clip_coef_clamped)
        return total

    def snapshot(self, step: int) -> int:
        """Call right after ``optimizer.step()`` of ``step``, where a dense trainer calls
        ``client.snapshot``. Returns the bytes the daemon copies: 0 for a step stored already, or
        skipped (``client.skipped_steps`` says why)."""
        if step <= self._skip_through:
            self._client.stage(step)  # kept in this process only: rewind may come back to it
            return 0
        slot = self._slot(step)
        first = step - slot
        buffer = self._buffer_for_window(first)
        if buffer is not None:
            self._window_failure = self._skipped_slot(first, step)
        if self._window_failure is not None:
            self._client.skip(step, self._window_failure)
            return 0
        names = [self._norm_region(buffer)]
        if slot == 0:
            names += [self._window_state_region(region, buffer) for region in self._window_state]
        for _, s, _, weights, full in self._operators:
            if s == slot:
                names += [self._full_region(region, buffer) for region in full]
            elif s > slot:
                names += [self._weight_region(region, slot, buffer) for region in weights]
        return self._client.snapshot(step, names, sparse={
            "window_first_step": first, "window_size": self.window, "slot": slot,
            "buffer": buffer, "operators": self.operators_of_slot(slot)})

    def wait_captured(self) -> None:
        self._client.wait_captured()

    def rewind(self, step: int) -> None:
        """Puts the state that is not weights or optimizer state (state providers, buffers) back
        as it was at the end of ``step``, the last step this trainer completed (see
        ``Client.rewind``)."""
        self._client.rewind(step)

    # Recovery ------------------------------------------------------------------------------------
    def recover(self, train_step: Callable[[int], None]) -> int:
        """Rebuilds the dense state at the end of the last complete window and returns that step
        (0 when no window is complete: train from the start). ``train_step(step)`` runs one
        training step (forward, backward, ``clip_grad_norm_``, ``optimizer.step()``); it is called
        for each replayed step, and may call ``snapshot``, which skips every step stored already."""
        latest = self._client.latest_committed()
        if latest is None:
            return 0
        self._skip_through = max(latest, self._client.last_snapshot or 0)
        windows = self._client.windows()
        if windows["open"] is not None:  # the trainer goes on writing the window it was writing
            self._window_first = windows["open"]["first_step"]
            self._buffer = windows["open"]["buffer"]
            self._window_failure = None
            self._skips_before_window = len(self._client.skipped_steps)
        committed = windows["committed"]
        if committed is None:
            return 0
        if committed["size"] != self.window:
            raise Error("FAILED_PRECONDITION",
                        f"the last committed window has {committed['size']} steps but this "
                        f"trainer uses windows of {self.window}")
        first = committed["first_step"]
        end = first + self.window - 1
        buffer = committed["buffer"]
        # The window's first step: its state providers, optimizer hyper-parameters and buffers.
        regions = [self._norm_region(buffer)] + \
            [self._window_state_region(region, buffer) for region in self._window_state]
        for _, slot, _, weights, full in self._operators:
            if slot == 0:
                regions += [self._full_region(region, buffer) for region in full]
            else:
                regions += [self._weight_region(region, 0, buffer) for region in weights]
        self._client.restore(None, regions)
        self._replaying = True
        try:
            for k in range(1, self.window):
                frozen = [(p, weights) for _, slot, p, weights, _ in self._operators if slot >= k]
                if k > 1:  # frozen operators' weights as of the previous step
                    self._client.restore(None, [self._weight_region(region, k - 1, buffer)
                                                for _, weights in frozen for region in weights])
                for parameters, _ in frozen:
                    for parameter in parameters:
                        parameter.requires_grad_(False)
                        parameter.grad = None
                train_step(first + k)
                promoted = [(p, full) for _, slot, p, _, full in self._operators if slot == k]
                self._client.restore(None, [self._full_region(region, buffer)
                                            for _, full in promoted for region in full])
                for parameters, _ in promoted:
                    for parameter in parameters:
                        parameter.requires_grad_(True)
        finally:
            self._replaying = False
            for _, _, parameters, _, _ in self._operators:
                for parameter in parameters:
                    parameter.requires_grad_(True)
        return end
