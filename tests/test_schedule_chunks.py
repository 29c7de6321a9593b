"""Interleaved 1F1B with different chunk counts per position (:mod:`whale.plan.schedule_chunks`): the round-robin
map gives the interleaved schedule action for action, every map is complete and deadlock-free, the simulator
times it (a hand-off within one position is free) and the errors name the values."""

from __future__ import annotations

import itertools

import pytest

from whale.plan import schedule as sch
from whale.plan.schedule_chunks import chunked_1f1b, counts_of, positions_from_counts, round_robin, schedule_for
from whale.plan.schedule_sim import simulate_lanes

ScheduleError, interleaved_1f1b = sch.ScheduleError, sch.interleaved_1f1b


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
def test_round_robin_map_is_the_interleaved_schedule(p, v):
    for m in (p, 2 * p, 3 * p):
        assert chunked_1f1b(round_robin(p, v), m) == interleaved_1f1b(p, m, v)
        assert schedule_for("Interleaved1F1B", p, m, v, round_robin(p, v)) == interleaved_1f1b(p, m, v)


def test_every_map_is_complete_and_deadlock_free():
    """Every chunk -> position map with each of p positions used, up to 6 chunks (p = 2, 3): the schedule
    validates (each position runs F and B of each of its chunks and micro-batches once, F before B, no deadlock
    with blocking receives), including maps with local hand-offs (consecutive chunks on one position)."""
    built = 0
    for p in (2, 3):
        for c in range(p, 7):
            for pos in itertools.product(range(p), repeat=c):
                if len(set(pos)) < p:
                    continue
                for m in (p, 2 * p):
                    sched = chunked_1f1b(pos, m)
                    sch.validate(sched, m, pos)
                    assert [len(acts) for acts in sched] == [2 * m * k for k in counts_of(pos)]
                    built += 1
    assert built > 1000


def test_counts_give_a_round_robin_over_the_positions_left():
    assert positions_from_counts((3, 2)) == (0, 1, 0, 1, 0)
    assert positions_from_counts((3, 1)) == (0, 1, 0, 0)
    assert positions_from_counts((1, 2, 2)) == (0, 1, 2, 1, 2)
    assert positions_from_counts((2, 2)) == round_robin(2, 2)
    assert counts_of((0, 1, 0, 0)) == (3, 1)
    with pytest.raises(ScheduleError, match="at least one chunk"):
        positions_from_counts((2, 0))


def test_three_chunks_on_one_position_warm_up_from_its_chunks():
    """Counts (3, 1), 2 micro-batches: position 0 runs its chunks depth first (the hand-off from chunk 2 to 3
    is local), position 1 its one chunk."""
    text = sch.format_schedule(chunked_1f1b(positions_from_counts((3, 1)), 2))
    assert text == ("stage 0: F0 F1 F0c1 F1c1 F0c2 B0c2 F1c2 B1c2 B0c1 B1c1 B0 B1\n"
                    "stage 1: F0 F1 B0 B1")


def test_the_simulator_times_a_local_hand_off_as_free():
    """Map (0, 1, 0, 0), 1 s per chunk action, a transfer of 10 s: position 0's forward of chunk 3 (its local
    chunk 2) starts as soon as the rank is free (no transfer from chunk 2 on the same position), chunk 2's
    only after chunk 1's output crossed from position 1."""
    pos = (0, 1, 0, 0)
    sched = chunked_1f1b(pos, 2)
    ones = [[[3.0] * 2], [[1.0] * 2]]  # position 0: 3 chunks of 1 s each; position 1: one chunk of 1 s
    out = simulate_lanes(sched, ones, ones, [[10.0], [10.0]], positions=pos)
    f = {(label, mb): (start, end) for s, _, label, mb, start, end in out["events"] if s == 0}
    assert f[("Fc2", 0)][0] == f[("Fc1", 1)][1] < f[("Fc1", 0)][1] + 10.0  # local: the rank's order only
    assert f[("Fc1", 0)][0] == 1.0 + 10.0 + 1.0 + 10.0  # chunk 0, transfer, chunk 1 on position 1, transfer
    rr = simulate_lanes(interleaved_1f1b(2, 4, 2), [[[1.0] * 4]] * 2, [[[2.0] * 4]] * 2, [[0.5]] * 2)
    assert simulate_lanes(interleaved_1f1b(2, 4, 2), [[[1.0] * 4]] * 2, [[[2.0] * 4]] * 2, [[0.5]] * 2,
                          positions=round_robin(2, 2)) == rr


def test_memory_of_a_position_follows_its_own_chunks():
    sched = chunked_1f1b(positions_from_counts((3, 1)), 2)
    assert sch.max_in_flight(sched[0]) == 5 and sch.max_in_flight(sched[1]) == 2
    assert sch.max_in_flight(sched[0], [1.0, 2.0, 4.0]) == 1 + 1 + 2 + 2 + 4


def test_bad_maps_are_one_line_errors():
    with pytest.raises(ScheduleError, match="multiple of the 2 positions"):
        chunked_1f1b((0, 1, 0), 3)
    with pytest.raises(ScheduleError, match="each of the 3 positions a chunk"):
        chunked_1f1b((0, 2, 0), 3)
    with pytest.raises(ScheduleError, match="need schedule 'Interleaved1F1B'"):
        schedule_for("1F1B", 2, 2, 2, (0, 1, 0, 0))
