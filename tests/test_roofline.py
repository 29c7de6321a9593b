"""The transformer step-time model (issue 28, part 1): roofline kernels, eq. 3 FLOPs, the closed-form pipeline
against the 1F1B event simulation, interleaving, and the published benchmark's plans."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks._published_rows import ROWS
from benchmarks.published import estimator, published_plan
from whale.cluster import CATALOG
from whale.planner.gpt import GPTShape
from whale.planner.roofline import Roofline, attention_seconds, ffn_seconds

A100 = Roofline.of(CATALOG["A100-80GB"], 0.6, launch=0.0)


def test_roofline_bounds():
    big = A100.gemm(8192, 8192, 8192)
    assert big == pytest.approx(2 * 8192 ** 3 / (312e12 * 0.6))  # compute-bound at the calibrated efficiency
    assert A100.kernel(0.0, 2.039e12) == pytest.approx(1.0)  # 2.039 TB at 2.039 TB/s
    s, d = 2048, 96  # attention scores of a 96-wide head: 87 FLOP/byte, below the A100 ridge (~92 at eff 0.6)
    scores = A100.gemm(s, s, d)
    assert scores == pytest.approx(2 * (s * d * 2 + s * s) / 2.039e12)


def test_small_models_are_slower_per_flop():
    """Per GEMM FLOP, the 1.7B layer spends more time in attention and element-wise work than the 1T layer."""
    def per_flop(h, a, t, b):
        att, ffn = attention_seconds(A100, 2048, b, h, a, t), ffn_seconds(A100, 2048, b, h, 4 * h, t)
        flops = (24 * 2048 * b * h * h + 4 * b * 2048 ** 2 * h) / t
        return (att.forward + ffn.forward) / flops
    assert per_flop(2304, 24, 1, 16) > 1.2 * per_flop(25600, 160, 8, 1)


@pytest.mark.parametrize("text", ["gpt:layers=24,hidden=2304,heads=24", "gpt:layers=128,hidden=25600,heads=160"])
def test_model_desc_flops_are_eq3(text):
    """Blocks 4 passes (full recompute) + head 3 passes of the description = Narayanan et al. eq. 3."""
    from whale.planner.gpt import parse_gpt

    sh = parse_gpt(text)
    desc = sh.model_desc()
    total = sum(x.flops * (4 / 3 if x.kind in ("attention", "dense") else 1) for x in desc.layers)
    assert total == pytest.approx(sh.iteration_flops(1), rel=1e-12)


@pytest.mark.parametrize("name", ["18B", "39B", "1T"])
def test_closed_form_matches_event_simulation(name):
    row = next(r for r in ROWS if r.name == name)
    est = estimator(row, 0.6)
    c = published_plan(row)
    assert est.pipeline_seconds(c) == pytest.approx(est.simulated_pipeline_seconds(c), rel=0.02)


def test_interleaving_shrinks_the_bubble():
    row = next(r for r in ROWS if r.name == "145B")
    c = published_plan(row)
    est = estimator(row, 0.6)
    one = est.pipeline_seconds(dataclasses.replace(c, schedule="1F1B", virtual=1))
    two = est.pipeline_seconds(c)
    assert row.virtual == 2 and c.schedule == "Interleaved1F1B" and two < one
    assert two == pytest.approx(est.simulated_pipeline_seconds(c), rel=0.02)  # the event path knows it too


def test_prediction_grows_with_efficiency_and_stays_below_peak():
    from benchmarks.published import predict

    row = ROWS[0]
    lo, hi = predict(row, 0.4)["tflops_per_gpu"], predict(row, 0.8)["tflops_per_gpu"]
    assert lo < hi < 312
    assert GPTShape(24, 2304, 24).params == pytest.approx(1.65e9, rel=0.01)
