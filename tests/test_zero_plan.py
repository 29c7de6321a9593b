"""ZeRO in the plan (no processes): shard sizes follow free device memory, checked against brute force on small
random instances; JSON round-trip; the printout; bad configurations and plans refused with the fix."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

import whale as wh
from tests.models import TinyLM
from whale.cluster import ClusterSpec, memory_capacity
from whale.config import ConfigError
from whale.plan.plan import Plan, PlanError
from whale.plan.shares import whole_shares
from whale.planner.zero import (
    GRAD_BYTES,
    OPTIM_BYTES,
    PARAM_BYTES,
    free_memory_shares,
    stage_param_elements,
    worst_fraction,
)

GB = 1e9


def test_shares_follow_free_memory():
    assert free_memory_shares([32 * GB, 16 * GB], [0.0, 0.0], 3.0) == pytest.approx([2.0, 1.0])
    assert free_memory_shares([32 * GB, 16 * GB], [8 * GB, 8 * GB], 4.0) == pytest.approx([3.0, 1.0])
    assert free_memory_shares([32 * GB, 16 * GB], [8 * GB, 20 * GB], 4.0) == pytest.approx([4.0, 0.0])  # full
    with pytest.raises(ValueError):
        free_memory_shares([0.0, 1.0], [0.0, 0.0], 1.0)


def _compositions(total, n):
    """Every way to write ``total`` as ``n`` whole numbers >= 0."""
    for cuts in itertools.combinations(range(total + n - 1), n - 1):
        bounds = (-1, *cuts, total + n - 1)
        yield [bounds[i + 1] - bounds[i] - 1 for i in range(n)]


def test_whole_shares_against_brute_force_on_small_random_instances():
    """The runtime cuts each bucket into whole elements by the plan's weights (:func:`whole_shares`); compare
    the largest fraction of free memory any device's slice takes with the best of every whole split."""
    rng = random.Random(0)
    worst = 1.0
    for _ in range(300):
        n = rng.randint(2, 4)
        cap = [float(rng.randint(4, 40)) for _ in range(n)]
        unsharded = [rng.uniform(0, 0.8) * c for c in cap]
        units = rng.randint(n, 14)
        weights = free_memory_shares(cap, unsharded, float(units))
        mine = worst_fraction(cap, unsharded, [float(x) for x in whole_shares(units, weights)])
        best = min(worst_fraction(cap, unsharded, [float(x) for x in c]) for c in _compositions(units, n))
        continuous = worst_fraction(cap, unsharded, weights)
        assert continuous <= best + 1e-12  # the proportional split is the relaxation's optimum
        worst = max(worst, mine / best)
    print(f"worst ratio of whole shares to the brute-force optimum over 300 instances: {worst:.4f}")
    assert worst == pytest.approx(1.0, abs=1e-12)


def _plan(world, zero, cluster=None, layers=(1, 1)):
    model = TinyLM(stage_layers=layers)
    config = wh.Config(num_micro_batch=2, zero=zero, cluster=cluster)
    return wh.plan_model(model, world, config)


def test_plan_shards_follow_each_lane_devices_free_memory():
    plan = _plan(4, 1, "examples/clusters/v100_p100.yaml")
    spec = ClusterSpec.from_yaml("examples/clusters/v100_p100.yaml")
    for s in range(plan.num_stages):
        psi = stage_param_elements(plan, s)
        whole = psi * (PARAM_BYTES + GRAD_BYTES)  # ZeRO-1: parameters and gradients stay whole
        free = [memory_capacity(spec, plan.rank_of(s, lane)) - whole for lane in range(plan.lanes_of(s))]
        w = plan.zero_weights[s]
        assert w[0] / w[1] == pytest.approx(free[0] / free[1])
        assert plan.devices[plan.rank_of(s, 0)] == "V100-32GB" and w[0] / w[1] == pytest.approx(2.0, rel=1e-3)
    assert "ZeRO-1: optimizer state sharded" in str(plan) and "66.7%" in str(plan)
    assert _plan(4, 0, "examples/clusters/v100_p100.yaml").zero_weights == ()  # no ZeRO, no weights
    even = _plan(4, 2)  # identical devices (no cluster): equal shards
    assert even.zero == 2 and even.zero_weights == () and "ZeRO-2" in str(even)
    assert OPTIM_BYTES == 8
    three = _plan(4, 3, "examples/clusters/v100_p100.yaml")  # ZeRO-3: nothing stays whole, shares by capacity
    caps = [memory_capacity(spec, three.rank_of(0, lane)) for lane in range(2)]
    assert three.zero_weights[0][0] / three.zero_weights[0][1] == pytest.approx(caps[0] / caps[1])
    assert "ZeRO-3: optimizer state, gradients and parameters sharded" in str(three)


def test_zero_fields_round_trip_through_json():
    plan = dataclasses.replace(_plan(4, 2), zero_weights=((3.0, 1.0), (0.0, 2.5)))
    assert Plan.from_json(plan.to_json()) == plan
    data = plan.to_dict()
    assert data["zero"] == 2 and [list(w) for w in data["zero_weights"]] == [[3.0, 1.0], [0.0, 2.5]]
    assert whole_shares(10, (3.0, 1.0)) == [8, 2] and whole_shares(5, (0.0, 1.0, 1.0)) == [0, 3, 2]


@pytest.mark.parametrize("zero,match", [(4, "not a ZeRO stage"), (True, "not a ZeRO stage"),
                                        (-1, "not a ZeRO stage"), ("1", "not a ZeRO stage")])
def test_bad_zero_config_is_refused(zero, match):
    with pytest.raises(ConfigError, match=match):
        wh.Config(zero=zero)


@pytest.mark.parametrize("change,match", [
    ({"zero": 4}, "not a ZeRO stage"),
    ({"zero": 0, "zero_weights": ((1.0, 1.0), (1.0, 1.0))}, "shards nothing"),
    ({"zero_weights": ((1.0, 1.0),)}, "one list per stage"),
    ({"zero_weights": ((1.0, 1.0, 1.0), (1.0, 1.0))}, "one per lane"),
    ({"zero_weights": ((0.0, 0.0), (1.0, 1.0))}, "positive sum"),
    ({"zero_weights": ((-1.0, 1.0), (1.0, 1.0))}, ">= 0"),
])
def test_bad_zero_plan_is_refused(change, match):
    plan = _plan(4, 1)
    with pytest.raises(PlanError, match=match):
        dataclasses.replace(plan, **change)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict({**plan.to_dict(), **{k: v for k, v in change.items()}})
