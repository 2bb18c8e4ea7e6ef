#!/usr/bin/python3
"""Data-parallel training over gloo whose replicas snapshot one shard each (REFT).

Every rank of the job (RANK and WORLD_SIZE from the launcher, as torchrun sets them; the rendezvous
at MASTER_ADDR and MASTER_PORT, or in the file --rendezvous names) holds the same MLP and Adam state: each trains on its own batch and the gradients are
averaged with all_reduce, so parameters and optimizer state stay bit-identical on every rank. The
model and the optimizer are declared one replica group of the whole job, so each rank's daemon
copies only 1/WORLD_SIZE of them per step, and a restore assembles them from every rank's shard
(from another node's daemon, or decoded from parity, when the shard is not on this one).

Prints one line per event, flushed: "restored S digest D" after a restore, and "step S digest D"
once step S is snapshotted, D being the SHA-256 of the model's and optimizer's state at the end of
step S (what the snapshot holds).
"""

import argparse
import datetime
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import moesnap

FEATURES, HIDDEN = 256, 1024


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of every parameter, buffer and optimizer state tensor, in a fixed order."""
    hashed = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        hashed.update(name.encode())
        hashed.update(tensor.detach().contiguous().numpy().tobytes())
    for index, parameter in enumerate(model.parameters()):
        for key, value in sorted(optimizer.state.get(parameter, {}).items()):
            hashed.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                hashed.update(value.detach().contiguous().numpy().tobytes())
            else:
                hashed.update(repr(value).encode())
    return hashed.hexdigest()


def batch(step: int, rank: int):
    generator = torch.Generator().manual_seed(step * 1009 + rank)
    inputs = torch.randn(32, FEATURES, generator=generator)
    return inputs, inputs.roll(1, dims=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--collective-timeout", type=float, default=60,
                        help="seconds a collective waits for a rank that is gone")
    parser.add_argument("--rendezvous", help="a file for the ranks' rendezvous, new for each job "
                                             "(default: MASTER_ADDR and MASTER_PORT)")
    arguments = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{arguments.rendezvous}" if arguments.rendezvous else "env://",
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=arguments.collective_timeout))
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, FEATURES))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    client = moesnap.Client()
    client.register("model", model)
    client.register("optim", optimizer)
    client.set_replica_group(["model", "optim"])  # every rank of the default process group
    start = 0
    if client.latest_committed() is not None:
        start = client.restore()
        print(f"restored {start} digest {digest(model, optimizer)}", flush=True)
    for step in range(start + 1, arguments.steps + 1):
        inputs, targets = batch(step, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()
        client.wait_captured()
        optimizer.step()
        if step < arguments.steps:
            client.snapshot(step)
        else:
            client.commit(step)
        print(f"step {step} digest {digest(model, optimizer)}", flush=True)
    client.wait_captured()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
