"""Memory accounting of real transformers (issue 28, part 2) against hand-computed values for two rows of
Megatron-LM SC'21 Table 1 (145B: tensor 8, pipeline 8, micro-batch 2, interleaved v = 2; 1T: tensor 8,
pipeline 64, micro-batch 1), by Korthikanti et al. 2022's formulas, and the planner's memory check using them."""

from __future__ import annotations

import pytest

from whale.planner.gpt import GPTShape, parse_gpt
from whale.planner.memory import MemoryOptions
from whale.planner.search import Candidate
from whale.planner.transformer_memory import (
    ALLOCATOR_OVERHEAD,
    head_activation_bytes,
    in_flight_layers,
    layer_activation_bytes,
    model_state_bytes,
    stage_peak,
)

S = 2048
SBH_145B = 2048 * 2 * 12288  # s·b·h of the 145B row = 50,331,648


def test_layer_activation_variants_145b():
    """Korthikanti Table 2 at s=2048, b=2, h=12288, a=96 (5·a·s/h = 80), t=8, by hand."""
    args = (S, 2, 12288, 96)
    assert layer_activation_bytes(*args) == SBH_145B * (34 + 80) == 5_737_807_872
    assert layer_activation_bytes(*args, t=8) == SBH_145B * (10 + 3 + 10) == 1_157_627_904
    assert layer_activation_bytes(*args, t=8, sequence_parallel=True) == SBH_145B * 14.25 == 717_225_984
    assert layer_activation_bytes(*args, t=8, recompute="selective") == SBH_145B * 13 == 654_311_424
    assert layer_activation_bytes(*args, t=8, sequence_parallel=True, recompute="selective") == 213_909_504
    assert layer_activation_bytes(*args, t=8, recompute="full") == 2 * SBH_145B == 100_663_296
    assert layer_activation_bytes(*args, t=8, sequence_parallel=True, recompute="full") == 12_582_912
    with pytest.raises(ValueError, match="recompute"):
        layer_activation_bytes(*args, recompute="some")


def test_interleaved_in_flight_145b():
    """Stage 0 of p=8, v=2, m=48: (8-1)·2 + (2-1)·8 + 1 = 23 chunks of 5 layers; plain 1F1B: p - s stages."""
    assert in_flight_layers(0, 8, 48, 10, virtual=2) == 115
    assert in_flight_layers(7, 8, 48, 10, virtual=2) == (0 + 8 + 1) * 5
    assert in_flight_layers(0, 64, 512, 2) == 128
    assert in_flight_layers(3, 4, 2, 5) == 5  # 1F1B: min(p - s, m) micro-batches


def test_model_state_145b_stage0():
    """10 blocks of 12h² + 13h plus the (V + s)·h embeddings, over t = 8, at 16 and 18 bytes per element."""
    sh = GPTShape(80, 12288, 96)
    assert sh.layer_params == 1_812_099_072
    elements = (10 * sh.layer_params + (51200 + 2048) * 12288) / 8
    assert elements == 2_346_912_768
    assert model_state_bytes(elements).total == 16 * elements == 37_550_604_288
    assert model_state_bytes(elements, fp32_grads=True).total == 42_244_429_824
    z1 = model_state_bytes(1000, zero_stage=1, dp=4)
    assert (z1.weights, z1.gradients, z1.optimizer) == (2000, 2000, 3000)
    z3 = model_state_bytes(1000, precision="fp32", zero_stage=3, dp=4)
    assert (z3.weights, z3.gradients, z3.optimizer) == (1000, 1000, 2000)


def test_1t_stage0_by_hand():
    """1T stage 0: 2 blocks + embeddings over t=8 = 2,136,556,800 elements x 16 B; 64 micro-batches in flight
    of 2 checkpoints of 2·s·h = 104,857,600 B and an embedding mask of s·h; one recomputed layer
    s·h·(10 + 24/8 + 5·160·2048/(25600·8)) = 21·s·h. Total 52,063,129,600 B (~52 GB, as Megatron's accounting)."""
    sh = GPTShape(128, 25600, 160)
    elements = (2 * sh.layer_params + 53248 * 25600) / 8
    assert elements == 2_136_556_800
    pk = stage_peak(S, 1, 25600, 160, 51200, elements, 2, in_flight_layers(0, 64, 512, 2), 64, True, False, 8)
    assert pk.state.total == 34_184_908_800
    assert pk.activations == 128 * 104_857_600 + 64 * 52_428_800 == 16_777_216_000
    assert pk.working == 21 * 52_428_800
    assert pk.total == 52_063_129_600
    assert head_activation_bytes(S, 1, 25600, 51200, 8) == 4 * S * 25600 + 4 * S * 6400


def test_parameter_counts_match_table_1():
    for text, billions in (("gpt:layers=24,hidden=2304,heads=24", 1.7), ("gpt:layers=80,hidden=12288,heads=96", 145.6),
                           ("gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200", 1008.0)):
        assert parse_gpt(text).params / 1e9 == pytest.approx(billions, abs=0.06)


def test_planner_memory_check_uses_the_accounting():
    """The estimator's stage-0 peak for the forced 1T plan is the hand total times the allocator factor."""
    from benchmarks._published_rows import ROWS
    from benchmarks.published import estimator, published_plan

    row = ROWS[-1]
    e = estimator(row, 0.6)(published_plan(row))
    assert e.peak_bytes[0] == pytest.approx(52_063_129_600 * ALLOCATOR_OVERHEAD, rel=1e-9)
    assert e.fits
    no_ckpt = Candidate(**{**published_plan(row).__dict__, "options": MemoryOptions()})
    assert not estimator(row, 0.6).memory(no_ckpt).fits  # without recompute the 1T plan does not fit 80 GB
