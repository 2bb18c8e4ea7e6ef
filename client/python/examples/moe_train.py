#!/usr/bin/python3
"""A small Mixture-of-Experts transformer trained with moesnap snapshots every step.

4 layers, 8 experts per layer, top-2 gating, Adam, synthetic next-token data that is a pure function
of the step. Fully deterministic (fixed seeds, one thread, deterministic algorithms; on a GPU also
deterministic cuBLAS and the math attention kernel), so a run that is killed and restored must
produce exactly the losses and final state of an uninterrupted run on the same device. --device
cuda trains on the GPU: parameters and Adam moments are then shared with moesnapd by CUDA IPC.

Prints one line per event, flushed: "step S loss HEX" (the loss as float.hex), "snapshot S",
"restored S" when it resumed, and "took over B bytes ..." when its shared memory is what a killed
predecessor of its rank left with the daemon. Without --socket it trains without moesnap (the
reference run).

With --sparse-window W it takes MoEtion sparse snapshots (moesnap.sparse): every expert of every
layer, every layer's attention + gate part and the embedding + head are operators, captured whole
once per window of W steps and as weights in the slots before; recovery replays the last complete
window. --clip N clips the global gradient norm to N (the replay scales by the logged norm).
"""

import argparse
import os
import sys

import torch
from torch import nn

import moesnap
import moesnap.sparse

VOCAB, MODEL, HIDDEN, EXPERTS, LAYERS, HEADS = 64, 32, 64, 8, 4, 4
BATCH, SEQUENCE = 8, 16


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(MODEL, HIDDEN)
        self.down = nn.Linear(HIDDEN, MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-2 gating; every expert runs on every token and the gate zeroes all but two, which is
    wasteful at scale and exactly deterministic here."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(MODEL, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(self.gate(x), dim=-1)
        top_values, top_indices = probabilities.topk(2, dim=-1)
        weights = torch.zeros_like(probabilities).scatter(-1, top_indices,
                                                          top_values / top_values.sum(-1, keepdim=True))
        outputs = torch.stack([expert(x) for expert in self.experts], dim=-2)
        return (weights.unsqueeze(-1) * outputs).sum(dim=-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(MODEL)
        self.attention = nn.MultiheadAttention(MODEL, HEADS, batch_first=True)
        self.moe_norm = nn.LayerNorm(MODEL)
        self.moe = MoELayer()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        normed = self.attention_norm(x)
        x = x + self.attention(normed, normed, normed, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(MODEL)
        self.head = nn.Linear(MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.full((tokens.shape[1], tokens.shape[1]), float("-inf"),
                                     device=tokens.device), diagonal=1)
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


class DataPosition:
    """The data loader's position, as moesnap's non-tensor state."""

    def __init__(self) -> None:
        self.next_step = 1

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = state["next_step"]


def batch_for(step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(VOCAB, (BATCH, SEQUENCE + 1), generator=generator).to(device)


def make_deterministic(device: torch.device) -> None:
    torch.set_num_threads(1)
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace, set before CUDA starts; the fused
        # attention kernels are not deterministic in their backward pass.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    torch.use_deterministic_algorithms(True)


def save_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The final state the tests compare with an uninterrupted run's."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def operators_of(model: MoETransformer):
    """(name, parameters) in capture order: experts layer by layer, then each layer's dense part,
    then the embedding, final norm and head."""
    operators = []
    for index, block in enumerate(model.blocks):
        for expert_index, expert in enumerate(block.moe.experts):
            operators.append((f"layer{index}.expert{expert_index}", list(expert.parameters())))
    for index, block in enumerate(model.blocks):
        dense = [p for name, p in block.named_parameters() if not name.startswith("moe.experts.")]
        operators.append((f"layer{index}.dense", dense))
    outer = list(model.embedding.parameters()) + list(model.norm.parameters()) + \
        list(model.head.parameters())
    operators.append(("outer", outer))
    return operators


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", help="moesnapd agent socket; none: train without moesnap")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--steps", type=int, required=True, help="train up to this step")
    parser.add_argument("--out", help="write the final model and optimizer state here (torch.save)")
    parser.add_argument("--sparse-window", type=int, default=0,
                        help="sparse snapshots over windows of this many steps (0: dense)")
    parser.add_argument("--clip", type=float, default=0.0,
                        help="clip the global gradient norm to this (0: no clipping)")
    parser.add_argument("--device", default="cpu", help="train on this torch device (cpu, cuda)")
    arguments = parser.parse_args()

    device = torch.device(arguments.device)
    make_deterministic(device)
    torch.manual_seed(0)
    model = MoETransformer().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    moesnap.initialize_optimizer_state(optimizer)  # the reference run creates it the same way
    position = DataPosition()

    client = None
    sparse = None
    if arguments.socket:
        client = moesnap.Client(arguments.socket, arguments.rank)
        client.register_module("model", model)
        client.register_optimizer("optim", optimizer)
        client.register_state("rng", moesnap.RandomState())
        client.register_state("data", position)
        if arguments.sparse_window:
            sparse = moesnap.sparse.SparseSnapshots(client, model, optimizer, operators_of(model),
                                                     arguments.sparse_window)

    def train_step(step: int) -> None:
        tokens = batch_for(step, device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        if arguments.clip and sparse:
            sparse.clip_grad_norm_(model.parameters(), arguments.clip, step)
        elif arguments.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), arguments.clip)
        if client:
            client.wait_captured()  # the previous snapshot's copy must end before the update
        optimizer.step()
        position.next_step = step + 1
        print(f"step {step} loss {loss.item().hex()}", flush=True)

    if sparse:
        end = sparse.recover(train_step)
        position.next_step = end + 1
        if end:
            print(f"restored {end}", flush=True)
    elif client and client.latest_committed() is not None:
        step = client.restore()
        print(f"restored {step}", flush=True)
    if client and client.adopted_bytes:
        print(f"took over {client.adopted_bytes} bytes of shared memory its killed predecessor "
              f"left", flush=True)

    for step in range(position.next_step, arguments.steps + 1):
        train_step(step)
        if sparse:
            sparse.snapshot(step)
            print(f"snapshot {step}", flush=True)
        elif client:
            client.snapshot(step)
            print(f"snapshot {step}", flush=True)

    if client:
        client.wait_committed(arguments.steps)
    if arguments.out:
        save_state(arguments.out, model, optimizer)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
