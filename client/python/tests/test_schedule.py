"""The sparse schedule from Python: the same worked example as the C++ test, through the bindings."""

import pytest

import moesnap


def small_model():
    experts = [moesnap.Operator(f"layer0.expert{i}", True, 12, 2, tokens)
               for i, tokens in enumerate([40, 10, 30, 20])]
    return experts + [moesnap.Operator("layer0.dense", False, 24, 4)]


def test_window_order_and_slots():
    schedule = moesnap.SparseSchedule.build(small_model(), iteration_seconds=1,
                                            copy_bytes_per_second=33, every_step_bytes=1)
    assert schedule.window == 3
    assert schedule.order == [1, 3, 2, 0, 4]
    assert schedule.captured_in_slot(0) == [1, 3]
    assert [schedule.slot_bytes(slot) for slot in range(3)] == [33, 29, 25]
    assert schedule.captured_by(3, 0) and not schedule.captured_by(0, 0)
    assert schedule.with_window(moesnap.SparseSchedule.agreed_window([3, 4])).window == 4


def test_budget_too_small_is_an_error_with_the_figures():
    with pytest.raises(moesnap.Error) as error:
        moesnap.SparseSchedule.build(small_model(), 1, 20, 1)
    assert error.value.code == "RESOURCE_EXHAUSTED"
    assert "needs 25 bytes" in error.value.message
