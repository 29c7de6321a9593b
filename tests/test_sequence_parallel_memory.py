"""Activation memory of a GPT block with sequence parallelism: bytes autograd saves per rank, against the
formula (whale.memory.block_activations, Korthikanti et al. 2022 adjusted to the block in fp32) and against
one process divided by the split degree (benchmarks/sequence_parallel_memory.py measures; world 2 here).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from whale.memory.block_activations import SavedActivations, gpt_block_activation_bytes, paper_activation_bytes

BENCH_DIR = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from sequence_parallel_memory import measure, report  # noqa: E402

SHAPE = {"s": 32, "b": 2, "h": 32, "a": 4}


def test_sequence_parallel_activation_bytes_are_one_process_over_t():
    results = run_ranks(measure, 2, SHAPE, timeout=180)
    rep = report(2, results, SHAPE)
    assert rep["outputs_match"] and rep["within_10pct_of_formula_over_t"]
    for kind in ("one_process", "tensor_parallel", "sequence_parallel"):
        for ratio in rep[kind]["ratio"]:
            assert ratio == pytest.approx(1.0, abs=0.10), (kind, rep[kind])
    one = rep["one_process"]["measured_bytes_per_rank"][0]
    for sp in rep["sequence_parallel"]["measured_bytes_per_rank"]:
        assert sp == pytest.approx(one / 2, rel=0.10)
    assert max(rep["tensor_parallel"]["measured_bytes_per_rank"]) > 1.2 * one / 2  # TP alone does not divide by t


def test_formulas_divide_by_t_with_sequence_parallelism():
    for t in (2, 4, 8):
        assert gpt_block_activation_bytes(128, 4, 256, 8, t, True) == gpt_block_activation_bytes(128, 4, 256, 8) / t
        assert paper_activation_bytes(128, 4, 256, 8, t, True) == paper_activation_bytes(128, 4, 256, 8) / t
        assert gpt_block_activation_bytes(128, 4, 256, 8, t) > gpt_block_activation_bytes(128, 4, 256, 8, t, True)
    with pytest.raises(ValueError, match="t=0"):
        gpt_block_activation_bytes(1, 1, 1, 1, 0)


def test_saved_activations_counts_each_storage_once_without_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivations(lin) as saved:
        y = lin(x)
        z = y * y  # y saved twice (both factors): one storage
    assert saved.count == 2 and saved.bytes == 2 * 4 * 8 * 4  # x (by the Linear) and y
    z.sum().backward()
