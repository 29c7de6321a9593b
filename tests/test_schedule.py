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
    in_flight_micro_batches,
    make_schedule,
    max_in_flight,
    pending_weight_passes,
    schedule_bubble,
    validate,
)
from whale.plan.schedule_sim import simulate


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


@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3))
def test_interleaved_is_valid_and_its_bubble_is_the_papers(p, k, v):
    """Unit-time simulation (F = 1, B = 2 per stage): idle share (p-1)/(v m + p-1), i.e. bubble time (p-1)/(v m)
    of the ideal step (Narayanan et al. SC'21 §2.2); rank r holds 2(p-r-1)+(v-1)p+1 chunk micro-batches."""
    m = k * p
    sched = make_schedule("Interleaved1F1B", p, m, v)
    validate(sched, m)
    sim = simulate(sched, [1.0] * p, [2.0] * p)
    ideal = 3.0 * m
    assert (sim["step"] - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    for s, idle in enumerate(sim["idle_share"]):
        assert idle == pytest.approx(schedule_bubble("Interleaved1F1B", p, m, v))
        assert max_in_flight(sched[s]) / v == in_flight_micro_batches(s, p, m, "Interleaved1F1B", v)
    assert {a.chunk for acts in sched for a in acts} == set(range(v))


@given(st.integers(1, 6), st.integers(1, 12))
def test_zero_bubble_h1_bubble_is_a_third_of_1f1b_at_1f1b_memory(p, m):
    """T_F = T_B = T_W: ZB-H1 idles (p-1)(T_F + T_B - T_W) per rank against 1F1B's (p-1)(T_F + T_B + T_W)
    (Qi et al. ICLR'24 §3) when m >= p, holding at most 1F1B's peak of min(p, m) micro-batches on any stage."""
    sched = make_schedule("ZB-H1", p, m)
    validate(sched, m)
    sim = simulate(sched, [1.0] * p, [2.0] * p)
    assert sim["step"] == pytest.approx(3.0 * m + (p - 1) + max(0, p - m))
    one_f_one_b = simulate(make_schedule("1F1B", p, m), [1.0] * p, [2.0] * p)["step"] - 3.0 * m
    if m >= p:
        assert sim["step"] - 3.0 * m == pytest.approx(one_f_one_b / 3)
    for s, idle in enumerate(sim["idle_share"]):
        assert idle == pytest.approx(schedule_bubble("ZB-H1", p, m))
        assert max_in_flight(sched[s]) == in_flight_micro_batches(s, p, m, "ZB-H1") <= min(p, m)
    assert sorted(str(a) for a in sched[0] if a.kind == "W") == sorted(f"W{i}" for i in range(m))


def test_interleaved_printout_and_micro_batch_rule():
    text = format_schedule(make_schedule("Interleaved1F1B", 2, 2, 2))
    assert text.splitlines() == ["stage 0: F0 F1 F0c1 F1c1 B0c1 B1c1 B0 B1",
                                 "stage 1: F0 F1 F0c1 B0c1 F1c1 B1c1 B0 B1"]
    with pytest.raises(ScheduleError, match="multiple of the 4 pipeline stages, got 6; use 4 or 8"):
        make_schedule("Interleaved1F1B", 4, 6, 2)
    with pytest.raises(ScheduleError, match="virtual_stages=2 needs schedule 'Interleaved1F1B'"):
        make_schedule("1F1B", 4, 8, 2)


def test_weight_pass_before_its_backward_is_rejected():
    with pytest.raises(ScheduleError, match="W0 comes before B0"):
        validate([[Action("F", 0), Action("W", 0), Action("B", 0)]], 1)


def test_pending_weight_passes_counts_the_w_passes_a_zero_bubble_stage_lets_wait():
    """ZB-H1 at p = 2, m = 4: stage 1 (``F0 B0 F1 B1 W0 ...``) runs B1 with W0 waiting, then both wait; stage 0's
    W follows each B at once; schedules without W passes keep none."""
    zb = make_schedule("ZB-H1", 2, 4)
    assert [pending_weight_passes(zb[s]) for s in range(2)] == [(0, 1), (1, 2)]
    assert pending_weight_passes(make_schedule("1F1B", 2, 4)[1]) == (0, 0)
