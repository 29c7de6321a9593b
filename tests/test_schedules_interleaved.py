"""Interleaved 1F1B and zero-bubble ZB-H1 train to the same losses, gradients and parameters as one process.

Multi-process gloo runs (:mod:`tests.distributed`, each with its timeout) through the one-process comparison of
:mod:`tests.test_equivalence` (a ``deepcopy`` trained by plain PyTorch on the whole batch; fp32, rtol 1e-5 /
atol 1e-6 on losses, every step's gradients and the parameters after the run).
"""

from __future__ import annotations

import pytest

import whale as wh
from tests.test_equivalence import _check


@pytest.mark.parametrize("world,layers,shares", [(2, (3, 1), None), (4, (2, 1, 1, 3), None), (4, (1, 2), (3, 1))])
def test_zero_bubble_matches_one_process(world, layers, shares):
    """ZB-H1 at world 2 and 4: uneven stages, the tied embedding / head across the first and last stage, and
    (4 ranks, 2 stages) nested data parallelism with uneven lane shares."""
    results = _check(world, {"layers": layers, "batch": 8, "mb": 4, "schedule": "ZB-H1", "shares": shares,
                             "tied": True, "steps": 3})
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.schedule == "ZB-H1" and plan.num_stages == len(layers)
    assert [sp.names for sp in plan.shared_params] == [("emb.weight", "head.weight")]
