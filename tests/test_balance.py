"""Intra-TaskGraph balancing (Whale paper, Jia et al., USENIX ATC 2022, §3.3, made exact): property tests
against brute force (the optimality check on random instances is in tests/test_placement.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from whale.plan.plan import PlanError
from whale.plan.shares import whole_shares
from whale.planner.balance import (
    InfeasiblePlanError,
    balance_batch,
    balance_shards,
    max_units,
)

FAST = settings(max_examples=200, deadline=None)


def compositions(total: int, n: int, low: int):
    """Every way to write ``total`` as ``n`` ordered parts, each >= ``low``."""
    if n == 1:
        if total >= low:
            yield (total,)
        return
    for first in range(low, total - low * (n - 1) + 1):
        for rest in compositions(total - first, n - 1, low):
            yield (first, *rest)


def fits(shares, cap, fixed, per) -> bool:
    return all(f + s * per <= c for s, c, f in zip(shares, cap, fixed, strict=True))


@st.composite
def cases(draw, max_devices=4, max_total=12):
    n = draw(st.integers(1, max_devices))
    total = draw(st.integers(n, max_total))
    flops = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    fixed = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    cap = draw(st.lists(st.integers(0, 80), min_size=n, max_size=n))
    per = draw(st.integers(0, 10))
    return total, [float(f) for f in flops], [float(c) for c in cap], [float(f) for f in fixed], float(per)


@FAST
@given(cases())
def test_matches_brute_force_feasibility_and_respects_memory(case):
    total, flops, cap, fixed, per = case
    feasible = any(fits(s, cap, fixed, per) for s in compositions(total, len(flops), 1))
    if feasible:
        shares = balance_batch(total, flops, cap, fixed, per)
        assert sum(shares) == total and min(shares) >= 1
        assert fits(shares, cap, fixed, per)
        assert balance_batch(total, flops, cap, fixed, per) == shares  # deterministic
    else:
        with pytest.raises(InfeasiblePlanError) as e:
            balance_batch(total, flops, cap, fixed, per)
        err = e.value
        assert 0 <= err.device < len(flops) and err.lacking_bytes > 0
        assert err.need_bytes > cap[err.device] == err.capacity_bytes
        assert f"device {err.device}" in str(err) and "lacks" in str(err)
        assert isinstance(err, PlanError) and isinstance(err, ValueError)


@FAST
@given(cases())
def test_only_overloaded_devices_lose_load_and_they_end_at_their_limit(case):
    """Against the shares memory would not bound, memory moves load off overloaded devices only (as the
    paper's Algorithm 1 does), onto devices with room."""
    total, flops, cap, fixed, per = case
    start = whole_shares(total, flops, 1)
    try:
        shares = balance_batch(total, flops, cap, fixed, per)
    except InfeasiblePlanError:
        return
    for i, (a, b) in enumerate(zip(start, shares, strict=True)):
        limit = max_units(cap[i], fixed[i], per, total)
        if a > limit:
            assert b == limit
        else:
            assert b >= a


def finish_certificate(shares, speeds) -> bool:
    """The shares are the min-max optimum of ``shares_i / speed_i``: the slowest device finishes its last
    sample no later than any device would finish one more (so the taken samples are the earliest finishes)."""
    last = max((k * (1.0 / f) for k, f in zip(shares, speeds, strict=True) if k), default=0.0)
    return last <= min((k + 1) * (1.0 / f) for k, f in zip(shares, speeds, strict=True))


@FAST
@given(st.integers(0, 500), st.lists(st.floats(0.1, 100.0), min_size=1, max_size=8))
def test_optimal_and_at_least_the_lower_quota_when_memory_is_ample(total, flops):
    """Exact min-max shares (not largest remainder): a spare sample goes to the device that finishes it first,
    which may lift a fast device above its quota's ceiling but never drops one below its floor."""
    n = len(flops)
    shares = balance_batch(total, flops, [1e18] * n, [0.0] * n, 1.0, min_share=0)
    assert sum(shares) == total and finish_certificate(shares, flops)
    for s, f in zip(shares, flops, strict=True):
        assert s >= int(total * f / sum(flops) - 1e-9)
    if total >= n and all(total * f / sum(flops) >= 1 for f in flops):
        assert balance_batch(total, flops, [1e18] * n, [0.0] * n, 1.0) == shares


@FAST
@given(st.data())
def test_shards_add_up_are_positive_and_fit(data):
    n = data.draw(st.integers(1, 6))
    dim = data.draw(st.integers(n, 400))
    flops = data.draw(st.lists(st.floats(1.0, 50.0), min_size=n, max_size=n))
    per = data.draw(st.floats(0.0, 10.0))
    cap = [data.draw(st.floats(10.0, 5000.0)) for _ in range(n)]
    try:
        shards = balance_shards(dim, flops, cap, [10.0] * n, per)
    except InfeasiblePlanError:
        # Infeasible only if some device cannot hold one element, or all of them together not the dimension.
        limits = [max_units(c, 10.0, per, dim) for c in cap]
        assert min(limits) < 1 or sum(limits) < dim
        return
    assert sum(shards) == dim and min(shards) >= 1
    assert all(10.0 + s * per <= c for s, c in zip(shards, cap, strict=True))


def test_v100_p100_memory_bound_case_moves_load_to_the_v100():
    flops, fixed, per = [15.7e12, 10.6e12], [1e9, 1e9], 1e8
    assert balance_batch(64, flops, [32e9, 16e9], fixed, per) == [38, 26]  # FLOPS-proportional: 64 * 15.7/26.3
    assert balance_batch(64, flops, [32e9, 3e9], fixed, per) == [44, 20]  # P100 holds at most 20 samples
    with pytest.raises(InfeasiblePlanError, match=r"device 0 would need 5\.0 GiB .* lacks 2\.2 GiB"):
        balance_batch(64, flops, [3e9, 3e9], fixed, per)
    with pytest.raises(InfeasiblePlanError, match=r"device 1 needs 1\.0 GiB .* lacks 572\.2 MiB") as e:
        balance_batch(64, flops, [3e9, 5e8], fixed, per)
    assert e.value.device == 1 and e.value.lacking_bytes == pytest.approx(6e8)


def test_receivers_fill_by_earliest_finish():
    # Device 2 (a slow one) is capped at 10 samples; the rest go where the slowest device stays fastest.
    shares = balance_batch(64, [15.7e12] * 2 + [10.6e12] * 2, [3e9, 32e9, 2e9, 16e9], [1e9] * 4, 1e8)
    assert shares == [20, 20, 10, 14]


def test_errors_for_bad_arguments():
    with pytest.raises(ValueError, match="global batch 3 is too small for 4 devices"):
        balance_batch(3, [1.0] * 4, [1.0] * 4, [0.0] * 4, 0.0)
    with pytest.raises(ValueError, match="cannot split a dimension of size 2 over 3 devices"):
        balance_shards(2, [1.0] * 3, [1.0] * 3, [0.0] * 3, 0.0)
    with pytest.raises(ValueError, match="one entry per device"):
        balance_batch(8, [1.0, 1.0], [1.0], [0.0, 0.0], 0.0)
    with pytest.raises(ValueError, match="flops must hold finite numbers > 0"):
        balance_batch(8, [1.0, 0.0], [1.0, 1.0], [0.0, 0.0], 0.0)


def test_large_cluster_is_fast():
    import time

    n = 512
    t = time.perf_counter()
    shares = balance_batch(10**6, [15.7e12 if i % 2 else 10.6e12 for i in range(n)],
                           [1e9 if i % 3 else 1e8 for i in range(n)], [0.0] * n, 5e4)
    assert sum(shares) == 10**6 and time.perf_counter() - t < 1.0
    assert all(s * 5e4 <= (1e9 if i % 3 else 1e8) for i, s in enumerate(shares))


def test_compositions_helper():
    assert sorted(compositions(4, 2, 1)) == [(1, 3), (2, 2), (3, 1)]
    assert len(list(compositions(6, 3, 0))) == len(list(itertools.combinations(range(8), 2)))
