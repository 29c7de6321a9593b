"""Resharding checkpoints (issue 15): save under one plan, load under another, bitwise.

Layouts and model: tests/reshard_models.py. The fast test covers six pairs (every layout as a source or a
target); the full 5 x 5 matrix is ``slow``.
"""

from __future__ import annotations

import pytest

from tests.reshard_models import LAYOUTS, matrix

FAST = {"dp2pp2": ["dp4", "split2"], "one": ["pp4", "split2"], "split2": ["pp4", "dp4"]}


def _check(results):
    bad = {pair: p for pair, p in results.items() if p}
    assert not bad, bad


def test_reshard_pairs_fast(tmp_path):
    _check(matrix(str(tmp_path), ["dp4", "pp4", "split2"], FAST))


@pytest.mark.slow
def test_reshard_full_matrix(tmp_path):
    _check(matrix(str(tmp_path), list(LAYOUTS), {t: list(LAYOUTS) for t in LAYOUTS}))
