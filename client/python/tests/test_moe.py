"""moesnap.moe and moesnap.elastic in process: the proportional split and routing, the plans after
losses, the membership agreement (threads on one in-memory store), the layer against a dense
computation of the same mixture (three gloo processes), and elastic restore between two ranks of
one daemon."""

import datetime
import os
import tempfile
import threading
import time
from fractions import Fraction
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moesnap
import moesnap.elastic
import moesnap.moe
from moesnap.moe import LayerPlan, replica_shares, route

LOADS = [40, 5, 120, 15, 60, 10, 200, 25]


@pytest.mark.parametrize("tokens", [0, 1, 2, 7, 100, 1001])
@pytest.mark.parametrize("capacities", [[1.0], [1.0, 1.0, 1.0], [1.0, 2.0, 1.0], [0.5, 3.0],
                                        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
def test_shares_sum_to_the_tokens_within_one_of_exact(tokens, capacities):
    shares = replica_shares(tokens, capacities)
    assert sum(shares) == tokens
    total = sum(Fraction(c) for c in capacities)
    for share, capacity in zip(shares, capacities):
        assert abs(share - tokens * Fraction(capacity) / total) < 1, (shares, capacities)


def test_shares_break_ties_toward_the_earlier_replica():
    assert replica_shares(1, [1.0, 1.0]) == [1, 0]
    assert replica_shares(2, [1.0, 1.0, 1.0]) == [1, 1, 0]
    assert replica_shares(3, [1.0, 2.0, 1.0]) == [1, 1, 1]  # remainders 3/4, 1/2, 3/4


def test_shares_refuse_capacities_that_are_not_positive():
    for capacities in ([], [1.0, 0.0], [-1.0]):
        with pytest.raises(moesnap.Error) as error:
            replica_shares(4, capacities)
        assert error.value.code == "INVALID_ARGUMENT"


def test_route_cuts_each_expert_into_contiguous_runs_per_replica():
    counts = [[3, 0, 5], [4, 1, 0], [0, 2, 6]]   # counts[source][expert]
    replicas = [[0, 1], [2], [0, 1, 2]]
    capacities = [[1.0, 1.0], [1.0], [2.0, 1.0, 1.0]]
    sends = route(counts, replicas, capacities)
    for expert in range(3):
        total = sum(row[expert] for row in counts)
        expected = replica_shares(total, capacities[expert])
        taken = [sum(sends[source][expert][j] for source in range(3))
                 for j in range(len(replicas[expert]))]
        assert taken == expected
        # Walking the sources in order, replica j's tokens come after replica j-1's.
        sequence = [j for source in range(3) for j, count in enumerate(sends[source][expert])
                    for _ in range(count)]
        assert sequence == sorted(sequence)
        for source in range(3):
            assert sum(sends[source][expert]) == counts[source][expert]


def test_route_refuses_tokens_for_an_expert_nobody_holds():
    with pytest.raises(moesnap.Error) as error:
        route([[1]], [[]], [[]])
    assert error.value.code == "FAILED_PRECONDITION"


def test_plans_after_losses_use_only_the_members_left():
    plan = LayerPlan.create(LOADS, nodes=4, slots=5, min_replicas=2)
    assert all(len(plan.holders(expert)) >= 2 for expert in range(8))
    after, transfers = plan.after_loss([1])
    assert after.members == (0, 2, 3) and after.placement[1] == ()
    assert all(t.source is not None and t.source != 1 and t.target != 1 for t in transfers)
    for transfer in transfers:  # every transfer lands where the new plan puts the expert
        assert transfer.expert in after.placement[transfer.target]
    again, more = after.after_loss([0])
    assert again.members == (2, 3) and again.placement[0] == again.placement[1] == ()
    assert sorted({e for node in again.placement for e in node}) == list(range(8))
    assert any(t.source is None for t in more)  # experts only node 0 held: from the snapshots
    with pytest.raises(moesnap.Error) as error:
        after.after_loss([1])
    assert error.value.code == "INVALID_ARGUMENT" and "not members" in error.value.message


def test_recovery_probability_of_layers_together():
    plan = LayerPlan.create(LOADS, nodes=4, slots=5, min_replicas=2)
    assert moesnap.moe.recovery_probability([plan], 1) == 1.0
    one = moesnap.moe.recovery_probability([plan], 2)
    # Two layers with the same placement fail together: the same probability as one.
    assert moesnap.moe.recovery_probability([plan, plan], 2) == one
    after = plan.after_loss([0])[0]
    assert moesnap.moe.recovery_probability([after], 0) == 1.0
    # By hand: a second loss keeps every expert only if no expert is held by that node alone.
    alone = [node for node in after.members
             if any(after.holders(expert) == [node] for expert in range(8))]
    expected = 1 - len(alone) / len(after.members)
    assert moesnap.moe.recovery_probability([after], 1) == pytest.approx(expected)


def agree_in_threads(store, members: List[int], checking_in: List[int], lost_after: float
                     ) -> Dict[int, object]:
    """Members in `checking_in` run Rendezvous.agree for generation 1 at once; returns each one's
    list or error."""
    results: Dict[int, object] = {}

    def run(member: int) -> None:
        rendezvous = moesnap.elastic.Rendezvous(
            store, member, lost_after=datetime.timedelta(seconds=lost_after),
            timeout=datetime.timedelta(seconds=30), poll_seconds=0.005)
        rendezvous.start()
        try:
            results[member] = rendezvous.agree(1, members)
        except moesnap.Error as error:
            results[member] = error

    threads = [threading.Thread(target=run, args=(member,)) for member in checking_in]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_members_that_check_in_agree_without_waiting_for_a_timeout():
    started = time.monotonic()
    results = agree_in_threads(dist.HashStore(), [0, 1, 2], [0, 1, 2], lost_after=60)
    assert results == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert time.monotonic() - started < 30  # the 60 s silence was never needed


def test_a_silent_member_is_left_out_once_its_keep_alive_stops():
    store = dist.HashStore()
    store.add("alive/3", 1)  # member 3 was alive once, then went silent
    results = agree_in_threads(store, [0, 1, 2, 3], [0, 2, 1], lost_after=0.3)
    assert results == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


def test_a_member_found_lost_stops_instead_of_joining():
    store = dist.HashStore()
    store.compare_set("generation1/members", "", "0,2")  # the others sealed without member 1
    results = agree_in_threads(store, [0, 1, 2], [1], lost_after=60)
    assert isinstance(results[1], moesnap.Error) and results[1].code == "ABORTED", results


def test_one_list_per_generation_whoever_seals_first():
    store = dist.HashStore()
    store.compare_set("generation1/members", "", "0,1")
    results = agree_in_threads(store, [0, 1, 2], [0, 1, 2], lost_after=60)
    assert results[0] == results[1] == [0, 1]
    assert isinstance(results[2], moesnap.Error) and results[2].code == "ABORTED"


# The layer against a dense computation -----------------------------------------------------------

DIMENSION, EXPERTS, TOKENS_PER_RANK = 8, 6, 5


def small_expert(index: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(100 + index)
        return nn.Sequential(nn.Linear(DIMENSION, 12), nn.GELU(), nn.Linear(12, DIMENSION))


def compare_with_dense(rank: int, world: int, store_path: str) -> None:
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    layer = moesnap.moe.ExpertParallelMoE(DIMENSION, EXPERTS, small_expert)
    model = nn.Sequential(layer)
    plan = LayerPlan.create([5, 1, 9, 3, 2, 7], nodes=world, slots=3, min_replicas=1)
    parallel = moesnap.moe.ExpertParallel(model, rank, capacities={0: 1.0, 1: 2.0, 2: 1.0})
    parallel.configure({"0": plan})
    assert sorted(int(key) for key in layer.experts) == sorted(plan.placement[rank])
    inputs = torch.randn(TOKENS_PER_RANK * world, DIMENSION,
                         generator=torch.Generator().manual_seed(7))
    mine = inputs[rank * TOKENS_PER_RANK:(rank + 1) * TOKENS_PER_RANK].clone().requires_grad_()
    outputs = layer(mine)
    (outputs ** 2).sum().backward()
    parallel.synchronize_gradients()

    # Every expert on every token, the gate keeping the top 2: the same mixture, all local.
    torch.manual_seed(0)
    gate = moesnap.moe.ExpertParallelMoE(DIMENSION, EXPERTS, small_expert).gate
    experts = [small_expert(index) for index in range(EXPERTS)]
    everything = inputs.clone().requires_grad_()
    weights, chosen = torch.softmax(gate(everything), -1).topk(2, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    every = torch.stack([expert(everything) for expert in experts], 1)
    expected = (weights.unsqueeze(-1) *
                every.gather(1, chosen.unsqueeze(-1).expand(-1, -1, DIMENSION))).sum(1)
    (expected ** 2).sum().backward()

    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    torch.testing.assert_close(outputs, expected[rows])
    torch.testing.assert_close(mine.grad, everything.grad[rows])
    torch.testing.assert_close(layer.gate.weight.grad, gate.weight.grad)  # summed over ranks
    for key, expert in layer.experts.items():  # summed over each expert's replicas
        for actual, reference in zip(expert.parameters(), experts[int(key)].parameters()):
            torch.testing.assert_close(actual.grad, reference.grad)
    assert sum(layer.last_tokens) == 2 * TOKENS_PER_RANK * world
    dist.destroy_process_group()


def test_layer_equals_the_dense_mixture_with_replicas_on_three_ranks():
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(compare_with_dense,
                                    args=(3, os.path.join(directory, "store")), nprocs=3)


# Elastic restore by region names from the client ----------------------------------------------------

def test_an_expert_moves_to_another_rank_with_its_optimizer_state(daemon):
    def expert_with_optimizer(seed: int):
        torch.manual_seed(seed)
        expert = small_expert(seed)
        optimizer = torch.optim.Adam(expert.parameters(), lr=1e-2)
        moesnap.initialize_optimizer_state(optimizer)
        return expert, optimizer

    holder = moesnap.Client(daemon.agent_socket, 0)
    expert, optimizer = expert_with_optimizer(1)
    holder.register_module("layer.experts.3", expert)
    holder.register_optimizer("layer.experts.3.optimizer", optimizer)
    expert(torch.randn(4, DIMENSION)).sum().backward()
    optimizer.step()  # moments and step count that a fresh replica does not have
    holder.snapshot(1)
    holder.wait_committed(1)

    taker = moesnap.Client(daemon.agent_socket, 1)
    replica, replica_optimizer = expert_with_optimizer(2)
    taker.register_module("layer.experts.3", replica)
    taker.register_optimizer("layer.experts.3.optimizer", replica_optimizer)
    names = taker.regions_of("layer.experts.3") + taker.regions_of("layer.experts.3.optimizer")
    assert names == holder.regions_of("layer.experts.3") + \
        holder.regions_of("layer.experts.3.optimizer")
    restored = taker.restore_from(0, names)
    assert restored.step == 1 and not restored.decoded
    for actual, expected in zip(replica.parameters(), expert.parameters()):
        assert torch.equal(actual, expected)
        for key, value in optimizer.state[expected].items():
            assert torch.equal(replica_optimizer.state[actual][key], value), key
    with pytest.raises(moesnap.Error) as error:
        taker.regions_of("layer.experts.4")
    assert error.value.code == "NOT_FOUND"


# A whole job started again resumes its last committed step -------------------------------------

def train_elastic(node: int, socket_path: str, store_path: str, steps: int, out: str) -> None:
    """One member of a 2-node elastic job on one daemon: start, resume, train up to `steps` with
    snapshots, then save the state it holds and what resume returned to `out` + node + ".pt"."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIMENSION, DIMENSION),
                          moesnap.moe.ExpertParallelMoE(DIMENSION, EXPERTS, small_expert))
    plans = {"1": LayerPlan.create([5, 1, 9, 3, 2, 7], nodes=2, slots=4, min_replicas=1)}
    job = moesnap.elastic.ElasticExpertParallel(
        model, plans, node, moesnap.elastic.Rendezvous(dist.FileStore(store_path, 2), node),
        make_optimizer=lambda parameters: torch.optim.Adam(parameters, lr=1e-2),
        connect=lambda: moesnap.Client(socket_path, node), log=lambda line: None)
    job.start()
    resumed = job.resume()
    for step in range((resumed or 0) + 1, steps + 1):
        inputs = torch.randn(4, DIMENSION, generator=torch.Generator().manual_seed(step * 2 + node))
        loss = (model(inputs) ** 2).mean()
        job.zero_grad()
        loss.backward()
        job.synchronize_gradients()
        job.optimizer_step()
        job.snapshot(step)
    if steps:
        job.client.wait_committed(steps)
    torch.save({"resumed": resumed,
                "model": {key: value.clone() for key, value in model.state_dict().items()},
                "optimizers": job.optimizer_states()}, f"{out}{node}.pt")


def assert_same(actual, expected, where: str) -> None:
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), (where, actual.keys(), expected.keys())
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, (where, actual, expected)


def test_a_job_started_again_resumes_its_last_committed_step(daemon):
    with tempfile.TemporaryDirectory() as directory:
        def run(name: str, steps: int) -> List[dict]:
            torch.multiprocessing.spawn(
                train_elastic, nprocs=2,
                args=(daemon.agent_socket, f"{directory}/{name}.store", steps,
                      f"{directory}/{name}"))
            return [torch.load(f"{directory}/{name}{node}.pt") for node in range(2)]

        first = run("first", 3)
        again = run("again", 0)  # started again: resumes step 3 and trains no further
    for node in range(2):
        assert first[node]["resumed"] is None  # a new job
        assert again[node]["resumed"] == 3
        assert_same(again[node]["model"], first[node]["model"], f"node {node} model")
        assert_same(again[node]["optimizers"], first[node]["optimizers"], f"node {node} optimizers")
