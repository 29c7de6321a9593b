"""Hardware-aware virtual stages (:mod:`whale.planner.virtual`): exact against brute force on random small
instances (also when the chunks per position vary), monotone in speed, memory respected, a fast device holding
more chunks, and the bad-input errors."""

from __future__ import annotations

import dataclasses
import random

import pytest

from whale.planner.balance import InfeasiblePlanError
from whale.planner.virtual import VirtualProblem, brute_force, plan_virtual_stages


def _random(rng: random.Random, memory: bool) -> VirtualProblem:
    p, v = rng.choice([(2, 2), (2, 3), (3, 2)])
    n = rng.randint(p * v, p * v + 3)
    speeds = [1.0, rng.choice([0.5, 0.7, 1.0])]
    flops = [rng.uniform(0.5, 3.0) for _ in range(n)]
    act = [rng.uniform(0.0, 2.0) for _ in range(n)]
    static = [rng.uniform(0.0, 3.0) for _ in range(n)]
    cap = [1e9, 1e9] if not memory else [rng.uniform(8, 20), rng.uniform(4, 12)]
    counts = [rng.randint(1, p), 0]
    counts[1] = p - counts[0] + rng.randint(0, 1)
    fwd, bwd = ([[k * f / 3 / s for s in speeds] for f in flops] for k in (1, 2))
    extra = {}
    if rng.random() < 0.5:  # backward temporaries, boundary buffers and a weight tied to the first unit
        extra = {"unit_temp": [rng.uniform(0.0, 2.0) for _ in range(n)],
                 "unit_out": [rng.uniform(0.0, 0.5) for _ in range(n)],
                 "unit_tied": [[]] * (n - 1) + [[(0, rng.uniform(0.0, 2.0))]]}
    return VirtualProblem(fwd, bwd, static, act, counts, cap, p, v, p * rng.choice([1, 2]), **extra)


def _against_brute_force(pb: VirtualProblem):
    """``(the planner's cut, the brute-force optimum)``; ``(None, inf)`` when brute force finds no feasible cut,
    after checking that the planner then raises :class:`InfeasiblePlanError`."""
    best = brute_force(pb)
    if best == float("inf"):
        with pytest.raises(InfeasiblePlanError):
            plan_virtual_stages(pb)
        return None, best
    return plan_virtual_stages(pb), best


def test_exact_against_brute_force_on_random_small_instances():
    """Worst ratio of the planner's predicted step over the brute-force optimum, 60 instances (a third with
    tight memory): 1.0, and infeasible exactly when brute force finds nothing."""
    rng = random.Random(0)
    worst, solved = 0.0, 0
    for k in range(60):
        pb = _random(rng, memory=k % 3 == 0)
        cut, best = _against_brute_force(pb)
        if cut is None:
            continue
        assert sum(cut.counts) == len(pb.unit_fwd) and min(cut.counts) >= 1
        caps = [min(pb.type_capacity[t] for t, c in enumerate(g) if c) for g in cut.groups]
        assert all(b <= c for b, c in zip(cut.peak_bytes, caps, strict=True))
        worst = max(worst, cut.step / best)
        solved += 1
    assert solved >= 40
    assert worst == pytest.approx(1.0, rel=1e-12), f"worst ratio {worst}"


def test_chunk_counts_exact_against_brute_force_on_random_small_instances():
    """With ``vary_counts`` the search also picks the chunks per position: worst ratio of the planner's step
    over the brute-force optimum (every group sequence, count vector, the even one among them, and cut) over 48
    instances (a third with tight memory) is 1.0, and infeasible exactly when brute force finds nothing."""
    rng = random.Random(1)
    worst, solved, uneven = 0.0, 0, 0
    for k in range(48):
        pb = dataclasses.replace(_random(rng, memory=k % 3 == 0), vary_counts=True)
        cut, best = _against_brute_force(pb)
        if cut is None:
            continue
        assert sorted(cut.positions) == sorted(s for s, k in enumerate(cut.chunks_per_position) for _ in range(k))
        assert min(cut.chunks_per_position) >= 1 and sum(cut.counts) == len(pb.unit_fwd)
        worst = max(worst, cut.step / best)
        solved += 1
        uneven += len(set(cut.chunks_per_position)) > 1
    print(f"chunk counts: worst ratio {worst} over {solved} solved instances ({uneven} with unequal counts)")
    assert solved >= 30 and uneven >= 2
    assert worst == pytest.approx(1.0, rel=1e-12), f"worst ratio {worst}"


def test_a_fast_device_holds_more_chunks_when_that_is_faster():
    """8 equal layers, a device three times faster than the other, 2 positions x 2 chunks, 2 micro-batches:
    the fast position holds 3 chunks (the last hand-off local) and the step beats every even-count cut."""
    pb = VirtualProblem([[1.0, 3.0]] * 8, [[2.0, 6.0]] * 8, [0.0] * 8, [0.0] * 8, [1, 1], [1.0, 1.0], 2, 2, 2,
                        vary_counts=True)
    cut = plan_virtual_stages(pb)
    even = plan_virtual_stages(dataclasses.replace(pb, vary_counts=False))
    fast = 0 if cut.groups[0] == (1, 0) else 1
    assert cut.chunks_per_position[fast] == 3 and (cut.step, even.step) == (42.0, 45.0)  # as docs/pipelines-...
    assert cut.step == pytest.approx(brute_force(pb)) and even.chunks_per_position == (2, 2)


def test_a_fast_device_gets_more_layers_and_positions_follow_speed():
    """Two positions, one twice as fast: its chunks hold more of 12 equal layers than the slow one's."""
    pb = VirtualProblem([[1.0, 2.0]] * 12, [[2.0, 4.0]] * 12, [0.0] * 12, [0.0] * 12, [1, 1], [1.0, 1.0], 2, 2, 4)
    cut = plan_virtual_stages(pb)
    fast = 0 if cut.groups[0] == (1, 0) else 1
    assert sum(cut.counts[fast::2]) > sum(cut.counts[1 - fast::2])
    assert cut.step == pytest.approx(brute_force(pb))


def test_memory_moves_layers_off_a_small_device():
    """Same speeds, but type 1 holds only 3 layers' bytes: it gets at most 3."""
    pb = VirtualProblem([[1.0, 1.0]] * 8, [[2.0, 2.0]] * 8, [1.0] * 8, [0.0] * 8, [1, 1], [100.0, 3.0], 2, 2, 2)
    cut = plan_virtual_stages(pb)
    small = 0 if cut.groups[0] == (0, 1) else 1
    assert sum(cut.counts[small::2]) <= 3 and cut.peak_bytes[small] <= 3.0


def test_bad_input_and_infeasible_are_one_line_errors():
    with pytest.raises(ValueError, match="cannot cut 3 units into 2 positions x 2 chunks"):
        plan_virtual_stages(VirtualProblem([[1.0]] * 3, [[1.0]] * 3, [0.0] * 3, [0.0] * 3, [2], [1.0], 2, 2, 2))
    with pytest.raises(InfeasiblePlanError, match="no cut of 4 units") as info:
        plan_virtual_stages(VirtualProblem([[1.0]] * 4, [[1.0]] * 4, [1.0] * 4, [0.0] * 4, [2], [1.0], 2, 2, 2))
    assert "\n" not in str(info.value)


def test_past_the_search_budget_a_cut_is_still_found_and_marked_not_exact():
    pb = VirtualProblem([[1.0, 2.0]] * 12, [[2.0, 4.0]] * 12, [0.0] * 12, [0.0] * 12, [1, 1], [1.0, 1.0], 2, 2, 4)
    cut = plan_virtual_stages(pb, budget=5)
    assert not cut.exact and sum(cut.counts) == 12 and cut.step >= brute_force(pb)
    assert plan_virtual_stages(pb).exact
    vary = dataclasses.replace(pb, vary_counts=True)  # the chunk counts' phase has a budget of its own
    cut = plan_virtual_stages(vary, budget=5)
    assert not cut.exact and sum(cut.chunks_per_position) == 4 and cut.step >= brute_force(vary)


def test_position_bytes_count_temporaries_boundaries_and_tied_copies():
    """Two units, one per position (p = 2, v = 1, m = 2): position 0 holds 2 micro-batches in flight, position 1
    one; each adds its unit's backward temporaries and three buffers of the boundary between them, and position
    1 its own copy of the weight its unit shares with unit 0."""
    pb = VirtualProblem([[1.0]] * 2, [[2.0]] * 2, [10.0, 20.0], [1.0, 1.0], [2], [1e9], 2, 1, 2,
                        unit_temp=[2.0, 4.0], unit_out=[1.0, 0.0], unit_tied=[[], [(0, 5.0)]])
    cut = plan_virtual_stages(pb)
    assert cut.peak_bytes == (10.0 + 2 * 1.0 + 2.0 + 3 * 1.0, 20.0 + 1.0 + 4.0 + 3 * 1.0 + 5.0)
    with pytest.raises(ValueError, match="unit_tied"):
        VirtualProblem([[1.0]] * 2, [[2.0]] * 2, [10.0, 20.0], [1.0, 1.0], [2], [1e9], 2, 1, 2,
                       unit_tied=[[(0, 1.0)], []]).check()
