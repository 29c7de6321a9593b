"""Resharding checkpoints (issue 15): save under one plan, load under another, bitwise.

Layouts and model: tests/reshard_models.py. The fast test covers six pairs (every layout as a source or a
target) and ZeRO slices re-cut; the full 5 x 5 matrix and ZeRO <-> no ZeRO are ``slow``.
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
