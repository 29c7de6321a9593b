"""Inter-TaskGraph (pipeline) balancing (Whale paper, Jia et al., USENIX ATC 2022, §3.3): exact contiguous cuts,
checked against brute force."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from whale.planner.balance import InfeasiblePlanError
from whale.planner.partition import (
    order_devices_by_memory,
    partition_layers,
    stage_memory,
    stage_times,
    uniform_partition,
)


def cuts(n: int, s: int):
    """Every way to cut ``n`` layers into ``s`` contiguous non-empty stages, as layer counts."""
    if s == 1:
        yield (n,)
        return
    for first in range(1, n - s + 2):
        for rest in cuts(n - first, s - 1):
            yield (first, *rest)


@st.composite
def pipelines(draw):
    n = draw(st.integers(1, 8))
    S = draw(st.integers(1, min(n, 4)))
    ints = lambda lo, hi, k: draw(st.lists(st.integers(lo, hi), min_size=k, max_size=k))  # noqa: E731
    return dict(
        layer_flops=[float(x) for x in ints(0, 30, n)],
        layer_mem=[float(x) for x in ints(0, 10, n)],
        layer_act_mem=[float(x) for x in ints(0, 4, n)],
        stage_flops=[float(x) for x in ints(1, 5, S)],
        stage_mem_capacity=[float(x) for x in ints(0, 60, S)],
    )


@settings(max_examples=300, deadline=None)
@given(pipelines(), st.booleans())
def test_exact_against_brute_force(p, gpipe):
    n, S = len(p["layer_flops"]), len(p["stage_flops"])
    in_flight = [3] * S if gpipe else None  # GPipe with 3 micro-batches, or 1F1B's default S - s
    fl = in_flight or [S - s for s in range(S)]

    def ok(c):
        mem = stage_memory(c, p["layer_mem"], p["layer_act_mem"], fl)
        return all(m <= cap for m, cap in zip(mem, p["stage_mem_capacity"], strict=True))

    feasible = [c for c in cuts(n, S) if ok(c)]
    if not feasible:
        with pytest.raises(InfeasiblePlanError) as e:
            partition_layers(**p, in_flight=in_flight)
        assert 0 <= e.value.device < S and e.value.lacking_bytes > 0
        assert f"stage {e.value.device}" in str(e.value) and "lacking" in str(e.value)
        return
    best = min(max(stage_times(c, p["layer_flops"], p["stage_flops"])) for c in feasible)
    counts = partition_layers(**p, in_flight=in_flight)
    assert sum(counts) == n and len(counts) == S and min(counts) >= 1
    assert ok(counts)
    assert max(stage_times(counts, p["layer_flops"], p["stage_flops"])) == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert partition_layers(**p, in_flight=in_flight) == counts  # deterministic


def test_faster_devices_get_more_layers():
    # 8 equal layers on 2 fast + 2 slow stages: [3, 3, 1, 1] beats uniform [2, 2, 2, 2] (1.5 vs 2 time units).
    counts = partition_layers([1.0] * 8, [1.0] * 8, [2.0, 2.0, 1.0, 1.0], [100.0] * 4)
    assert counts == [3, 3, 1, 1]
    assert max(stage_times(counts, [1.0] * 8, [2.0, 2.0, 1.0, 1.0])) == 1.5
    assert max(stage_times(uniform_partition(8, 4), [1.0] * 8, [2.0, 2.0, 1.0, 1.0])) == 2.0


def test_memory_caps_a_stage_and_in_flight_counts():
    # Stage 0 holds 4 micro-batches under 1F1B: 2 layers need 2 + 4 * 0.2 = 2.8 <= 3 bytes, 3 layers do not fit.
    counts = partition_layers([1.0] * 8, [1.0] * 8, [2.0, 2.0, 1.0, 1.0], [3.0, 100.0, 100.0, 100.0],
                              layer_act_mem=[0.1] * 8)
    assert counts[0] == 2
    assert stage_memory(counts, [1.0] * 8, [0.1] * 8) == pytest.approx(
        [2 + 4 * 0.2, counts[1] * (1 + 0.3), counts[2] * (1 + 0.2), counts[3] * (1 + 0.1)])
    # With one micro-batch in flight everywhere, stage 0 may take 3 layers again.
    assert partition_layers([1.0] * 8, [1.0] * 8, [2.0, 2.0, 1.0, 1.0], [3.4, 100.0, 100.0, 100.0],
                            layer_act_mem=[0.1] * 8, in_flight=[1, 1, 1, 1]) == [3, 3, 1, 1]


def test_infeasible_names_stage_and_bytes():
    with pytest.raises(InfeasiblePlanError, match=r"closest cut \[2, 2, 2, 2\] still needs 2 B on stage 0 "
                                                   r"\(capacity 1 B\), lacking 1 B") as e:
        partition_layers([1.0] * 8, [1.0] * 8, [2.0, 2.0, 1.0, 1.0], [1.0] * 4)
    assert (e.value.device, e.value.need_bytes, e.value.capacity_bytes) == (0, 2.0, 1.0)


def test_argument_errors_and_helpers():
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 non-empty stages"):
        partition_layers([1.0] * 2, [0.0] * 2, [1.0] * 3, [1.0] * 3)
    with pytest.raises(ValueError, match="one entry per stage"):
        partition_layers([1.0] * 4, [0.0] * 4, [1.0] * 2, [1.0] * 3)
    with pytest.raises(ValueError, match="stage_flops must hold finite numbers > 0"):
        partition_layers([1.0] * 4, [0.0] * 4, [1.0, 0.0], [1.0] * 2)
    with pytest.raises(ValueError):
        uniform_partition(3, 4)
    assert uniform_partition(10, 4) == [3, 3, 2, 2]
    assert uniform_partition(4, 4) == [1, 1, 1, 1]
    assert order_devices_by_memory([16e9, 32e9, 16e9, 32e9]) == [1, 3, 0, 2]
    assert order_devices_by_memory([]) == []


def test_large_pipeline_plans_quickly():
    n, S = 200, 16
    t = time.perf_counter()
    counts = partition_layers([1.0 + (i % 5) for i in range(n)], [1.0] * n, [1.0 + s % 2 for s in range(S)],
                              [1e9] * S)
    assert sum(counts) == n and time.perf_counter() - t < 2.0
