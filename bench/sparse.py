#!/usr/bin/python3
"""The sparse benchmark: MoEtion sparse snapshots of the example MoE model against dense ones.

The model, its data and its operator list are those of client/python/examples/moe_train.py
(imported, not copied), trained as that example trains it: one thread, deterministic kernels, Adam.
Four trainers of the same model share the daemon, each as its own rank, and run the same steps:

  dense            client.snapshot(step) of every region after every optimizer step
  sparse           moesnap.sparse.SparseSnapshots with a window of W steps
  every            client.snapshot(step) at steps W, 2W, ...: full state / W per step on average,
                   the bytes of sparse without its weights-only copies (the fair peer for recovery)
  late             the same, except that a snapshot counts only W steps after it was taken: what
                   dense every W steps is when its copy runs at sparse's per-step budget

plus one trainer without moesnap, whose step time is the baseline of the stall. The stall of a step
is the trainer's time in snapshot() and in wait_captured() (before the next optimizer step).

Then each snapshotting trainer loses its state at the failure step F (mid-window: F = 8 W + W / 2)
and gets it back up to F: sparse with SparseSnapshots.recover (its last complete window replayed
with not-yet-captured operators frozen), then the steps after that window; the dense ones restore
their latest snapshot and re-run the steps after it. Each recovered state must equal the state the
trainer had at F, bit for bit, or the script fails.

Prints one line per figure, "name|value|unit|baseline|baseline_value", and lines "note|text", for
moesnap-bench.
"""

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

import moesnap
import moesnap.sparse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "client",
                                "python", "examples"))
import moe_train  # noqa: E402  (the example's model, data and operators)


class Trainer:
    """The example's model and Adam optimizer, with or without a moesnap rank."""

    def __init__(self, socket: Optional[str], rank: int) -> None:
        torch.manual_seed(0)  # every trainer starts from the same parameters
        self.model = moe_train.MoETransformer()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        moesnap.initialize_optimizer_state(self.optimizer)
        self.client = None
        if socket is not None:
            self.client = moesnap.Client(socket, rank)
            self.client.register_module("model", self.model)
            self.client.register_optimizer("optim", self.optimizer)
        self.waited = 0.0  # seconds spent in wait_captured, summed

    def train_step(self, step: int) -> None:
        tokens = moe_train.batch_for(step, torch.device("cpu"))
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, moe_train.VOCAB),
                                                 tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad()
        loss.backward()
        if self.client is not None:
            start = time.perf_counter()
            self.client.wait_captured()  # the previous copy must end before the update
            self.waited += time.perf_counter() - start
        self.optimizer.step()

    def state(self) -> Dict[str, torch.Tensor]:
        tensors = {f"model.{key}": value.detach().clone()
                   for key, value in self.model.state_dict().items()}
        for index, parameter in enumerate(self.model.parameters()):
            for key, value in self.optimizer.state[parameter].items():
                tensors[f"optim.{index}.{key}"] = value.detach().clone()
        return tensors

    def lose_state(self) -> None:
        """What a crash leaves: nothing of the trained values (zeros, in the registered tensors)."""
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                tensor.zero_()
            for parameter in self.model.parameters():
                for value in self.optimizer.state[parameter].values():
                    value.zero_()

    def model_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return weights * 3  # fp32 weights and two Adam moments


def check_equal(name: str, expected: Dict[str, torch.Tensor],
                actual: Dict[str, torch.Tensor]) -> None:
    different = [key for key in expected if not torch.equal(expected[key], actual[key])]
    if different:
        sys.exit(f"sparse.py: {name} recovered a state that differs from the trained one in "
                 f"{len(different)} of {len(expected)} tensors, first {different[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--windows", type=int, default=8,
                        help="complete windows before the failure step")
    arguments = parser.parse_args()
    window = arguments.window
    failure = arguments.windows * window + window // 2
    moe_train.make_deterministic(torch.device("cpu"))

    plain = Trainer(None, 0)
    dense = Trainer(arguments.socket, 0)
    sparse_trainer = Trainer(arguments.socket, 1)
    sparse = moesnap.sparse.SparseSnapshots(sparse_trainer.client, sparse_trainer.model,
                                             sparse_trainer.optimizer,
                                             moe_train.operators_of(sparse_trainer.model), window)
    every = Trainer(arguments.socket, 2)
    late = Trainer(arguments.socket, 3)
    landed = failure // window * window  # the last dense snapshot of `every`
    landed_late = landed - window        # of `late`: the one of `landed` is still being copied
    snapshots = {
        "dense": (dense, dense.client.snapshot),
        "sparse": (sparse_trainer, sparse.snapshot),
        "every": (every, lambda step: every.client.snapshot(step) if step % window == 0 else 0),
        "late": (late,
                 lambda step: late.client.snapshot(step) if step % window == 0 and
                 step <= landed_late else 0),
    }

    # The same steps on every trainer, interleaved: a burst of load elsewhere hits all alike.
    step_times: List[float] = []
    stalls: Dict[str, List[float]] = {key: [] for key in snapshots}
    copied: Dict[str, List[int]] = {key: [] for key in snapshots}
    for step in range(1, failure + 1):
        start = time.perf_counter()
        plain.train_step(step)
        step_times.append(time.perf_counter() - start)
        for key, (trainer, snapshot) in snapshots.items():
            trainer.waited = 0.0
            trainer.train_step(step)
            start = time.perf_counter()
            copied[key].append(snapshot(step))
            stalls[key].append(trainer.waited + time.perf_counter() - start)
    for trainer, _ in snapshots.values():
        trainer.client.wait_captured()
    dense.client.wait_committed(failure)
    sparse_trainer.client.wait_committed(failure)
    every.client.wait_committed(landed)
    late.client.wait_committed(landed_late)

    # Recovery: each trainer loses its state at the failure step and gets it back, three times.
    def recover_dense(trainer: Trainer) -> None:
        restored = trainer.client.restore()
        for step in range(restored + 1, failure + 1):
            trainer.train_step(step)

    def recover_sparse() -> None:
        end = sparse.recover(sparse_trainer.train_step)
        for step in range(end + 1, failure + 1):
            sparse_trainer.train_step(step)

    recoveries = {
        "dense": lambda: recover_dense(dense),
        "sparse": recover_sparse,
        "every": lambda: recover_dense(every),
        "late": lambda: recover_dense(late),
    }
    trained = {key: trainer.state() for key, (trainer, _) in snapshots.items()}
    recovery: Dict[str, float] = {key: float("inf") for key in snapshots}
    for _ in range(3):
        for key, (trainer, _) in snapshots.items():
            trainer.lose_state()
            start = time.perf_counter()
            recoveries[key]()
            recovery[key] = min(recovery[key], time.perf_counter() - start)
            check_equal(key, trained[key], trainer.state())

    # Steady state: the steps after the first window (the first copies of every region are slower).
    def median_after_first_window(values: List[float]) -> float:
        return statistics.median(values[window:])

    step_time = median_after_first_window(step_times)
    stall = {key: median_after_first_window(values) for key, values in stalls.items()}
    # Bytes per step over whole windows (the steps after the last one are a partial window).
    mean_bytes = {key: sum(values[:landed]) / landed for key, values in copied.items()}
    costliest_sparse = max(copied["sparse"][:landed])
    dense_step = copied["dense"][-1]
    after = failure - landed
    name = f"example MoE, sparse W={window}: %s"
    kib = 1024.0
    rows = [
        (name % "mean step bytes", mean_bytes["sparse"] / kib, "KiB", "dense, every step",
         dense_step / kib),
        (name % "costliest step bytes", costliest_sparse / kib, "KiB", "dense, every step",
         dense_step / kib),
        (name % "mean step bytes", mean_bytes["sparse"] / kib, "KiB",
         f"dense every {window} steps, mean", mean_bytes["every"] / kib),
        (name % "stall per step", stall["sparse"] * 1e3, "ms", "dense, every step",
         stall["dense"] * 1e3),
        (name % "stall per step", stall["sparse"] * 1e3, "ms", "training step, no snapshots",
         step_time * 1e3),
        ("example MoE, dense: stall per step", stall["dense"] * 1e3, "ms",
         "training step, no snapshots", step_time * 1e3),
        (name % f"recovery to step {failure}", recovery["sparse"] * 1e3, "ms",
         f"dense every {window}, copied at once", recovery["every"] * 1e3),
        (name % f"recovery to step {failure}", recovery["sparse"] * 1e3, "ms",
         f"dense every {window}, over {window} steps", recovery["late"] * 1e3),
        (name % f"recovery to step {failure}", recovery["sparse"] * 1e3, "ms",
         "dense every step: restore only", recovery["dense"] * 1e3),
    ]
    for row_name, value, unit, baseline, baseline_value in rows:
        print(f"{row_name}|{value:.3f}|{unit}|{baseline}|{baseline_value:.3f}", flush=True)
    parameters = sum(p.numel() for p in plain.model.parameters())
    print(f"note|Example MoE rows: the model of client/python/examples/moe_train.py ({parameters} "
          f"parameters, {dense.model_bytes() / (1 << 20):.2f} MiB of fp32 weights and Adam "
          f"moments, {len(moe_train.operators_of(plain.model))} operators), one thread, "
          f"deterministic kernels, a training step {step_time * 1e3:.1f} ms; a daemon in this "
          f"process, one rank per trainer. Stall: median over steps {window + 1}-{failure} of the "
          f"time in snapshot() and wait_captured(); at this size it is the calls' own cost "
          f"(sparse names each region of its step in the request, dense names none), not the "
          f"copy's. Recovery, best of 3: the state is zeroed at step {failure} (mid-window) and "
          f"rebuilt up to it, checked bit for bit against the trained state. Sparse replays steps "
          f"{landed - window + 2}-{landed} of its last complete window with not-yet-captured "
          f"operators frozen, then re-runs {after} steps; dense every {window} steps restores "
          f"step {landed} and re-runs {after} when its copy lands at once (as here, where it fits "
          f"in a step), or restores step {landed_late} and re-runs {failure - landed_late} when "
          f"the copy runs at sparse's per-step budget and lands {window} steps later.", flush=True)

if __name__ == "__main__":
    main()
