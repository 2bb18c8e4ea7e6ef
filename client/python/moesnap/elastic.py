"""Elastic expert parallelism: an MoE job that loses nodes and keeps training without restarting
the survivors (Lazarus, with moesnap's snapshots underneath).

``ElasticExpertParallel`` runs a model's ``moesnap.moe.ExpertParallelMoE`` layers over the job's
members, one optimizer for the dense part and one per expert replica (an expert's weights and its
optimizer state move together), and snapshots every member's state into its node's moesnapd after
every step. When a collective fails because a member is gone, ``recover`` on every survivor:

1. agrees on the new membership (``Rendezvous``): every survivor checks in for the next generation
   in a shared store; the first to see every former member either checked in or silent (its
   keep-alive in the store stopped for ``lost_after``) writes the member list, once, with a
   compare-and-set; everyone takes that list, and the process group of the new generation is
   formed over a key prefix of its own;
2. re-plans every layer with the placement planner's reconfiguration (replicas kept where they
   are, the others placed on members with room, each sourced from a surviving replica);
3. waits until the snapshot cluster has decided every step it was committing (a node lost in the
   middle aborts them) and agrees with the others on the last committed step;
4. restores that step: its own part from its daemon, every expert replica new to it with
   ``restore_from`` from the member that snapshotted the expert then (pushed by that member's
   daemon), or, when no member holds it, from the lost node's snapshot (fetched from a replacement
   daemon, or decoded from parity);
5. goes on training from that step. What happened is returned (``Recovery``) with the plan's
   probability of keeping every expert for that many lost members.

After a reconfiguration the trainer stops snapshotting: the snapshot cluster commits a step only
when every node's trainers captured it, and the lost node's trainer is gone, so no later step could
commit. The last committed step stays the one before the first failure, and a later failure whose
experts the placement does not cover falls back to it (every member restores its state of that
step, the experts from whoever held them then).

Why the agreement is safe: a generation has at most one member list (the compare-and-set), and a
process joins a generation's process group only with its place in that list, so members of one
generation never disagree on who is in it. A member is left out only if it had not checked in and
the failure detector reported its node lost; if it was alive after all, it finds itself missing
from the list and stops, which is what its loss would have meant anyway. A listed member that dies
before the group forms makes the group's rendezvous time out, and the survivors go on to the next
generation.
"""

from __future__ import annotations

import datetime
import gc
import threading
import traceback
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .core import Error
from .moe import ExpertParallel, LayerPlan, Transfer, recovery_probability
from .torch_helpers import Client, initialize_optimizer_state

_SEALED_PROBE = "\0unsealed"  # never a member list: compare_set answers it for a missing key
_KEEP_ALIVES_PER_TIMEOUT = 5


class Rendezvous:
    """The job's members, generation by generation, in a store every member reaches (a
    ``torch.distributed`` store: a file on a shared filesystem, a TCPStore on a host that outlives
    the job's nodes).

    The failure detector is a keep-alive: from ``start`` on, a thread of every member bumps a
    counter of its own in the store ``keep_alive_hz`` times per ``lost_after``; a member whose
    counter has not moved for ``lost_after`` while another waits for it is lost. It watches the
    trainer, not its node's daemon: a trainer that died on a node whose daemon lives (or was
    replaced) is lost all the same."""

    def __init__(self, store, node: int,
                 lost_after: datetime.timedelta = datetime.timedelta(seconds=10),
                 timeout: datetime.timedelta = datetime.timedelta(minutes=5),
                 poll_seconds: float = 0.02) -> None:
        self._store = store
        self.node = node
        self.lost_after = lost_after
        self.timeout = timeout
        self._poll = poll_seconds
        self._keeping_alive: Optional[threading.Thread] = None

    def start(self) -> None:
        """Starts this member's keep-alive (a daemon thread, for the life of the process)."""
        if self._keeping_alive is not None:
            return
        interval = max(self.lost_after.total_seconds() / _KEEP_ALIVES_PER_TIMEOUT, self._poll)

        def keep_alive() -> None:
            while True:
                self._store.add(self._alive_key(self.node), 1)
                time.sleep(interval)

        self._keeping_alive = threading.Thread(target=keep_alive, name="moesnap-keep-alive",
                                               daemon=True)
        self._keeping_alive.start()

    def join(self, generation: int, members: Sequence[int]) -> None:
        """Forms the default process group of ``generation`` over ``members`` (ranks in their
        order). Collectives then fail after ``timeout`` at the latest."""
        dist.init_process_group("gloo", store=dist.PrefixStore(f"generation{generation}/group",
                                                               self._store),
                                rank=list(members).index(self.node), world_size=len(members),
                                timeout=self.timeout)

    def agree(self, generation: int, previous: Sequence[int]) -> List[int]:
        """The members of ``generation`` after a failure in the one before it, whose members were
        ``previous``: those that checked in before the list was sealed. Raises ABORTED when this
        node is not on the sealed list, DEADLINE_EXCEEDED when no list is sealed within the
        timeout."""
        self._store.add(self._present_key(generation, self.node), 1)
        deadline = time.monotonic() + self.timeout.total_seconds()
        seen: Dict[int, Tuple[int, float]] = {}  # member -> (its counter, when it last moved)
        while True:
            sealed = self._sealed(generation)
            if sealed is None:
                now = time.monotonic()
                present = [m for m in previous
                           if self._store.add(self._present_key(generation, m), 0) > 0]
                absent = [m for m in previous if m not in present]
                for member in absent:
                    count = self._store.add(self._alive_key(member), 0)
                    if member not in seen or seen[member][0] != count:
                        seen[member] = (count, now)
                if all(now - seen[m][1] >= self.lost_after.total_seconds() for m in absent):
                    sealed = self._seal(generation, present)
            if sealed is not None:
                if self.node not in sealed:
                    raise Error("ABORTED", f"node {self.node} is not among the members "
                                           f"{sealed} of generation {generation}: the others "
                                           f"found it lost")
                return sealed
            if time.monotonic() > deadline:
                raise Error("DEADLINE_EXCEEDED",
                            f"generation {generation}: members {absent} neither checked in nor "
                            f"went silent within {self.timeout}")
            time.sleep(self._poll)

    def _alive_key(self, node: int) -> str:
        return f"alive/{node}"

    def _present_key(self, generation: int, node: int) -> str:
        return f"generation{generation}/present/{node}"

    def _sealed(self, generation: int) -> Optional[List[int]]:
        value = self._store.compare_set(f"generation{generation}/members", _SEALED_PROBE,
                                        _SEALED_PROBE)
        return None if value == _SEALED_PROBE.encode() else _parse_members(value)

    def _seal(self, generation: int, members: List[int]) -> List[int]:
        value = self._store.compare_set(f"generation{generation}/members", "",
                                        ",".join(str(m) for m in members))
        return _parse_members(value)  # ours, or the list another member sealed first


def _parse_members(value: bytes) -> List[int]:
    return [int(m) for m in value.decode().split(",")]


@dataclass
class Recovery:
    """What ``ElasticExpertParallel.recover`` did."""
    step: int                        # the committed step training goes on from
    generation: int
    lost: List[int]
    members: List[int]
    probability: float               # the lost plan's chance of keeping every expert for len(lost)
    former_members: int
    without_replica: List[str]       # "layer:expert" whose every replica was on lost nodes
    placement_changed: bool          # the committed step was taken under an earlier placement
    moved: Dict[str, List[int]] = field(default_factory=dict)   # this member's new replicas
    sources: Dict[int, str] = field(default_factory=dict)       # restore_from source -> how
    # time.time() at the end of each phase: "failure" (recover called), "membership" (agreed, the
    # new process group formed), "plan", "settle" (the last committed step agreed), "placement"
    # (experts and their process groups configured), "registration" (a new moesnap session with
    # this member's state), "restore" (from this member's daemon), "transfer" (restore_from of
    # the replicas new to it)
    times: Dict[str, float] = field(default_factory=dict)

    @property
    def kept_every_expert(self) -> bool:
        return not self.without_replica and not self.placement_changed

    def describe(self) -> str:
        plan = (f"the plan kept every expert with probability {self.probability:.3f} for "
                f"{len(self.lost)} lost of {self.former_members} nodes")
        if self.kept_every_expert:
            what = (f"every expert kept a replica; moved replicas restored from the surviving "
                    f"replicas' snapshots of step {self.step}")
        else:
            reasons = []
            if self.without_replica:
                reasons.append(f"experts {' '.join(self.without_replica)} lost every replica")
            if self.placement_changed:
                reasons.append(f"step {self.step}, the last committed, was taken under an "
                               f"earlier placement")
            what = f"{'; '.join(reasons)}: fell back to the snapshots of step {self.step}"
        sources = "; ".join(f"from node {node}: {how}" for node, how in sorted(self.sources.items()))
        return (f"recovered at step {self.step} (generation {self.generation}, members "
                f"{self.members}) after losing nodes {self.lost}: {plan}; {what}"
                + (f" ({sources})" if sources else ""))


_Unit = Tuple[str, int]  # (layer name, expert)


class ElasticExpertParallel:
    """A model with ``ExpertParallelMoE`` layers trained by the job's members, surviving the loss
    of members without restarting the others.

    ``plans`` gives every layer's plan over the job's nodes (``LayerPlan.create``); ``node`` is
    this member. ``make_optimizer(parameters)`` builds an Adam or AdamW optimizer (their state
    exists before the first step, so it can be snapshotted and moved); it is called for the dense
    parameters and for each expert replica. ``connect()`` opens a new moesnap session for this
    member (a ``moesnap.Client`` of this member's rank on its node's daemon), or is None to train
    without snapshots (then only ``release`` changes the membership). Not thread-safe.
    """

    def __init__(self, model: nn.Module, plans: Mapping[str, LayerPlan], node: int,
                 rendezvous: Rendezvous,
                 make_optimizer: Callable[[List[nn.Parameter]], torch.optim.Optimizer],
                 connect: Optional[Callable[[], Client]] = None,
                 capacities: Optional[Mapping[int, float]] = None,
                 log: Callable[[str], None] = print) -> None:
        self.model = model
        self.node = node
        self.plans = dict(plans)
        self.generation = 0
        self.snapshots_enabled = connect is not None
        self._parallel = ExpertParallel(model, node, capacities)
        self._rendezvous = rendezvous
        self._make_optimizer = make_optimizer
        self._connect = connect
        self._log = log
        self._client: Optional[Client] = None
        self._dense_optimizer: Optional[torch.optim.Optimizer] = None
        self._expert_optimizers: Dict[_Unit, torch.optim.Optimizer] = {}
        # (step, plans): the plans that trained, and snapshotted, the steps after `step`.
        self._history: List[Tuple[int, Dict[str, LayerPlan]]] = []

    @property
    def members(self) -> List[int]:
        return list(next(iter(self.plans.values())).members)

    @property
    def client(self) -> Optional[Client]:
        return self._client

    # Training -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Generation 0: the process group over the plans' members, this member's experts, the
        optimizers, and the registration of its state with moesnap."""
        self._rendezvous.join(0, self.members)
        self._parallel.configure(self.plans, group=None)
        self._dense_optimizer = self._new_optimizer(self._parallel.dense_parameters())
        self._sync_expert_optimizers()
        self._history = [(0, dict(self.plans))]
        if self._connect is not None:
            self._client = self._connect()
            self._register(self._client)
        self._rendezvous.start()

    def resume(self) -> Optional[int]:
        """After ``start``, in a job started again after all its members stopped (a restart of the
        whole job with the plans it started with): restores the last committed step, the same on
        every member, into this member's state and returns it; None when no member has a
        committed step (a new job). Every member calls it."""
        if self._client is None:
            raise Error("FAILED_PRECONDITION", "resuming needs moesnap snapshots (connect)")
        step = self._settle(new_job_allowed=True)
        if step is None:
            return None
        restored = self._client.restore(step)
        if restored != step:
            raise Error("DATA_LOSS", f"the restore gave step {restored}, not the agreed {step}")
        return step  # taken under the plans the job started with, as start() recorded

    def zero_grad(self) -> None:
        for parameter in self.model.parameters():
            parameter.grad = None

    def synchronize_gradients(self) -> None:
        """Dense gradients summed over the members, each expert's over its replicas."""
        self._parallel.synchronize_gradients()

    def optimizer_step(self) -> None:
        """Waits until the previous snapshot is copied (its tensors are about to change), then
        steps every optimizer."""
        if self._client is not None and self.snapshots_enabled:
            try:
                self._client.wait_captured()
            except Error as error:  # a snapshot lost is no reason to stop training
                self._log(f"snapshot not captured: {error}")
        self._dense_optimizer.step()
        for optimizer in self._expert_optimizers.values():
            optimizer.step()

    def snapshot(self, step: int) -> None:
        """Snapshots this member's state at ``step`` (right after the optimizer step); never
        raises for a failure of the snapshot system."""
        if self._client is None or not self.snapshots_enabled:
            return
        try:
            self._client.snapshot(step)
        except Error as error:
            self._log(f"snapshot of step {step} not taken: {error}")

    def optimizer_states(self) -> Dict[str, dict]:
        """``state_dict()`` of the dense optimizer ("dense") and of each expert replica's (by
        ``<layer>.experts.<index>``)."""
        states = {"dense": self._dense_optimizer.state_dict()}
        for unit in sorted(self._expert_optimizers):
            states[self._unit_name(unit)] = self._expert_optimizers[unit].state_dict()
        return states

    # Failures -----------------------------------------------------------------------------------

    def recover(self, failure: BaseException) -> Recovery:
        """Called by every survivor once a collective failed (``failure``): agrees on the new
        membership, re-plans, restores the last committed step and returns what it did. Re-raises
        ``failure`` when no member was lost (every member checked in)."""
        times = {"failure": time.time()}
        if self._client is None:
            raise Error("FAILED_PRECONDITION", "recovery needs moesnap snapshots (connect)") \
                from failure
        # The failure's frames hold the process groups (a collective's locals): cleared, the
        # groups are freed when destroyed, and their connections close.
        traceback.clear_frames(failure.__traceback__)
        self._tear_down()
        previous = self.members
        members = self._rendezvous.agree(self.generation + 1, previous)
        lost = sorted(set(previous) - set(members))
        if not lost:
            raise failure
        self.generation += 1
        self._rendezvous.join(self.generation, members)
        times["membership"] = time.time()

        before = self.plans
        plans: Dict[str, LayerPlan] = {}
        transfers: Dict[str, List[Transfer]] = {}
        for name in sorted(before):
            plans[name], transfers[name] = before[name].after_loss(lost)
        probability = recovery_probability([before[name] for name in sorted(before)], len(lost))
        times["plan"] = time.time()

        step = self._settle()
        times["settle"] = time.time()
        snapshotted = self._plans_at(step)
        placement_changed = snapshotted is not self._history[-1][1]
        self.plans = plans
        changes = self._parallel.configure(plans, group=None)
        self._sync_expert_optimizers()
        self._history = [(since, kept) for since, kept in self._history if since < step]
        self._history.append((step, dict(plans)))
        times["placement"] = time.time()

        client = self._connect()  # a new session: this member's regions are the new replicas'
        self._register(client)
        self._client = client  # the old session ends with the old client
        times["registration"] = time.time()
        sources = self._restore(step, snapshotted, None if placement_changed else transfers,
                                times)
        if self.snapshots_enabled:
            self.snapshots_enabled = False
            self._log(f"snapshots paused after step {step}: the snapshot cluster cannot commit a "
                      f"step without the lost nodes' trainers")
        return Recovery(
            step=step, generation=self.generation, lost=lost, members=members,
            probability=probability, former_members=len(previous),
            without_replica=[f"{name}:{t.expert}" for name in sorted(transfers)
                             for t in transfers[name] if t.source is None],
            placement_changed=placement_changed,
            moved={name: added for name, (added, _) in changes.items() if added},
            sources=sources, times=times)

    def release(self, leaving: Sequence[int], step: int) -> bool:
        """A planned departure, without failure or snapshots: every member calls it after the
        same step. The plans drop ``leaving``; each replica new to a member is sent to it over
        the current process group by the lowest member holding it; then the leaving members are
        done (False is returned to them) and the others form the next generation (True)."""
        before = self.plans
        plans = {name: before[name].after_loss(leaving)[0] for name in sorted(before)}
        staged: Dict[_Unit, torch.Tensor] = {}
        rank = self.members.index
        for name in sorted(plans):
            for expert in range(plans[name].experts):
                source = before[name].holders(expert)[0]
                for target in plans[name].holders(expert):
                    if target in before[name].holders(expert):
                        continue
                    if self.node == source:
                        dist.send(self._flatten((name, expert)), rank(target))
                    elif self.node == target:
                        buffer = self._template((name, expert))
                        dist.recv(buffer, rank(source))
                        staged[(name, expert)] = buffer
        if self.node in leaving:
            self._tear_down()
            return False
        self._tear_down()
        self.generation += 1
        self.plans = plans
        self._rendezvous.join(self.generation, self.members)
        self._parallel.configure(plans, group=None)
        self._sync_expert_optimizers()
        for unit, buffer in staged.items():
            self._unflatten(unit, buffer)
        self._history.append((step, dict(plans)))
        return True

    # Internals ----------------------------------------------------------------------------------

    def _new_optimizer(self, parameters: List[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = self._make_optimizer(parameters)
        initialize_optimizer_state(optimizer)  # Adam/AdamW only: state to snapshot and move
        return optimizer

    def _sync_expert_optimizers(self) -> None:
        """One optimizer per held expert replica: new ones for new replicas, none for dropped."""
        held = {(name, int(key)): module for name, layer in self._parallel.layers.items()
                for key, module in layer.experts.items()}
        for unit in list(self._expert_optimizers):
            if unit not in held:
                del self._expert_optimizers[unit]
        for unit in sorted(held):
            if unit not in self._expert_optimizers:
                self._expert_optimizers[unit] = self._new_optimizer(list(held[unit].parameters()))

    def _expert(self, unit: _Unit) -> nn.Module:
        return self._parallel.layers[unit[0]].experts[str(unit[1])]

    def _unit_tensors(self, unit: _Unit) -> List[torch.Tensor]:
        """An expert replica's state: its parameters, then its optimizer's state tensors."""
        parameters = list(self._expert(unit).parameters())
        optimizer = self._expert_optimizers[unit]
        return parameters + [value for p in parameters for value in optimizer.state[p].values()]

    def _flatten(self, unit: _Unit) -> torch.Tensor:
        return torch.cat([tensor.detach().reshape(-1).float() for tensor in
                          self._unit_tensors(unit)])

    def _template(self, unit: _Unit) -> torch.Tensor:
        """A buffer the size of ``unit``'s flattened state, from a freshly built replica."""
        expert = self._parallel.layers[unit[0]].build_expert(unit[1])  # only its shapes count
        optimizer = self._new_optimizer(list(expert.parameters()))
        count = sum(p.numel() + sum(v.numel() for v in optimizer.state[p].values())
                    for p in expert.parameters())
        return torch.empty(count, dtype=torch.float32)

    def _unflatten(self, unit: _Unit, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for tensor in self._unit_tensors(unit):
                count = tensor.numel()
                tensor.copy_(flat[offset:offset + count].view_as(tensor))
                offset += count

    def _registrations(self) -> List[Tuple[str, object]]:
        """What this member registers with moesnap, by registration name: the dense tensors, the
        dense optimizer, and per held expert its module and its optimizer. The names depend
        only on the layer and expert, so a replica of an expert registers the same names on any
        member (restore_from needs that)."""
        expert_tensors = {id(p) for p in self._parallel.expert_parameters()}
        dense = [(f"dense.{key}", tensor)
                 for key, tensor in self.model.state_dict(keep_vars=True).items()
                 if id(tensor) not in expert_tensors]
        registrations: List[Tuple[str, object]] = dense
        registrations.append(("dense.optimizer", self._dense_optimizer))
        for unit in sorted(self._expert_optimizers):
            registrations.append((self._unit_name(unit), self._expert(unit)))
            registrations.append((self._unit_name(unit) + ".optimizer",
                                  self._expert_optimizers[unit]))
        return registrations

    @staticmethod
    def _unit_name(unit: _Unit) -> str:
        return f"{unit[0]}.experts.{unit[1]}"

    def _register(self, client: Client) -> None:
        for name, item in self._registrations():
            if isinstance(item, torch.optim.Optimizer):
                client.register_optimizer(name, item)
            elif isinstance(item, nn.Module):
                client.register_module(name, item)
            else:
                client.register_tensor(name, item)

    def _unit_regions(self, client: Client, unit: _Unit) -> List[str]:
        name = self._unit_name(unit)
        return client.regions_of(name) + client.regions_of(name + ".optimizer")

    def _dense_regions(self, client: Client) -> List[str]:
        names = [name for name, item in self._registrations()
                 if name.startswith("dense.") and name != "dense.optimizer"]
        return [region for name in names for region in client.regions_of(name)] + \
            client.regions_of("dense.optimizer")

    def _tear_down(self) -> None:
        """Destroys every process group, closing its connections: a member still blocked in a
        collective with this one fails at once instead of waiting for the timeout."""
        self._parallel.release_groups()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # a group in a reference cycle would keep its connections open

    def _settle(self, new_job_allowed: bool = False) -> Optional[int]:
        """Waits until the snapshot cluster decided every step this member snapshotted (a node
        lost mid-commit aborts them), then agrees with the other members on the last committed
        step; the same on every member, or an error. None when no member has one and
        ``new_job_allowed``."""
        last = self._client.last_snapshot
        if last is not None:
            try:
                self._client.wait_committed(last)
            except Error:
                pass  # aborted: the committed state is an earlier step
        deadline = time.monotonic() + self._rendezvous.timeout.total_seconds()
        while True:
            latest = self._client.latest_committed()
            steps: List[Optional[int]] = [None] * dist.get_world_size()
            dist.all_gather_object(steps, latest)
            if new_job_allowed and steps == [None] * len(steps):
                return None
            if None in steps:
                raise Error("FAILED_PRECONDITION",
                            f"members {self.members} have committed steps {steps}: a member has "
                            f"no committed snapshot to recover from")
            if len(set(steps)) == 1:
                return steps[0]
            # A commit that reached some nodes before its coordinator died: the next coordinator
            # finishes it; every member looks again, in step with the others.
            if time.monotonic() > deadline:
                raise Error("FAILED_PRECONDITION", f"members {self.members} disagree on the last "
                                                   f"committed step: {steps}")
            time.sleep(0.05)

    def _plans_at(self, step: int) -> Dict[str, LayerPlan]:
        """The plans under which ``step`` was trained and snapshotted."""
        for since, plans in reversed(self._history):
            if since < step:
                return plans
        raise Error("FAILED_PRECONDITION", f"no placement is known for step {step}")

    def _restore(self, step: int, snapshotted: Mapping[str, LayerPlan],
                 transfers: Optional[Mapping[str, List[Transfer]]],
                 times: Dict[str, float]) -> Dict[int, str]:
        """Writes step ``step`` into this member's state: the dense part and the replicas it
        snapshotted then from its own daemon, every other replica with ``restore_from`` from a
        member that snapshotted the expert then (the planner's choice when ``transfers`` applies),
        else from the lowest-numbered lost node that did. Returns each restore_from source and how
        it served; ``times`` gets when the local restore ("restore") and the transfers
        ("transfer") ended."""
        local = self._dense_regions(self._client)
        remote: Dict[int, List[str]] = {}
        members = set(self.members)
        for name in sorted(self.plans):
            then = snapshotted[name]
            chosen = {t.expert: t.source for t in (transfers or {}).get(name, [])
                      if t.target == self.node and t.source is not None}
            for expert in self.plans[name].placement[self.node]:
                regions = self._unit_regions(self._client, (name, expert))
                if expert in then.placement[self.node]:
                    local += regions
                    continue
                holders = [n for n in range(then.nodes) if expert in then.placement[n]]
                live = [n for n in holders if n in members]
                source = chosen.get(expert, live[expert % len(live)] if live else holders[0])
                remote.setdefault(source, []).extend(regions)
        restored = self._client.restore(names=local)
        if restored != step:
            raise Error("DATA_LOSS", f"the local restore gave step {restored}, not {step}")
        times["restore"] = time.time()
        sources: Dict[int, str] = {}
        for source in sorted(remote):
            restored = self._client.restore_from(source, remote[source])
            if restored.step != step:
                raise Error("DATA_LOSS", f"node {source}'s snapshot holds step {restored.step}, "
                                         f"not {step}")
            sources[source] = ("a surviving replica's snapshot" if source in members else
                               "lost node's snapshot, decoded from parity" if restored.decoded
                               else f"lost node's snapshot, from daemon {restored.node}")
        times["transfer"] = time.time()
        return sources
