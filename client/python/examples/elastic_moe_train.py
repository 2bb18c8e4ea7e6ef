#!/usr/bin/python3
"""One node of an expert-parallel MoE job that survives the loss of nodes without restarting the
others (moesnap.elastic: Lazarus over moesnap's snapshots), trained on CPU with gloo.

The model: an embedding, two blocks of (LayerNorm, 8-expert top-2 MoE, residual), a final norm and
a head, next-token loss on synthetic data that is a pure function of the step. Every node holds the
dense part and the expert replicas its layer plans give it; the plans come from the placement
planner and fixed, skewed token loads (what a job would take from the routing statistics of an
earlier run). Each step's global batch is split evenly over the members in rank order, so a run is
deterministic for a given membership history.

With --socket the node snapshots its state into its moesnapd after every step; when another node
is lost, it reconfigures with the survivors and trains on from the last committed step; started
again after the whole job stopped, every node resumes from the last committed step. Without it
(the reference), --leave STEP:NODE makes NODE leave after STEP as a planned departure that hands
its experts over through torch.distributed, with the same plans as after a failure; several
--leave at one step are applied in order.

Prints one line per event, flushed: "plan LAYER PLACEMENT", "resumed at step S", "step S loss HEX"
(the global loss as float.hex, on every member), "shares S LAYER EXPERT TOKENS NODE RECEIVED" (with
--shares S), "failure after step S: ...", "recovered ...", "times ..." and the new plans after a
recovery, "snapshots paused ...", "stopping after step S", "left after step S", "done".
"""

import argparse
import datetime
import json
import os
import signal
import sys
from typing import Dict, List

import torch
from torch import nn

import moesnap
import moesnap.elastic
import moesnap.moe

VOCAB, MODEL, HIDDEN, EXPERTS, LAYERS = 64, 32, 64, 8, 2
BATCH, SEQUENCE = 12, 16  # 12 sequences: an even split over 4, 3 or 2 members
LOADS = [
    [40, 5, 120, 15, 60, 10, 200, 25],
    [90, 150, 20, 8, 35, 12, 60, 110],
]


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(MODEL, HIDDEN)
        self.down = nn.Linear(HIDDEN, MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def expert_builder(layer: int):
    """Expert `index` of `layer`, the same on every node: seeded by its place, not by the order in
    which a node builds its replicas."""
    def build(index: int) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(10_000 + 100 * layer + index)
            return Expert()
    return build


class Block(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(MODEL)
        self.moe = moesnap.moe.ExpertParallelMoE(MODEL, EXPERTS, expert_builder(layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, MODEL)
        self.blocks = nn.ModuleList(Block(layer) for layer in range(LAYERS))
        self.norm = nn.LayerNorm(MODEL)
        self.head = nn.Linear(MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch_for(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5000 + step)
    return torch.randint(VOCAB, (BATCH, SEQUENCE + 1), generator=generator)


def parse_leaves(values: List[str]) -> Dict[int, List[List[int]]]:
    leaves: Dict[int, List[List[int]]] = {}
    for value in values:
        step, nodes = value.split(":")
        leaves.setdefault(int(step), []).append([int(node) for node in nodes.split(",")])
    return leaves


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", type=int, required=True, help="this node (its moesnap rank)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--rendezvous", required=True,
                        help="a file every node reaches: the store of the membership")
    parser.add_argument("--socket", help="moesnapd agent socket; none: no snapshots")
    parser.add_argument("--slots", type=int, default=5, help="expert replicas per node and layer")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--capacities", default="",
                        help="comma-separated share of tokens per node's replicas (default 1 each)")
    parser.add_argument("--leave", action="append", default=[], metavar="STEP:NODE[,NODE]",
                        help="planned departure after STEP (reference runs)")
    parser.add_argument("--shares", type=int, action="append", default=[], metavar="STEP",
                        help="print how each expert's tokens were split at STEP")
    parser.add_argument("--timeout", type=float, default=120, help="seconds for collectives and "
                        "for the membership agreement")
    parser.add_argument("--lost-after", type=float, default=10,
                        help="seconds without a member's keep-alive before it counts as lost")
    parser.add_argument("--stop-after-recovery", type=int, default=0, metavar="N",
                        help="test pacing: after each recovery, stop (SIGSTOP) once N more steps "
                             "are done, until continued")
    parser.add_argument("--out", help="write this node's final state here (torch.save)")
    arguments = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    capacities = {node: float(c) for node, c in enumerate(arguments.capacities.split(","))} \
        if arguments.capacities else {}
    model = Model()
    plans = {f"blocks.{layer}.moe": moesnap.moe.LayerPlan.create(
        LOADS[layer], arguments.nodes, arguments.slots, arguments.min_replicas)
        for layer in range(LAYERS)}
    store = torch.distributed.FileStore(arguments.rendezvous, arguments.nodes)
    rendezvous = moesnap.elastic.Rendezvous(
        store, arguments.node, lost_after=datetime.timedelta(seconds=arguments.lost_after),
        timeout=datetime.timedelta(seconds=arguments.timeout))
    connect = (lambda: moesnap.Client(arguments.socket, arguments.node)) \
        if arguments.socket else None
    job = moesnap.elastic.ElasticExpertParallel(
        model, plans, arguments.node, rendezvous,
        make_optimizer=lambda parameters: torch.optim.Adam(parameters, lr=3e-3),
        connect=connect, capacities=capacities, log=lambda line: print(line, flush=True))
    job.start()
    for name, plan in sorted(job.plans.items()):
        print(f"plan {name} {json.dumps([list(node) for node in plan.placement])}", flush=True)
    leaves = parse_leaves(arguments.leave)
    # Started again after the whole job stopped: go on from the last committed step.
    resumed = job.resume() if connect is not None else None
    if resumed is not None:
        print(f"resumed at step {resumed}", flush=True)

    def train_step(step: int) -> None:
        members = job.members
        rows = BATCH // len(members)
        first = members.index(arguments.node) * rows
        tokens = batch_for(step)[first:first + rows]
        logits = model(tokens[:, :-1])
        # The sum over the members' tokens divided by the global count: summing every member's
        # gradients gives the gradient of the batch mean.
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1),
                                           reduction="sum") / (BATCH * SEQUENCE)
        job.zero_grad()
        loss.backward()
        job.synchronize_gradients()
        job.optimizer_step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        if step in arguments.shares:
            for name, layer in sorted(moesnap.moe.moe_layers(model).items()):
                for expert, received in sorted(layer.last_received.items()):
                    print(f"shares {step} {name} {expert} {layer.last_tokens[expert]} "
                          f"{arguments.node} {received}", flush=True)
        print(f"step {step} loss {total.item().hex()}", flush=True)

    step = resumed or 0
    stop_at = None
    while step < arguments.steps:
        try:
            train_step(step + 1)
            step += 1
            job.snapshot(step)
            if step == stop_at:
                print(f"stopping after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            for leaving in leaves.get(step, []):
                if not job.release(leaving, step):
                    print(f"left after step {step}", flush=True)
                    return 0
        except RuntimeError as failure:  # a collective failed: a member is gone
            print(f"failure after step {step}: {str(failure).splitlines()[0]}", flush=True)
            recovery = job.recover(failure)
            print(recovery.describe(), flush=True)
            print("times " + json.dumps(recovery.times), flush=True)
            for name, plan in sorted(job.plans.items()):
                print(f"plan {name} {json.dumps([list(node) for node in plan.placement])}",
                      flush=True)
            step = recovery.step
            if arguments.stop_after_recovery:
                stop_at = step + arguments.stop_after_recovery

    torch.distributed.barrier()
    if arguments.out:
        experts = {f"{name}.{key}": {k: v.clone() for k, v in expert.state_dict().items()}
                   for name, layer in moesnap.moe.moe_layers(model).items()
                   for key, expert in layer.experts.items()}
        torch.save({"dense": {k: v.clone() for k, v in model.state_dict().items()
                              if ".experts." not in k},
                    "experts": experts, "optimizers": job.optimizer_states()}, arguments.out)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
