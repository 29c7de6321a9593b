"""Schedules as data, checked with no processes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from whale.plan.schedule import (
    Action,
    ScheduleError,
    bubble_fraction,
    format_schedule,
    make_schedule,
    max_in_flight,
    simulate,
    validate,
)


@given(st.integers(1, 8), st.integers(1, 16), st.sampled_from(["1F1B", "GPipe"]))
def test_every_schedule_is_valid(stages, mbs, kind):
    sched = make_schedule(kind, stages, mbs)
    validate(sched, mbs)  # F before B, each once, every send matched, no deadlock
    for s, acts in enumerate(sched):
        assert len(acts) == 2 * mbs
        if kind == "1F1B":
            assert max_in_flight(acts) <= stages - s
        else:
            assert max_in_flight(acts) == mbs


def test_one_f_one_b_printout():
    text = format_schedule(make_schedule("1F1B", 2, 4))
    assert text.splitlines() == ["stage 0: F0 F1 B0 F2 B1 F3 B2 B3", "stage 1: F0 B0 F1 B1 F2 B2 F3 B3"]


def test_backward_before_forward_is_rejected():
    bad = [[Action("B", 0), Action("F", 0)]]
    with pytest.raises(ScheduleError, match="B0 comes before F0"):
        validate(bad, 1)


def test_missing_micro_batch_is_rejected():
    with pytest.raises(ScheduleError, match="cover micro-batches"):
        validate([[Action("F", 0), Action("B", 0)]], 2)


def test_deadlock_is_detected():
    # stage 0 waits for B0's gradient before running F1; stage 1 waits for F1 before running B0
    s0 = [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
    s1 = [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate([s0, s1], 2)


def test_unknown_schedule():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        make_schedule("interleaved", 2, 2)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 1), (1, 5)])
@pytest.mark.parametrize("kind", ["1F1B", "GPipe"])
def test_simulated_bubble_matches_theory_on_equal_stages(p, m, kind):
    sim = simulate(make_schedule(kind, p, m), [1.0] * p, [2.0] * p)
    assert sim["step"] == pytest.approx((m + p - 1) * 3.0)
    for idle in sim["idle_share"]:
        assert idle == pytest.approx(bubble_fraction(p, m))
