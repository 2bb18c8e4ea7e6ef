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

import numpy
import torch
from torch import nn

import moesnap

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="train up to this step")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--out", help="write the final state here (torch.save)")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="make each step take at least this long (a slower trainer)")
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

    client = None
    start = 0
    if os.environ.get("MOESNAP_SOCKET"):
        client = moesnap.Client()
        print("registering", flush=True)
        client.register("model", model)
        client.register("optim", optimizer)
        client.register("scheduler", scheduler)
        client.register("sampler", sampler)
        client.register("rng", moesnap.RandomState())
        print("registered", flush=True)
        if client.latest_committed() is not None:
            print("restoring", flush=True)
            start = client.restore()
            print(f"restored {start}", flush=True)

    for step in range(start + 1, arguments.steps + 1):
        began = time.monotonic()
        tokens = sampler.next_batch()
        noise = torch.from_numpy(numpy.random.normal(0.0, 0.01, (BATCH, SEQUENCE, VOCAB))
                                 .astype(numpy.float32))
        logits = model(tokens[:, :-1]) + noise
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if client:
            client.wait_captured()  # the previous snapshot's copy must end before the update
        optimizer.step()
        scheduler.step()
        print(f"step {step} loss {loss.item().hex()} lr {optimizer.param_groups[0]['lr'].hex()}",
              flush=True)
        if client:
            client.snapshot(step)
            print(f"snapshot {step}", flush=True)
        time.sleep(max(0.0, arguments.step_seconds - (time.monotonic() - began)))

    if client:
        if not client.commit(arguments.steps):
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
