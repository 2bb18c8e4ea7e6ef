"""The placement planner from Python: the same plan as `moesnapctl plan`, as dictionaries."""

import pytest

import moesnap

LOADS = [120, 40, 300, 75, 10, 220, 90, 15]


def test_allocation_placement_and_recovery():
    plan = moesnap.plan(LOADS, nodes=6, slots=2, min_replicas=1)
    assert plan["replicas"] == [1, 1, 4, 1, 1, 2, 1, 1]
    assert sum(len(node) for node in plan["placement"]) == 12
    assert all(len(set(node)) == len(node) <= 2 for node in plan["placement"])
    recovery = plan["recovery"]
    assert [row["failed"] for row in recovery] == list(range(7))
    assert recovery[0]["overlap"] == 1.0 and recovery[6]["overlap"] == 0.0
    assert all(row["exact"] for row in recovery)
    assert plan["reconfiguration"] is None


def test_reconfiguration_never_sources_from_a_failed_node():
    plan = moesnap.plan(LOADS, nodes=6, slots=2, failed=[1, 4])
    reconfiguration = plan["reconfiguration"]
    assert reconfiguration["survivors"] == [0, 2, 3, 5]
    assert reconfiguration["placement"][1] == [] and reconfiguration["placement"][4] == []
    for transfer in reconfiguration["transfers"]:
        assert transfer["from"] not in (1, 4)
        assert transfer["to"] not in (1, 4)


def test_impossible_plan_is_an_error_naming_the_limit():
    with pytest.raises(moesnap.Error) as error:
        moesnap.plan(LOADS, nodes=2, slots=2, min_replicas=3)
    assert error.value.code == "INVALID_ARGUMENT"
    assert "min_replicas 3 exceeds the 2 nodes" in error.value.message
