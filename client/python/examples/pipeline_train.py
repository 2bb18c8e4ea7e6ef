#!/usr/bin/python3
"""One stage of a pipeline-parallel MoE transformer, trained on CPU with torch.distributed (gloo).

Stage 0 holds the embedding and a transformer block, the middle stages a block each, the last stage
a block, the final norm, the head and the loss (the blocks of examples/moe_train.py: attention and
an 8-expert MoE layer). GPipe schedule: every micro-batch forward, then every micro-batch backward,
then the optimizer step. Each stage keeps the state real trainers keep: AdamW with weight decay, a
warmup-then-decay LR schedule, gradient clipping, dropout (torch RNG), a buffer counting tokens in
forward, and (first and last stage) a sampler drawing each batch with Python's ``random``.
Deterministic, so a run with a lost stage must end bit-identical to an uninterrupted one.

With --socket every stage takes sparse snapshots (moesnap.sparse, windows of --window steps) and
logs what it sends across its boundaries (moesnap.pipeline.StageLink). When a neighbour is lost,
the stage waits for its replacement on the next rendezvous generation and rejoins
(moesnap.pipeline.rejoin); the replacement is started with --generation N --replacement.

Prints one line per event, flushed: "step S lr HEX" (and "step S loss HEX lr HEX" on the last
stage) for each completed step, "rejoined T logs|fallback", "generation G", "log refusals N", "done".
"""

import argparse
import datetime
import os
import random
import signal
import sys
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

import moesnap
import moesnap.pipeline
import moesnap.sparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_train import BATCH, MODEL, SEQUENCE, VOCAB, Block  # noqa: E402

DATASET = 256


class Stage(nn.Module):
    def __init__(self, stage: int, stages: int) -> None:
        super().__init__()
        torch.manual_seed(100 + stage)
        self.first, self.last = stage == 0, stage == stages - 1
        self.embedding = nn.Embedding(VOCAB, MODEL) if self.first else None
        self.block = Block()
        self.norm = nn.LayerNorm(MODEL) if self.last else None
        self.head = nn.Linear(MODEL, VOCAB) if self.last else None
        self.dropout = nn.Dropout(0.1)
        # Changed in forward, from the data: tokens whose block output sums above zero.
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.full((SEQUENCE, SEQUENCE), float("-inf")), diagonal=1)
        if self.first:
            x = self.embedding(x)
        x = self.dropout(self.block(x, mask))
        with torch.no_grad():
            self.tokens_seen += (x.sum(-1) > 0).sum()
        return self.head(self.norm(x)) if self.last else x

    def operators(self):
        """(name, parameters): each expert, the block's dense part, and the outer layers."""
        operators = [(f"expert{index}", list(expert.parameters()))
                     for index, expert in enumerate(self.block.moe.experts)]
        operators.append(("dense", [p for name, p in self.block.named_parameters()
                                    if not name.startswith("moe.experts.")]))
        outer = [p for name, p in self.named_parameters() if not name.startswith("block.")]
        if outer:
            operators.append(("outer", outer))
        return operators


class Sampler:
    """Draws each batch's sequences with Python's ``random`` (seeded alike on the first and the last
    stage, which both need the batch); its position is its own state."""

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
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--rendezvous", required=True,
                        help="folder shared by the stages: one store file per generation")
    parser.add_argument("--generation", type=int, default=0, help="rendezvous generation to join")
    parser.add_argument("--replacement", action="store_true",
                        help="this process replaces a lost stage: recover, then rejoin")
    parser.add_argument("--socket", help="moesnapd agent socket; none: train without moesnap")
    parser.add_argument("--window", type=int, default=3, help="sparse snapshot window")
    parser.add_argument("--out", help="write the stage's final model and optimizer state here")
    parser.add_argument("--crash-mid-backward", type=int, metavar="STEP",
                        help="fault injection: SIGKILL this process in STEP's backward pass, right "
                             "after it received the last gradient and before passing it upstream")
    arguments = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(0)
    stage = arguments.stage
    model = Stage(stage, arguments.stages)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4),
        torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)], milestones=[4])
    sampler = Sampler()
    moesnap.initialize_optimizer_state(optimizer)
    ranks = list(range(arguments.stages))

    client: Optional[moesnap.Client] = None
    sparse: Optional[moesnap.sparse.SparseSnapshots] = None
    if arguments.socket:
        client = moesnap.Client(arguments.socket, stage)
        client.register("model", model)
        client.register("optim", optimizer)
        client.register("scheduler", scheduler)
        client.register("sampler", sampler)
        client.register("rng", moesnap.RandomState())
        sparse = moesnap.sparse.SparseSnapshots(client, model, optimizer, model.operators(),
                                                 arguments.window)
    link = moesnap.pipeline.StageLink(client, stage, ranks)
    micro = BATCH // arguments.micro_batches
    activation = torch.zeros(micro, SEQUENCE, MODEL)

    def run_step(step: int) -> None:
        tokens = sampler.next_batch() if link.first or link.last else None
        optimizer.zero_grad()
        inputs: List[torch.Tensor] = []
        outputs: List[torch.Tensor] = []
        for index in range(arguments.micro_batches):
            rows = tokens[index * micro:(index + 1) * micro] if tokens is not None else None
            if link.first:
                x = rows[:, :-1]
            else:
                x = link.receive_forward(step, index, activation).requires_grad_()
            y = model(x)
            if link.last:
                y = nn.functional.cross_entropy(y.reshape(-1, VOCAB), rows[:, 1:].reshape(-1)) / \
                    arguments.micro_batches
            else:
                link.send_forward(step, index, y.detach())
            inputs.append(x)
            outputs.append(y)
        for index in range(arguments.micro_batches):
            if link.last:
                outputs[index].backward()
            else:
                gradient = link.receive_backward(step, index, activation)
                if step == arguments.crash_mid_backward and index == arguments.micro_batches - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                outputs[index].backward(gradient)
            if not link.first:
                link.send_backward(step, index, inputs[index].grad)
        if sparse:  # a replay scales by the norm the window logged
            sparse.clip_grad_norm_(model.parameters(), 1.0, step)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if client:
            client.wait_captured()
        optimizer.step()
        scheduler.step()
        if sparse:
            sparse.snapshot(step)
        loss = f" loss {sum(o.item() for o in outputs).hex()}" if link.last else ""
        print(f"step {step}{loss} lr {optimizer.param_groups[0]['lr'].hex()}", flush=True)

    completed: Optional[int] = None if arguments.replacement else 0
    generation = arguments.generation
    rejoining = arguments.replacement
    while True:
        try:
            print(f"generation {generation}", flush=True)
            store = dist.FileStore(f"{arguments.rendezvous}/generation{generation}",
                                   arguments.stages)
            dist.init_process_group("gloo", store=store, rank=stage, world_size=arguments.stages,
                                    timeout=datetime.timedelta(seconds=120))
            if rejoining:
                completed, how = moesnap.pipeline.rejoin(link, sparse, run_step, completed)
                print(f"rejoined {completed} {how}", flush=True)
            for step in range(completed + 1, arguments.steps + 1):
                run_step(step)
                completed = step
            dist.barrier()
            break
        except RuntimeError as error:  # a neighbour was lost: wait for its replacement
            if sparse is None:
                raise
            print(f"lost a neighbour after step {completed}: {error}".splitlines()[0], flush=True)
            if rejoining:
                completed = None  # cut short while rejoining: the state may be mid-replay
            dist.destroy_process_group()
            generation += 1
            rejoining = True

    if client:
        client.wait_committed(arguments.steps)
        print(f"log refusals {link.log_refusals}", flush=True)
    if arguments.out:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
                    "random": random.getstate(), "torch_rng": torch.get_rng_state()},
                   arguments.out)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
