"""Exact placement (issue 13, part 4) against brute force on random small instances: whole batch shares
(min-max of per-device time within memory) and the joint stage cut + device assignment of a pipeline.
The worst ratios to the exhaustive optimum are printed (``pytest -s``) and must be exactly 1.0."""

from __future__ import annotations

import itertools
import random

import pytest

from whale.plan.schedule import in_flight_micro_batches
from whale.plan.shares import min_max_shares, whole_shares
from whale.planner.balance import InfeasiblePlanError, balance_batch, max_units
from whale.planner.partition import partition_layers, stage_times
from whale.planner.placement import compositions, place_stages, placement_work


def _all_shares(total: int, lo: int, hi: list[int]):
    """Every vector with ``lo <= b_i <= hi[i]`` adding up to ``total``."""
    if len(hi) == 1:
        if lo <= total <= hi[0]:
            yield (total,)
        return
    for first in range(lo, min(hi[0], total) + 1):
        for rest in _all_shares(total - first, lo, hi[1:]):
            yield (first, *rest)


def _share_case(rng: random.Random):
    n = rng.randint(2, 5)
    total = rng.randint(0, 20)
    unit = [rng.choice([1.0, 0.5, 1.5, 3.0]) * rng.uniform(0.1, 5.0) for _ in range(n)]
    fixed = [rng.choice([0.0, rng.uniform(0.0, 10.0)]) for _ in range(n)]
    cap = [rng.randint(0, 12) for _ in range(n)]
    return total, unit, fixed, rng.choice([0, 0, 1]), cap


def test_min_max_shares_match_brute_force():
    rng = random.Random(13)
    worst, checked, infeasible = 1.0, 0, 0
    for _ in range(300):
        total, unit, fixed, lo, cap = _share_case(rng)
        cost = lambda b, fixed=fixed, unit=unit: max(f + k * t for f, k, t in zip(fixed, b, unit, strict=True))  # noqa: E731
        opt = min((cost(b) for b in _all_shares(total, lo, cap)), default=None)
        if opt is None:
            infeasible += 1
            with pytest.raises(ValueError, match="cannot share"):
                min_max_shares(total, unit, fixed, lo, cap)
            continue
        mine = min_max_shares(total, unit, fixed, lo, cap)
        assert sum(mine) == total and all(lo <= b <= c for b, c in zip(mine, cap, strict=True))
        assert min_max_shares(total, unit, fixed, lo, cap) == mine  # deterministic
        worst, checked = max(worst, cost(mine) / opt if opt > 0 else 1.0 + cost(mine)), checked + 1
    print(f"\nmin_max_shares: {checked} feasible + {infeasible} infeasible instances, worst ratio {worst!r}")
    assert worst == 1.0 and checked > 150 and infeasible > 10


def test_balance_batch_matches_brute_force_within_memory():
    rng = random.Random(7)
    worst, checked = 1.0, 0
    for _ in range(300):
        n, total = rng.randint(2, 5), rng.randint(5, 20)
        flops = [float(rng.choice([9.3, 10.6, 15.7, 19.5, 67.0])) for _ in range(n)]
        cap, fixed, per = [float(rng.randint(0, 100)) for _ in range(n)], [float(rng.randint(0, 20))] * n, 7.0
        limits = [max_units(c, f, per, total) for c, f in zip(cap, fixed, strict=True)]
        cost = lambda b, flops=flops: max(k * (1.0 / f) for k, f in zip(b, flops, strict=True))  # noqa: E731
        opt = min((cost(b) for b in _all_shares(total, 1, limits)), default=None) if min(limits) >= 1 else None
        if opt is None:
            with pytest.raises(InfeasiblePlanError, match="lacks"):
                balance_batch(total, flops, cap, fixed, per)
            continue
        worst, checked = max(worst, cost(balance_batch(total, flops, cap, fixed, per)) / opt), checked + 1
    print(f"\nbalance_batch: {checked} feasible instances, worst ratio {worst!r}")
    assert worst == 1.0 and checked > 100


def test_issue_example_spare_row_goes_to_the_fast_device():
    p100, h100 = 10.6e12, 67e12
    assert balance_batch(12, [p100] * 3 + [h100], [16e9] * 3 + [80e9], [0.0] * 4, 1e6) == [1, 1, 1, 9]
    assert whole_shares(12, [p100] * 3 + [h100], min_share=1) == [1, 1, 1, 9]


def test_infeasible_shares_name_every_device_and_its_bytes():
    with pytest.raises(InfeasiblePlanError, match=r"device 0 holds 20 in 2\.8 GiB, device 1 holds 20") as e:
        balance_batch(64, [15.7e12, 10.6e12], [3e9, 3e9], [1e9, 1e9], 1e8)
    assert e.value.device == 0 and e.value.lacking_bytes > 0


# --- joint stage cut and device assignment -------------------------------------------------------------------
def _brute_placement(sec, mem, act, types, caps, widths, in_flight, orders=None):
    """Exhaustive: every distinct assignment of the devices (a list of type ids) to the stage slots (or only
    ``orders``), every cut; the optimum, or None when nothing fits."""
    n, S = len(sec), len(widths)
    best = None
    for perm in orders or set(itertools.permutations(types, sum(widths))):
        groups = [perm[sum(widths[:s]):sum(widths[:s + 1])] for s in range(S)]
        for cut in itertools.combinations(range(1, n), S - 1):
            bounds = list(zip((0, *cut), (*cut, n), strict=True))
            fits = all(sum(mem[i:j]) + in_flight[s] * sum(act[i:j]) <= min(caps[t] for t in groups[s])
                       for s, (i, j) in enumerate(bounds))
            if fits:
                t = max(max(sum(sec[k][d] for k in range(i, j)) for d in groups[s]) for s, (i, j) in enumerate(bounds))
                best = t if best is None else min(best, t)
    return best


def _placement_case(rng: random.Random):
    T, S = rng.randint(2, 3), rng.randint(2, 4)
    widths = [1] * S if rng.random() < 0.7 or S > 2 else [rng.randint(1, 2) for _ in range(S)]
    n = rng.randint(S, 7)
    devices = sum(widths) + rng.choice([0, 0, 1])
    types = sorted(rng.randrange(T) for _ in range(devices))
    counts = [types.count(t) for t in range(T)]
    speed = [rng.randint(1, 6) for _ in range(T)]
    sec = [[rng.randint(1, 30) * 6 // speed[t] for t in range(T)] for _ in range(n)]
    mem, act = [rng.randint(0, 40) for _ in range(n)], [rng.randint(0, 20) for _ in range(n)]
    caps = [rng.randint(30, 200) for _ in range(T)]
    return sec, mem, act, types, counts, caps, widths, [in_flight_micro_batches(s, S, 4) for s in range(S)]


def test_place_stages_matches_brute_force():
    rng = random.Random(2022)
    worst, feasible, infeasible, by_memory, false_infeasible = 1.0, 0, 0, 1.0, 0
    for _ in range(300):
        sec, mem, act, types, counts, caps, widths, fl = _placement_case(rng)
        opt = _brute_placement(sec, mem, act, types, caps, widths, fl)
        memory_order = sorted(types, key=lambda t: -caps[t])[:sum(widths)]  # the paper's order, for the record
        old = _brute_placement(sec, mem, act, types, caps, widths, fl, [tuple(memory_order)])
        false_infeasible += old is None and opt is not None
        by_memory = max(by_memory, old / opt if old and opt else 1.0)
        groups = [tuple(memory_order[sum(widths[:s]):sum(widths[:s + 1])].count(t) for t in range(len(counts)))
                  for s in range(len(widths))]
        try:  # with the groups fixed, only the cut is chosen: exact for that order too
            assert place_stages(sec, mem, act, counts, caps, widths, fl, groups=groups).bottleneck == old
        except InfeasiblePlanError:
            assert old is None
        if opt is None:
            infeasible += 1
            with pytest.raises(InfeasiblePlanError, match="lacking"):
                place_stages(sec, mem, act, counts, caps, widths, fl)
            continue
        p = place_stages(sec, mem, act, counts, caps, widths, fl)
        assert sum(p.counts) == len(sec) and min(p.counts) >= 1 and max(p.seconds) == p.bottleneck
        assert all(sum(g) == w for g, w in zip(p.groups, widths, strict=True))
        assert [sum(g[t] for g in p.groups) <= counts[t] for t in range(len(counts))]
        worst, feasible = max(worst, p.bottleneck / opt if opt else 1.0 + p.bottleneck), feasible + 1
    print(f"\nplace_stages: {feasible} feasible + {infeasible} infeasible instances, worst ratio {worst!r} "
          f"(memory order + best cut: worst ratio {by_memory:.2f}, {false_infeasible} false infeasible)")
    assert worst == 1.0 and feasible > 150 and infeasible > 10


def test_issue_example_memory_order_is_4x_slower():
    # Layer costs [88, 71, 384] (FLOPs) on devices of speed [157, 670, 670]; the slow device has the least memory,
    # so the memory order runs it last, on the 384 layer: 384 / 157 = 2.45 against 0.57.
    flops, speed = [88.0, 71.0, 384.0], [670.0, 157.0]  # type 0: two fast devices with more memory
    memory_order = max(stage_times(partition_layers(flops, [0.0] * 3, [670.0, 670.0, 157.0], [2e9, 2e9, 1e9]),
                                   flops, [670.0, 670.0, 157.0]))
    p = place_stages([[f / s for s in speed] for f in flops], [0.0] * 3, [0.0] * 3, [2, 1], [2e9, 1e9], [1] * 3,
                     [3, 2, 1])
    assert p.groups[2] == (1, 0) and p.bottleneck == pytest.approx(384 / 670)  # a fast device on the 384 layer
    assert memory_order == pytest.approx(384 / 157) and memory_order / p.bottleneck > 4


def test_issue_example_no_false_infeasibility():
    # compute [62, 49, 74], static [39, 37, 37], activations [1, 7, 20], speeds [106, 93], capacity [42, 16218]:
    # the memory order (device 1 first) has no cut; device 0 first with cut [1, 2] fits.
    flops, static, act = [62.0, 49.0, 74.0], [39.0, 37.0, 37.0], [1.0, 7.0, 20.0]
    with pytest.raises(InfeasiblePlanError):
        partition_layers(flops, static, [93.0, 106.0], [16218.0, 42.0], act, [2, 1])
    speed, caps = [93.0, 106.0], [16218.0, 42.0]  # types by memory, largest first
    p = place_stages([[f / s for s in speed] for f in flops], static, act, [1, 1], caps, [1, 1], [2, 1])
    assert p.counts == (1, 2) and p.groups == ((0, 1), (1, 0))


def test_ties_keep_the_memory_order_and_short_early_stages():
    p = place_stages([[1.0, 1.0]] * 4, [0.0] * 4, [0.0] * 4, [1, 1], [2e9, 1e9], [1, 1], [2, 1])
    assert p.groups == ((1, 0), (0, 1)) and p.counts == (2, 2)


def test_compositions_and_bad_input():
    assert compositions(2, [1, 2]) == [(1, 1), (0, 2)]
    with pytest.raises(ValueError, match="need 3 devices"):
        place_stages([[1.0]] * 3, [0.0] * 3, [0.0] * 3, [2], [1.0], [1, 1, 1], [3, 2, 1])
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        place_stages([[1.0]] * 2, [0.0] * 2, [0.0] * 2, [3], [1.0], [1, 1, 1], [3, 2, 1])
    with pytest.raises(ValueError, match="adding up to the stage's width"):
        place_stages([[1.0]] * 2, [0.0] * 2, [0.0] * 2, [2], [1.0], [1, 1], [2, 1], groups=[(2,), (0,)])
    assert placement_work([1, 1], [1, 1], 9) == 600  # 1 + 2 states x 2 groups x 10^2


def test_planner_places_the_gpt_head_on_the_fast_device_and_the_plan_records_it(monkeypatch):
    """``wh.plan_model`` on a V100 (rank 0, more memory) + P100: the memory order would run the V100 first;
    the exact placement runs the P100 first and the V100 on the heavy head (lm_head), records the order in
    ``device_order`` and keeps it through the memory fitting (apply_hardware). Above the search budget the
    planner keeps the memory order and says so."""
    import whale as wh
    from examples.gpt.model import for_plan
    from whale.cluster import ClusterSpec
    from whale.frontend import hwplan

    model, batch, loss = for_plan(n_layer=2, n_embd=64, vocab_size=2048, seq_len=32, batch=8)
    config = wh.Config(num_micro_batch=4, cluster=ClusterSpec.from_dict({"nodes": [{"devices": ["V100-32GB",
                                                                                                 "P100-16GB"]}]}))
    plan = wh.plan_model(model, 2, config, sample_batch=batch, loss_fn=loss)
    assert plan.device_order == (1, 0) and plan.coords(0) == (1, 0) and plan.rank_of(0, 0) == 1
    assert "lm_head" in plan.stage_cuts[1].units and plan.devices == ("V100-32GB", "P100-16GB")
    assert any(n.startswith("pipeline placement") and "stage 0: 1 x P100-16GB" in n for n in plan.notes)
    assert wh.Plan.from_json(plan.to_json()) == plan
    monkeypatch.setattr(hwplan, "PLACEMENT_WORK_LIMIT", 0.0)
    plan = wh.plan_model(model, 2, config, sample_batch=batch, loss_fn=loss)
    assert plan.device_order == () and any("devices in memory order" in n for n in plan.notes)
