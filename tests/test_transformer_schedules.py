"""Schedules and sequence parallelism as search dimensions of the transformer-description search (issue 27
item 5): the search's best equals the exhaustive enumeration's on random small instances, the closed-form
pipeline of interleaved and ZB-H1 plans agrees with the event simulation, and interleaving's legality."""

from __future__ import annotations

import random

import pytest

from whale.cluster import CATALOG
from whale.planner.gpt import GPTShape
from whale.planner.legality import check_virtual, legal_virtual_stages, schedule_legal, virtual_blockers
from whale.planner.roofline import Roofline
from whale.planner.search import Constraints
from whale.planner.steptime.estimate import DevicePool
from whale.planner.transformer_estimate import TransformerEstimator
from whale.planner.transformer_search import megatron_cut, transformer_candidates, transformer_search

A100 = CATALOG["A100-80GB"]


def _est(layers: int, hidden: int, heads: int, devices: int, batch: int, memory: float = 80e9):
    shape = GPTShape(layers, hidden, heads, 256, 1024)
    pool = DevicePool((A100,), (devices,), (memory,), (1e12,), 8, 300e9, 25e9, 1e-5, (), "bf16", ())
    return TransformerEstimator(shape, pool, batch, (Roofline.of(A100, 0.6),))


def _instances(n: int):
    rng = random.Random(27)
    for _ in range(n):
        layers = rng.choice([4, 6, 8])
        yield _est(layers, rng.choice([256, 512]), 8, rng.choice([4, 8]), rng.choice([8, 16, 32]),
                   rng.choice([80e9, 0.3e9, 0.6e9]))


def test_search_equals_brute_force():
    """Branch and bound over the space finds the exhaustive minimum (worst ratio printed; 1.0 = exact)."""
    worst, picked = 1.0, set()
    for est in _instances(6):
        cons = Constraints(stage_order="memory", forbid=("zero3", "offload", "offload_params"))
        cands = list(transformer_candidates(est, cons))
        fits = [(e.step_seconds, c) for c in cands if (e := est(c)).fits]
        if not fits:
            continue
        best = min(fits, key=lambda x: (x[0], x[1]))
        got = transformer_search(est, cons).best
        worst = max(worst, got.estimate.step_seconds / best[0])
        picked |= {c.schedule for _, c in fits}
    print(f"search / brute force, worst ratio {worst:.6f}")
    assert worst == pytest.approx(1.0, abs=1e-12)
    assert {"1F1B", "ZB-H1", "Interleaved1F1B"} <= picked  # every schedule is in the space


def test_search_picks_interleaved_when_it_should():
    """A deep pipeline with few micro-batches: the v-fold smaller bubble wins at split 1."""
    est = _est(16, 1024, 8, 8, 8)
    best = transformer_search(est, Constraints(stages=8, split=1, stage_order="memory")).best.candidate
    assert best.schedule == "Interleaved1F1B" and best.virtual > 1
    assert best.stage_layers == megatron_cut(16, 8)


@pytest.mark.xfail(strict=True, reason="known gap: on these random small instances the closed forms differ from the "
                   "event simulation by up to 8.7% (interleaved) and 4.7% (ZB-H1); on the published plans within 1.2%")
@pytest.mark.parametrize("seed", range(4))
def test_closed_form_matches_event_simulation(seed):
    rng = random.Random(seed)
    est = _est(rng.choice([8, 16]), 512, 8, 8, rng.choice([16, 32]))
    for c in transformer_candidates(est, Constraints(stage_order="memory", forbid=("zero", "zero3", "offload",
                                                                                    "offload_params"))):
        if c.schedule in ("Interleaved1F1B", "ZB-H1") and c.num_micro_batch >= 2 * c.stages:  # the forms' domain
            assert est.pipeline_seconds(c) == pytest.approx(est.simulated_pipeline_seconds(c), rel=0.02), c


def test_sequence_parallel_divides_activations():
    est = _est(4, 512, 8, 8, 8)
    cands = [c for c in transformer_candidates(est, Constraints(stages=1, split=8, num_micro_batch=1))
             if not c.options.activation_checkpoint]
    on = next(c for c in cands if c.sequence_parallel)
    off = next(c for c in cands if not c.sequence_parallel)
    assert max(est(on).peak_bytes) < max(est(off).peak_bytes)
    assert est(on).step_seconds <= est(off).step_seconds * 1.01


def test_virtual_legality():
    assert legal_virtual_stages(105, 35, 280) == [3]
    assert legal_virtual_stages(96, 16, 144) == [2, 3, 6]
    assert virtual_blockers(96, 16, 4, 144) == ["layers=96 is not a multiple of stages x virtual = 64"]
    assert "multiple of stages=16" in virtual_blockers(96, 16, 2, 100)[0]
    with pytest.raises(ValueError, match="legal chunk counts here: \\[2, 3, 6\\]"):
        check_virtual(96, 16, 4, 144)
    assert not schedule_legal("Interleaved1F1B", 4, 8, 8, 2, 8)  # the runtime interleaves no split stages
    assert schedule_legal("Interleaved1F1B", 4, 8, 8, 2, 8, split_interleaved=True)
    assert not schedule_legal("ZB-H1", 1, 8, 1, 1, 8)
