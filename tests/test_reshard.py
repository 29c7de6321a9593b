"""Resharding checkpoints (issue 15): save under one plan, load under another, bitwise.

Layouts and model: tests/reshard_models.py. The fast test covers six pairs (every layout as a source or a
target), ZeRO slices re-cut and ZeRO-3 (DP2, uneven) <-> ZeRO-3 at other shares, plain DP2 and one process;
the full 5 x 5 matrix, ZeRO <-> no ZeRO over DP2 x PP2 and ZeRO-3 over DP2 x PP2 are ``slow``.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.reshard_models import LAYOUTS, compare, load_layouts, matrix, save_layout

FAST = {"dp2pp2": ["dp4", "split2"], "one": ["pp4", "split2"], "split2": ["pp4", "dp4"]}


def _check(results):
    bad = {pair: p for pair, p in results.items() if p}
    assert not bad, bad


def test_reshard_pairs_fast(tmp_path):
    _check(matrix(str(tmp_path), ["dp4", "pp4", "split2"], FAST))


@pytest.mark.slow
def test_reshard_full_matrix(tmp_path):
    _check(matrix(str(tmp_path), list(LAYOUTS), {t: list(LAYOUTS) for t in LAYOUTS}))


def test_zero_slices_reshard_to_other_slices(tmp_path):
    """ZeRO-2 over DP2 x PP2 (each lane holds slices of its stage's buckets) -> ZeRO-1 over DP4 (other buckets,
    other slices, cut from the whole tensors)."""
    saved = run_ranks(save_layout, 4, "dp2pp2", str(tmp_path), 2, 2, timeout=300)
    loaded = run_ranks(load_layouts, 4, "dp4", str(tmp_path), ["dp2pp2"], 1, timeout=300)
    assert not compare(saved, [r["dp2pp2"] for r in loaded])


@pytest.mark.slow
def test_zero_checkpoints_load_without_zero_and_back(tmp_path):
    """ZeRO-2 slices -> one process without ZeRO; a plain DP4 checkpoint -> ZeRO-1 over DP4."""
    root = str(tmp_path)
    zero = run_ranks(save_layout, 4, "dp2pp2", root, 2, 2, timeout=300)
    plain = run_ranks(save_layout, 4, "dp4", root, timeout=300)
    [one] = run_ranks(load_layouts, 1, "one", root, ["dp2pp2"], timeout=300)
    assert not compare(zero, [one["dp2pp2"]])
    back = run_ranks(load_layouts, 4, "dp4", root, ["dp4"], 1, timeout=300)
    assert not compare(plain, [r["dp4"] for r in back])


def test_zero3_checkpoints_reshard(tmp_path):
    """ZeRO-3 over DP2 with uneven shares 3:1 (each lane holds its range of every unit's parameters and
    optimizer state) -> the same plan, ZeRO-3 at shares 1:3, plain DP2 and one process; one process without
    ZeRO -> ZeRO-3 at 3:1. Bitwise: parameters, optimizer state, hyperparameters, RNG, step."""
    root = str(tmp_path)
    zero3 = run_ranks(save_layout, 2, "dp4", root, 2, 3, ((3.0, 1.0),), timeout=300)  # "dp4": no annotation
    [plain] = run_ranks(save_layout, 1, "one", root, timeout=300)
    same = run_ranks(load_layouts, 2, "dp4", root, ["dp4", "one"], 3, ((3.0, 1.0),), timeout=300)
    assert not compare(zero3, [r["dp4"] for r in same])
    assert not compare([plain], [r["one"] for r in same])
    other = run_ranks(load_layouts, 2, "dp4", root, ["dp4"], 3, ((1.0, 3.0),), timeout=300)
    assert not compare(zero3, [r["dp4"] for r in other])
    dp = run_ranks(load_layouts, 2, "dp4", root, ["dp4"], 0, timeout=300)
    assert not compare(zero3, [r["dp4"] for r in dp])
    [one] = run_ranks(load_layouts, 1, "one", root, ["dp4"], timeout=300)
    assert not compare(zero3, [one["dp4"]])


@pytest.mark.slow
def test_zero3_pipeline_checkpoints_reshard(tmp_path):
    """ZeRO-3 over DP2 x PP2 (the embedding/head tied across the stages: its optimizer state sliced over the tie
    group as under ZeRO-2) -> one process, and -> ZeRO-3 over DP2 x PP2 at other shares."""
    root = str(tmp_path)
    zero3 = run_ranks(save_layout, 4, "dp2pp2", root, 2, 3, ((3.0, 1.0), (1.0, 2.0)), timeout=300)
    [one] = run_ranks(load_layouts, 1, "one", root, ["dp2pp2"], timeout=300)
    assert not compare(zero3, [one["dp2pp2"]])
    back = run_ranks(load_layouts, 4, "dp2pp2", root, ["dp2pp2"], 3, ((1.0, 1.0), (2.0, 1.0)), timeout=300)
    assert not compare(zero3, [r["dp2pp2"] for r in back])
