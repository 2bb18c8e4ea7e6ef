#!/usr/bin/python3
"""A trainer whose state has every part PyTorch keeps, for the exactness tests.

AdamW with weight decay (or SGD with momentum), a linear warmup followed by exponential LR decay,
global gradient clipping, dropout (torch RNG), NumPy noise, a sampler drawing batches with
Python's ``random``, a token counter buffer and BatchNorm statistics updated in ``forward``. Fully
deterministic, so a run killed and restored any number of times prints exactly the losses and lrs
of an uninterrupted run and ends in the same state.

Uses the launcher's environment (MOESNAP_SOCKET, RANK); without MOESNAP_SOCKET it trains without
moesnap (the reference run). Prints, flushed: "registering", "registered", "restoring",
"restored S", "step S loss HEX lr HEX", "snapshot S", "skipped S" per skipped snapshot, "done".
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy
import torch
from torch import nn

import moesnap
import moesnap.sparse

VOCAB, MODEL, HIDDEN, EXPERTS = 64, 32, 64, 4
BATCH, SEQUENCE, DATASET = 8, 12, 512


class Experts(nn.Module):
    """A soft mixture of experts that counts the tokens it routes (a buffer changed in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(MODEL, EXPERTS)
        self.up = nn.Parameter(torch.randn(EXPERTS, MODEL, HIDDEN) * 0.1)
        self.down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, MODEL) * 0.1)
        self.register_buffer("tokens_seen", torch.zeros(EXPERTS, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1)
        with torch.no_grad():
            self.tokens_seen += torch.bincount(weights.argmax(-1).reshape(-1), minlength=EXPERTS)
        hidden = torch.nn.functional.gelu(torch.matmul(x.unsqueeze(-2).unsqueeze(-2), self.up))
        outputs = torch.matmul(hidden, self.down).squeeze(-2)  # batch, time, expert, model
        return (weights.unsqueeze(-1) * outputs).sum(dim=-2)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, MODEL)
        self.norm = nn.BatchNorm1d(MODEL)
        self.experts = Experts()
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        x = x + self.dropout(self.experts(x))
        return self.head(x)


class Sampler:
    """Draws each batch's sequences with Python's ``random``; its position is its own state."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.data = torch.randint(VOCAB, (DATASET, SEQUENCE + 1), generator=generator)
        self.batches_drawn = 0

    def next_batch(self) -> torch.Tensor:
        self.batches_drawn += 1
        return self.data[random.sample(range(DATASET), BATCH)]

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.batches_drawn = state["batches_drawn"]


def operators_of(model: Model):
    """MoEtion operators in capture order: the experts, the gate, then the dense parts."""
    return [("experts", [model.experts.up, model.experts.down]),
            ("gate", list(model.experts.gate.parameters())),
            ("embedding", list(model.embedding.parameters())),
            ("norm", list(model.norm.parameters())),
            ("head", list(model.head.parameters()))]


def wait_for_every_rank(directory: str, ranks: str) -> None:
    """A file-system barrier: the job's ranks end together, as collectives make them."""
    Path(directory, f"rank{os.environ['RANK']}").touch()
    deadline = time.monotonic() + 300
    while len(list(Path(directory).iterdir())) < int(ranks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every one of {ranks} ranks reached the last step")
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="train up to this step")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--out", help="write the final state here (torch.save)")
    parser.add_argument("--barrier", nargs=2, metavar=("DIRECTORY", "RANKS"),
                        help="before committing the last step, wait until RANKS trainers reached "
                             "it (a file each in DIRECTORY), as ranks in lockstep do")
    parser.add_argument("--sparse-window", type=int, default=0,
                        help="sparse snapshots over windows of this many steps (0: dense)")
    arguments = parser.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = Model()
    if arguments.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5),
        torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.97)], milestones=[5])
    sampler = Sampler()

    def train_step(step: int) -> None:
        tokens = sampler.next_batch()
        noise = torch.from_numpy(numpy.random.normal(0.0, 0.01, (BATCH, SEQUENCE, VOCAB))
                                 .astype(numpy.float32))
        logits = model(tokens[:, :-1]) + noise
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        if sparse:  # a replay scales by the norm the window logged
            sparse.clip_grad_norm_(model.parameters(), 1.0, step)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if client:
            client.wait_captured()  # the previous snapshot's copy must end before the update
        optimizer.step()
        scheduler.step()
        print(f"step {step} loss {loss.item().hex()} lr {optimizer.param_groups[0]['lr'].hex()}",
              flush=True)

    if arguments.sparse_window:  # sparse snapshots name every operator's state up front
        moesnap.initialize_optimizer_state(optimizer)
    client = None
    sparse = None
    start = 0
    if os.environ.get("MOESNAP_SOCKET"):
        client = moesnap.Client()
        print("registering", flush=True)
        client.register("model", model)
        client.register("optim", optimizer)
        client.register("scheduler", scheduler)
        client.register("sampler", sampler)
        client.register("rng", moesnap.RandomState())
        if arguments.sparse_window:
            sparse = moesnap.sparse.SparseSnapshots(client, model, optimizer, operators_of(model),
                                                     arguments.sparse_window)
        print("registered", flush=True)
        if sparse:
            print("restoring", flush=True)
            start = sparse.recover(train_step)
            print(f"restored {start}", flush=True)
        elif client.latest_committed() is not None:
            print("restoring", flush=True)
            start = client.restore()
            print(f"restored {start}", flush=True)

    for step in range(start + 1, arguments.steps + 1):
        train_step(step)
        if sparse:
            sparse.snapshot(step)
            print(f"snapshot {step}", flush=True)
        elif client and step < arguments.steps:
            client.snapshot(step)
            print(f"snapshot {step}", flush=True)
        elif client:  # the last step: committed, waiting for it
            if arguments.barrier:
                wait_for_every_rank(*arguments.barrier)
            if not client.commit(step):
                return 1
            print(f"snapshot {step}", flush=True)

    if client:
        if sparse and not client.commit(arguments.steps):
            return 1
        for step, _ in client.skipped_steps:
            print(f"skipped {step}", flush=True)
    if arguments.out:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict()},
                   arguments.out)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
