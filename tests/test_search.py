"""The plan search (whale.planner.search + whale.planner.steptime.estimate) against brute force, its constraints and
errors, models described without weights (meta device), and ``whale plan --auto``."""

from __future__ import annotations

import argparse
import random
import resource

import pytest
import torch

from whale.cluster import ClusterSpec, NodeSpec, get_device_type
from whale.frontend.autoplan import describe_module
from whale.planner.memory import MemoryOptions
from whale.planner.model_desc import LayerDesc, ModelDesc, ModelDescError, transformer
from whale.planner.search import Constraints, NoFeasiblePlanError, enumerate_candidates, search
from whale.planner.steptime.estimate import DefaultEstimator, DevicePool, plan_search, pool_from_cluster


def _random_instance(rng: random.Random) -> tuple[ModelDesc, DevicePool, int]:
    """A tiny model (2-5 layers, maybe an MoE layer) on 2-8 devices of one or two types, tight memory."""
    layers = []
    for i in range(rng.randint(2, 5)):
        moe = rng.random() < 0.3
        params = rng.randint(1, 400) * 1000
        layers.append(LayerDesc(f"l{i}", rng.uniform(1e6, 5e8), params, rng.uniform(1e3, 2e5), rng.uniform(1e3, 5e4),
                                "moe" if moe else rng.choice(["dense", "attention", "other"]),
                                experts=4 if moe else 1, expert_params=params if moe else 0))
    names = rng.sample(["V100-32GB", "P100-16GB", "T4", "A100-40GB"], rng.randint(1, 2))
    counts = tuple(rng.choice([1, 2, 4]) for _ in names)
    types = tuple(get_device_type(n) for n in names)
    cap = tuple(rng.uniform(2e6, 3e7) for _ in names)
    pool = DevicePool(types, counts, cap, tuple(rng.uniform(1e6, 4e7) for _ in names), rng.choice([1, 2, 4]),
                      rng.uniform(1e9, 3e11), rng.uniform(1e8, 1e10), rng.uniform(0, 1e-5))
    return ModelDesc(tuple(layers)), pool, rng.choice([4, 8, 12, 16])


def _space(model, pool, batch, cons=None, est=None):
    """(estimator, every candidate of the space) for a random instance; ``est`` defaults to the datasheet one."""
    cons = cons or Constraints()
    est = est or DefaultEstimator(model, pool, batch)
    return est, list(enumerate_candidates(len(model.layers), pool.counts, batch, cons, est.cuts, est.split_ok,
                                          [t.memory_bytes for t in pool.types], all_cuts_below=10**6))


def brute_force_check(cands, est):
    """Score every candidate (brute force) and search; asserts the search returns the brute-force optimum.
    Returns ``(search's step seconds / the optimum's, [(seconds, candidate)] of those that fit, search result)``,
    or ``None`` when no candidate fits."""
    scored = [(e.step_seconds, c) for c in cands if (e := est(c)).fits]
    if not scored:
        return None
    best_t, best_c = min(scored)
    got = search(cands, est)
    assert got.best.candidate == best_c
    return got.best.estimate.step_seconds / best_t, scored, got


def test_search_equals_brute_force_on_random_instances():
    rng = random.Random(13)
    worst, feasible, infeasible = 1.0, 0, 0
    for _ in range(25):
        model, pool, batch = _random_instance(rng)
        est, cands = _space(model, pool, batch)
        if not cands:  # more devices than rows and layers: no layout uses them all
            with pytest.raises(ValueError, match="space is empty"):
                search(cands, est)
            continue
        checked = brute_force_check(cands, est)
        if checked is None:
            infeasible += 1
            with pytest.raises(NoFeasiblePlanError):
                search(cands, est)
            continue
        feasible += 1
        ratio, scored, got = checked
        worst = max(worst, ratio)
        best_t, best_c = min(scored)
        plain = search(cands, lambda c, est=est: est(c))  # no bound, no monotone pruning: the generic path
        assert plain.best.candidate == best_c
        assert [r.estimate.step_seconds for r in plain.runner_ups] == sorted(t for t, _ in scored)[1:5]
        times = [r.estimate.step_seconds for r in got.runner_ups]  # supersets of fitting options are skipped
        assert times == sorted(times) and all(t >= best_t for t in times)
    print(f"search vs brute force: worst ratio {worst:.6f} over {feasible} feasible, {infeasible} infeasible")
    assert worst == 1.0 and feasible >= 10 and infeasible >= 1


def test_constraints_are_kept():
    model = transformer(4, 64, 16, 100, experts=4)
    pool = pool_from_cluster(ClusterSpec((NodeSpec((get_device_type("V100-32GB"),) * 8),)))
    cons = Constraints(stages=2, min_split=2, num_micro_batch=4, floor=MemoryOptions(zero=1),
                       forbid=("offload",))
    est, cands = _space(model, pool, 16, cons)
    assert cands and all(c.stages == 2 and c.split >= 2 and c.num_micro_batch == 4 and c.options.zero >= 1
                         and c.options.offload == "none" for c in cands)
    best = plan_search(model, pool, 16, cons).best.candidate
    assert best.stages == 2 and best.split >= 2 and best.options.zero >= 1
    fixed = plan_search(model, pool, 16, Constraints(stage_layers=(4, 6), data_parallel=2)).best.candidate
    assert fixed.stage_layers == (4, 6) and fixed.data_parallel == 2 and fixed.split == 2


def test_nothing_fits_names_the_shortfall_and_the_fix():
    model = transformer(2, 4096, 128, 1000)
    tiny = DevicePool((get_device_type("T4"),), (2,), (1e8,), (1e8,), 2, 1e10, 1e9)
    with pytest.raises(NoFeasiblePlanError, match=r"short by .* fix: "):
        plan_search(model, tiny, 8)


def test_bad_layer_is_refused():
    with pytest.raises(ModelDescError, match="top_k"):
        LayerDesc("x", 1.0, 1, 1.0, 1.0, "moe", experts=2, top_k=3)


def test_paper_scale_descriptions():
    m1 = transformer(24, 1024, 512, 21128, d_ff=21248, experts=960)
    assert 0.95e12 < m1.params < 1.05e12


def test_meta_device_model_plans_without_allocating():
    from examples.gpt.model import GPT, GPTConfig

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32000, block_size=64, n_layer=16, n_head=64, n_embd=16384))
    n = sum(p.numel() for p in model.parameters())
    assert n > 50e9  # 200 GB of fp32 weights if it were real
    desc = describe_module(model, lambda b: torch.zeros(b, 64, dtype=torch.long))
    assert abs(desc.params - n) < 1e-6 * n
    devs = (get_device_type("A100-80GB"),) * 8
    pool = pool_from_cluster(ClusterSpec(tuple(NodeSpec(devs) for _ in range(16))))
    result = plan_search(desc, pool, 64)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 2e9, f"planning a meta-device model grew the peak RSS by {grown / 1e9:.1f} GB"
    assert result.best.estimate.fits


def test_whale_plan_auto_prints_plan_and_runner_ups(capsys):
    from whale.plan_cli import add_plan

    parser = argparse.ArgumentParser()
    add_plan(parser.add_subparsers())
    ns = parser.parse_args(["plan", "--model", "examples.gpt.model:for_plan", "--world", "2", "--auto",
                            "--args", "n_layer=2", "n_embd=32", "n_head=2", "vocab_size=64", "seq_len=8",
                            "stages=1", "batch=4"])
    assert ns.func(ns) == 0
    out = capsys.readouterr().out
    assert "auto plan: dp" in out and "runner-up 1" in out
