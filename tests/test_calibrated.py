"""The search on calibrated costs (whale.planner.steptime.calibrated): it ranks candidates as the whole-step simulator
(whale.planner.steptime.simulate.predict) does, the search on it equals brute force, and Config(auto=True) uses it when
this machine's calibration is cached (no processes)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from tests.test_search import _random_instance, _space, brute_force_check
from whale.cluster import homogeneous_cpu
from whale.plan.plan import Plan, TaskGraph
from whale.planner.calibration_cache import Calibration, UnitTiming
from whale.planner.model_desc import LayerDesc, ModelDesc
from whale.planner.search import Constraints, enumerate_candidates, search
from whale.planner.steptime.calibrated import CalibratedEstimator, type_factors
from whale.planner.steptime.estimate import pool_from_cluster
from whale.planner.steptime.simulate import predict

CAL = Calibration(key="test", p2p_latency=2e-4, p2p_bandwidth=1e9, allreduce_latency=2e-4, allreduce_bandwidth=5e8,
                  optimizer_seconds_per_element=2e-8, segment_overhead=5e-4, step_overhead=1e-3)


def _model(n: int = 6) -> tuple[ModelDesc, list[UnitTiming]]:
    """A small model whose per-call overheads matter (as on CPU): FLOPs alone would rank it differently."""
    layers = [LayerDesc(f"l{i}", 1e8 * (1 + i % 3), 50_000 * (1 + i % 2), 1e4, 2e4) for i in range(n)]
    timings = [UnitTiming(2e-4 * (1 + i % 3), 4e-4 * (1 + i % 3), 1e-3, 3e-3 * (1 + (i == n - 1)))
               for i in range(n)]
    return ModelDesc(tuple(layers)), timings


def _plan(c) -> Plan:
    tgs = tuple(TaskGraph(s, "replicate", c.data_parallel) for s in range(c.stages))
    return Plan(world_size=c.stages * c.data_parallel, task_graphs=tgs, num_replicas=1,
                num_micro_batch=c.num_micro_batch, schedule=c.schedule)


def test_calibrated_estimator_ranks_as_the_simulator():
    model, timings = _model()
    pool = pool_from_cluster(homogeneous_cpu(4))
    est = CalibratedEstimator(model, pool, 16, timings, CAL, type_factors(pool, [1.0] * 4), emulated=True)
    cands = [c for c in enumerate_candidates(len(model.layers), pool.counts, 16, Constraints(split=1), est.cuts,
                                             est.split_ok, all_cuts_below=10**6)
             if c.options.describe() == Constraints().floor.describe()]
    rows = []
    for c in cands:
        edges = [0, *itertools.accumulate(c.stage_layers)]
        costs = [est.stage_cost(a, b) for a, b in itertools.pairwise(edges)]
        rows.append((est(c).step_seconds, predict(_plan(c), costs, None, CAL, 16).step, c))
    worst = max(abs(e / s - 1) for e, s, _ in rows)
    best_est, best_sim = min(rows, key=lambda r: r[0]), min(rows, key=lambda r: r[1])
    print(f"calibrated estimator vs simulator over {len(rows)} candidates: worst rel. gap {worst:.3f}, "
          f"chosen plan's simulated step / simulator's best {best_est[1] / best_sim[1]:.4f}")
    assert len(rows) > 50 and worst < 0.15
    assert best_est[1] / best_sim[1] < 1.02  # the plan the search picks is (within 2%) the simulator's best
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    sim_rank = {i: r for r, i in enumerate(sorted(range(len(rows)), key=lambda i: rows[i][1]))}
    n = len(rows)
    rho = 1 - 6 * sum((r - sim_rank[i]) ** 2 for r, i in enumerate(order)) / (n * (n * n - 1))
    assert rho > 0.95  # Spearman rank correlation


def test_calibration_changes_the_ranking_overheads_favour_fewer_micro_batches():
    model, timings = _model()
    pool = pool_from_cluster(homogeneous_cpu(2))
    cal = CalibratedEstimator(model, pool, 16, timings, CAL, (1.0,), emulated=True)
    got = search(enumerate_candidates(len(model.layers), pool.counts, 16, Constraints(stages=2, split=1),
                                      cal.cuts, cal.split_ok), cal).best.candidate
    heavy = [dataclasses.replace(t, fwd_overhead=0.05, bwd_overhead=0.05) for t in timings]
    slow = CalibratedEstimator(model, pool, 16, heavy, CAL, (1.0,), emulated=True)
    fewer = search(enumerate_candidates(len(model.layers), pool.counts, 16, Constraints(stages=2, split=1),
                                        slow.cuts, slow.split_ok), slow).best.candidate
    assert fewer.num_micro_batch < got.num_micro_batch
    with pytest.raises(ValueError, match="one per layer"):
        CalibratedEstimator(model, pool, 16, timings[:-1], CAL, (1.0,))
    with pytest.raises(ValueError, match="speed factor"):
        CalibratedEstimator(model, pool, 16, timings, CAL, (0.0,))


def test_search_on_calibrated_costs_equals_brute_force():
    rng = random.Random(7)
    worst, feasible = 1.0, 0
    for _ in range(7):
        model, pool, batch = _random_instance(rng)
        timings = [UnitTiming(rng.uniform(1e-5, 1e-3), rng.uniform(1e-5, 2e-3), rng.uniform(0, 2e-3),
                              rng.uniform(0, 4e-3)) for _ in model.layers]
        factors = tuple(rng.uniform(1.0, 3.0) for _ in pool.types)
        est, cands = _space(model, pool, batch, est=CalibratedEstimator(model, pool, batch, timings, CAL, factors,
                                                                         emulated=rng.random() < 0.5))
        checked = brute_force_check(cands, est)
        if checked is None:
            continue
        feasible += 1
        worst = max(worst, checked[0])
    print(f"calibrated search vs brute force: worst ratio {worst:.6f} over {feasible} feasible instances")
    assert worst == 1.0 and feasible >= 3


def test_auto_plan_uses_the_cached_calibration(tmp_path, monkeypatch):
    import whale as wh
    from tests.models import TinyLM, lm_batches, lm_loss
    from whale.frontend import hwplan
    from whale.frontend.autoplan import auto_layout, estimator
    from whale.frontend.unit_keys import unit_keys
    from whale.planner import calibration_cache as cal
    from whale.planner.model_desc import from_profile

    monkeypatch.setenv("WHALE_CALIBRATION", str(tmp_path / "calibration.json"))
    model, batch, loss = TinyLM(stage_layers=(4,), tied=False), lm_batches(1, 8)[0], lm_loss
    cfg = wh.Config(auto=True, cluster=homogeneous_cpu(2))
    prof = hwplan.profile(model, batch, loss_fn=loss)
    desc, pool = from_profile(prof), pool_from_cluster(cfg.cluster)
    est, note = estimator(model, prof, desc, pool, 8, cfg.cluster, cfg, batch, loss)
    assert type(est).__name__ == "DefaultEstimator" and "no calibration cached" in note
    keys = unit_keys(model, batch, prof, loss)
    units = {k: UnitTiming(1e-4, 2e-4, 0.02, 0.04) for k in keys.values()}  # large per-call overheads
    cal.save(dataclasses.replace(CAL, key=cal.machine_key(), units=units))
    got = auto_layout(model, 2, cfg, batch, None, loss)
    assert "cost model: calibrated" in got.notes[-1]
    assert got.config.num_micro_batch == 1  # every micro-batch pays the overheads again
    assert len(from_profile(got.profile).layers) == len(keys) - 1
