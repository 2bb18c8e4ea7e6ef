"""Expert-parallel Mixture-of-Experts over torch.distributed, with replicated experts (Lazarus).

Each MoE layer has a plan (``LayerPlan``): which of the job's nodes hold which experts, computed by
moesnap's placement planner from the experts' token loads (replicas in proportion to load, at least
``min_replicas`` each, placed by maximum rank overlap). A node is one member of the process group;
its rank in the group is its position among the job's current members.

``ExpertParallelMoE`` holds the experts its node holds. A forward pass gates every token to its top
k experts, sends each (token, expert) pair to one replica of the expert, runs the experts where they
are, and sends the outputs back (two all-to-alls, autograd-aware, on any backend that has
``all_to_all_single``: gloo on CPU too). Which replica takes a token is decided without
communication beyond the per-expert token counts: an expert's tokens, in the order of the ranks
they come from, are cut into one contiguous run per replica with sizes in proportion to the
replicas' capacities (largest remainder), so every rank computes the same split and the split of a
batch is always the same.

``ExpertParallel`` keeps the replicas identical: after backward, the dense parameters' gradients
are summed over every member and each expert's over its replicas, so every replica takes the same
optimizer step. Losses must be scaled to the global batch (sum over members = the batch mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import core
from .core import Error


@dataclass(frozen=True)
class Transfer:
    """An expert replica the plan puts on a node that did not hold it: its state comes from
    ``source`` (a member that holds a replica) or, when ``source`` is None, from a node that is
    gone (its snapshot)."""
    expert: int
    source: Optional[int]
    target: int


@dataclass(frozen=True)
class LayerPlan:
    """One MoE layer's experts on the job's nodes, numbered 0 .. nodes - 1 as at the start.

    ``placement[node]`` lists the experts the node holds (empty for a node no longer in the job);
    ``members`` are the nodes in the job, ascending."""
    loads: Tuple[float, ...]
    slots: int
    min_replicas: int
    placement: Tuple[Tuple[int, ...], ...]
    members: Tuple[int, ...]

    @staticmethod
    def create(loads: Sequence[float], nodes: int, slots: int, min_replicas: int = 1) -> LayerPlan:
        """The planner's allocation and maximum-rank-overlap placement over ``nodes`` nodes with
        ``slots`` experts each."""
        plan = core.plan(list(loads), nodes, slots, min_replicas)
        return LayerPlan(tuple(float(load) for load in loads), slots, min_replicas,
                         tuple(tuple(node) for node in plan["placement"]), tuple(range(nodes)))

    @property
    def experts(self) -> int:
        return len(self.loads)

    @property
    def nodes(self) -> int:
        return len(self.placement)

    def holders(self, expert: int) -> List[int]:
        """The members holding ``expert``, ascending."""
        return [node for node in self.members if expert in self.placement[node]]

    def after_loss(self, lost: Iterable[int]) -> Tuple[LayerPlan, List[Transfer]]:
        """The planner's reconfiguration once ``lost`` members are gone: the allocation over the
        remaining members, every replica that can stay kept, the others placed where there is
        room, each sourced from a remaining replica (None: none remains)."""
        lost = set(lost)
        unknown = lost - set(self.members)
        if unknown:
            raise Error("INVALID_ARGUMENT", f"nodes {sorted(unknown)} are not members of the "
                                            f"plan (members {list(self.members)})")
        gone = sorted(set(range(self.nodes)) - set(self.members) | lost)
        result = core.reconfigure(list(self.loads), self.nodes, self.slots, self.min_replicas,
                                      [list(node) for node in self.placement], gone)
        plan = LayerPlan(self.loads, self.slots, self.min_replicas,
                         tuple(tuple(node) for node in result["placement"]),
                         tuple(result["survivors"]))
        return plan, [Transfer(t["expert"], t["from"], t["to"]) for t in result["transfers"]]


def recovery_probability(plans: Sequence[LayerPlan], failed: int) -> float:
    """The probability that every expert of every layer keeps a replica when ``failed`` of the
    plans' members, chosen uniformly, are lost (exact while the subsets are few, else sampled)."""
    members = plans[0].members
    joint = [[index * plan.experts + expert for index, plan in enumerate(plans)
              for expert in plan.placement[node]] for node in members]
    experts = sum(plan.experts for plan in plans)
    rows = core.recovery_probabilities(joint, experts)
    return rows[min(failed, len(members))]["probability"]


def replica_shares(tokens: int, capacities: Sequence[float]) -> List[int]:
    """Splits ``tokens`` among replicas in proportion to ``capacities``: each gets the floor of its
    exact share, and the tokens left go one each to the largest remainders (the earlier replica on
    a tie). Every share is within one token of exact; computed in exact fractions, so every rank
    gets the same split."""
    if not capacities or any(capacity <= 0 for capacity in capacities):
        raise Error("INVALID_ARGUMENT", f"replica capacities must be positive, got "
                                        f"{list(capacities)}")
    exact = [Fraction(tokens) * Fraction(capacity) / sum(Fraction(c) for c in capacities)
             for capacity in capacities]
    shares = [int(share) for share in exact]
    by_remainder = sorted(range(len(exact)), key=lambda j: (-(exact[j] - shares[j]), j))
    for j in by_remainder[:tokens - sum(shares)]:
        shares[j] += 1
    return shares


def route(counts: Sequence[Sequence[int]], replicas: Sequence[Sequence[int]],
          capacities: Sequence[Sequence[float]]) -> List[List[List[int]]]:
    """Which replica takes which tokens. ``counts[source][expert]`` is the number of tokens rank
    ``source`` has for ``expert``; ``replicas[expert]`` are the ranks holding it and
    ``capacities[expert]`` theirs. An expert's tokens, ordered by source rank, are cut into runs of
    ``replica_shares`` in replica order. Returns ``sends[source][expert][j]``: how many of
    ``source``'s tokens for ``expert`` go to its replica j (they are its next ones, in order)."""
    sources = len(counts)
    sends = [[[0] * len(replicas[expert]) for expert in range(len(replicas))]
             for _ in range(sources)]
    for expert in range(len(replicas)):
        total = sum(counts[source][expert] for source in range(sources))
        if total and not replicas[expert]:
            raise Error("FAILED_PRECONDITION", f"{total} tokens for expert {expert}, which no "
                                               f"member holds")
        if not total:
            continue
        bounds = [0]
        for share in replica_shares(total, capacities[expert]):
            bounds.append(bounds[-1] + share)
        start = 0
        for source in range(sources):
            end = start + counts[source][expert]
            for j in range(len(replicas[expert])):
                sends[source][expert][j] = max(0, min(end, bounds[j + 1]) - max(start, bounds[j]))
            start = end
    return sends


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward sends the gradients back the way
    the values came."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        output = values.new_empty((sum(output_splits),) + tuple(values.shape[1:]))
        dist.all_to_all_single(output, values.contiguous(), output_splits, input_splits,
                               group=group)
        return output

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        output_splits, input_splits = ctx.splits
        back = gradient.new_empty((sum(input_splits),) + tuple(gradient.shape[1:]))
        dist.all_to_all_single(back, gradient.contiguous(), input_splits, output_splits,
                               group=ctx.group)
        return back, None, None, None


class ExpertParallelMoE(nn.Module):
    """A Mixture-of-Experts layer whose experts live on the nodes its plan names.

    The gate (``model_dim`` -> ``experts``, top ``top_k``, weights renormalized over the chosen
    experts) is dense: every member has it. ``make_expert(index)`` builds expert ``index`` (an
    ``nn.Module`` from ``model_dim`` to ``model_dim``); it must give every node the same initial
    expert, so seed it by the index. ``experts`` holds this node's experts by ``str(index)``;
    ``configure`` fills it from a plan. The layer needs ``configure`` before its first forward."""

    def __init__(self, model_dim: int, experts: int, make_expert: Callable[[int], nn.Module],
                 top_k: int = 2) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise Error("INVALID_ARGUMENT", f"top_k {top_k} is not in 1..{experts}")
        self.gate = nn.Linear(model_dim, experts, bias=False)
        self.experts = nn.ModuleDict()
        self.expert_count = experts
        self.top_k = top_k
        self._make_expert = make_expert
        self._group = None
        self._rank = -1
        self._replicas: List[List[int]] = []
        self._capacities: List[List[float]] = []
        # The last forward's split: every expert's tokens over the job, and this node's share.
        self.last_tokens: List[int] = []
        self.last_received: Dict[int, int] = {}

    def configure(self, plan: LayerPlan, node: int, capacities: Mapping[int, float],
                  group=None) -> Tuple[List[int], List[int]]:
        """Holds the experts ``plan`` puts on ``node``: keeps those it holds, builds the others
        with ``make_expert`` (their state is the caller's to restore), drops the rest. ``group``
        is the process group of ``plan.members`` (None: the default one); ``capacities[node]`` is
        the share of tokens a replica on that node takes relative to the others. Returns the
        experts (added, dropped)."""
        if plan.experts != self.expert_count:
            raise Error("INVALID_ARGUMENT", f"the plan has {plan.experts} experts, the layer "
                                            f"{self.expert_count}")
        if node not in plan.members:
            raise Error("INVALID_ARGUMENT", f"node {node} is not a member of the plan "
                                            f"{list(plan.members)}")
        wanted = set(plan.placement[node])
        held = {int(key) for key in self.experts}
        added, dropped = sorted(wanted - held), sorted(held - wanted)
        for expert in dropped:
            del self.experts[str(expert)]
        for expert in added:
            self.experts[str(expert)] = self.build_expert(expert)
        # ModuleDict keeps insertion order: keep it ascending so parameters() has one order.
        ordered = sorted(self.experts.items(), key=lambda item: int(item[0]))
        self.experts = nn.ModuleDict(ordered)
        rank_of = {member: rank for rank, member in enumerate(plan.members)}
        self._replicas = [[rank_of[holder] for holder in plan.holders(expert)]
                          for expert in range(plan.experts)]
        self._capacities = [[float(capacities[holder]) for holder in plan.holders(expert)]
                            for expert in range(plan.experts)]
        self._rank = rank_of[node]
        self._group = group
        return added, dropped

    def build_expert(self, expert: int) -> nn.Module:
        """A new replica of ``expert`` as ``make_expert`` builds it."""
        return self._make_expert(expert)

    def release_group(self) -> None:
        """Forgets the process group (before it is destroyed after a failure)."""
        self._group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._rank < 0:
            raise Error("FAILED_PRECONDITION", "the layer has no plan: call configure() first")
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probabilities = torch.softmax(self.gate(tokens), dim=-1)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        assignments = chosen.reshape(-1)  # pair a = token * top_k + j
        order = torch.sort(assignments, stable=True).indices  # pairs grouped by expert, in order
        counts = torch.bincount(assignments, minlength=self.expert_count)
        world = dist.get_world_size(self._group)
        gathered = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts, group=self._group)
        all_counts = [row.tolist() for row in gathered]
        sends = route(all_counts, self._replicas, self._capacities)

        # Outgoing pairs by destination rank, then expert, each run in order.
        starts = [0] * self.expert_count
        for expert in range(1, self.expert_count):
            starts[expert] = starts[expert - 1] + all_counts[self._rank][expert - 1]
        runs: List[List[torch.Tensor]] = [[] for _ in range(world)]
        input_splits = [0] * world
        for expert in range(self.expert_count):
            position = starts[expert]
            for j, destination in enumerate(self._replicas[expert]):
                count = sends[self._rank][expert][j]
                if count:
                    runs[destination].append(order[position:position + count])
                    input_splits[destination] += count
                position += count
        pairs = torch.cat([run for per_rank in runs for run in per_rank]) if any(runs) \
            else order[:0]
        output_splits = [sum(sends[source][expert][self._replicas[expert].index(self._rank)]
                             for expert in range(self.expert_count)
                             if self._rank in self._replicas[expert])
                         for source in range(world)]
        received = _AllToAll.apply(tokens[pairs // self.top_k], output_splits, input_splits,
                                   self._group)

        # Received pairs come by source rank, then expert: gather each expert's, run it, and put
        # the outputs back where the pairs came in.
        positions: Dict[int, List[int]] = {}
        offset = 0
        for source in range(world):
            for expert in range(self.expert_count):
                if self._rank not in self._replicas[expert]:
                    continue
                count = sends[source][expert][self._replicas[expert].index(self._rank)]
                positions.setdefault(expert, []).extend(range(offset, offset + count))
                offset += count
        outputs, places = [], []
        for expert, indices in sorted(positions.items()):
            if indices:
                index = torch.tensor(indices, dtype=torch.long)
                outputs.append(self.experts[str(expert)](received[index]))
                places.append(index)
        if outputs:
            inverse = torch.empty(offset, dtype=torch.long)
            inverse[torch.cat(places)] = torch.arange(offset)
            computed = torch.cat(outputs)[inverse]
        else:
            computed = received * 0  # nothing came: keep the graph, the backward all-to-all runs
        returned = _AllToAll.apply(computed, input_splits, output_splits, self._group)

        # Back in assignment order: each token's output is its experts' outputs, weighted.
        unsorted = torch.empty_like(pairs)
        unsorted[pairs] = torch.arange(len(pairs))
        per_pair = returned[unsorted].reshape(-1, self.top_k, shape[-1])
        output = (weights.unsqueeze(-1) * per_pair).sum(dim=1)
        self.last_tokens = [sum(row[expert] for row in all_counts)
                            for expert in range(self.expert_count)]
        self.last_received = {expert: len(indices) for expert, indices in positions.items()}
        return output.reshape(shape)


def moe_layers(model: nn.Module) -> Dict[str, ExpertParallelMoE]:
    """The model's expert-parallel layers by module name."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, ExpertParallelMoE)}


class ExpertParallel:
    """A model's expert-parallel layers over the job's current members: configures every layer
    from its plan and reduces gradients so that replicas stay identical.

    ``plans`` maps each layer's module name to its plan (all over the same members).
    ``capacities[node]`` weighs the tokens a node's replicas take (absent: 1)."""

    def __init__(self, model: nn.Module, node: int,
                 capacities: Optional[Mapping[int, float]] = None) -> None:
        self.model = model
        self.node = node
        self.layers = moe_layers(model)
        if not self.layers:
            raise Error("INVALID_ARGUMENT", "the model has no ExpertParallelMoE layer")
        self.capacities = dict(capacities or {})
        self.plans: Dict[str, LayerPlan] = {}
        self.group = None
        self._replica_groups: Dict[Tuple[int, ...], object] = {}

    def configure(self, plans: Mapping[str, LayerPlan], group=None
                  ) -> Dict[str, Tuple[List[int], List[int]]]:
        """Places every layer's experts as ``plans`` say and makes the process groups of the
        replica sets (every member must call this with the same plans: group creation is
        collective). Returns each layer's experts (added, dropped)."""
        if set(plans) != set(self.layers):
            raise Error("INVALID_ARGUMENT", f"plans for layers {sorted(plans)}, but the model's "
                                            f"expert-parallel layers are {sorted(self.layers)}")
        members = {plan.members for plan in plans.values()}
        if len(members) != 1:
            raise Error("INVALID_ARGUMENT", f"the layers' plans have different members {members}")
        capacities = {node: self.capacities.get(node, 1.0) for node in next(iter(members))}
        changes = {name: self.layers[name].configure(plan, self.node, capacities, group)
                   for name, plan in plans.items()}
        self.plans = dict(plans)
        self.group = group
        rank_of = {member: rank for rank, member in enumerate(next(iter(members)))}
        sets = sorted({tuple(rank_of[node] for node in plan.holders(expert))
                       for plan in plans.values() for expert in range(plan.experts)
                       if len(plan.holders(expert)) > 1})
        # new_group is collective over the whole job: every member creates every set's group.
        self._replica_groups = {ranks: dist.new_group(list(ranks)) for ranks in sets}
        return changes

    def release_groups(self) -> None:
        """Drops every reference to the process groups, so that destroying them closes their
        connections (peers blocked on this member then fail instead of waiting)."""
        for layer in self.layers.values():
            layer.release_group()
        self._replica_groups = {}
        self.group = None

    def expert_parameters(self) -> List[nn.Parameter]:
        return [p for layer in self.layers.values() for p in layer.experts.parameters()]

    def dense_parameters(self) -> List[nn.Parameter]:
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.model.parameters() if id(p) not in experts]

    def synchronize_gradients(self) -> None:
        """Sums the dense parameters' gradients over every member and each expert's over its
        replicas (a replica that took no token contributes zeros), in one flat all-reduce per
        group, in a fixed order."""
        _all_reduce_gradients(self.dense_parameters(), self.group)
        rank = dist.get_rank(self.group)
        by_set: Dict[Tuple[int, ...], List[nn.Parameter]] = {}
        for name in sorted(self.layers):
            plan, layer = self.plans[name], self.layers[name]
            rank_of = {member: r for r, member in enumerate(plan.members)}
            for key, expert in layer.experts.items():
                ranks = tuple(rank_of[node] for node in plan.holders(int(key)))
                if len(ranks) > 1 and rank in ranks:
                    by_set.setdefault(ranks, []).extend(expert.parameters())
        for ranks in sorted(by_set):
            _all_reduce_gradients(by_set[ranks], self._replica_groups[ranks])
        for parameter in self.expert_parameters():  # a lone replica that took no token
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)


def _all_reduce_gradients(parameters: List[nn.Parameter], group) -> None:
    if not parameters:
        return
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
    dist.all_reduce(flat, group=group)
    offset = 0
    for parameter in parameters:
        count = parameter.numel()
        parameter.grad.copy_(flat[offset:offset + count].view_as(parameter.grad))
        offset += count
