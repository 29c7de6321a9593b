"""The checkpoint interval from the save cost (whale.planner.ckpt_interval): exact against brute force on random
instances, the bound that wins, errors; and a real GPT run with ``--ckpt-every auto`` is in test_straggler.py."""

from __future__ import annotations

import math
import random

import pytest

from whale.planner.ckpt_interval import checkpoint_interval, young_daly_seconds


def _brute(step_s, save_s, max_lost, r, max_steps):
    """Enumerate every interval: the largest k with both bounds (capped), else the smallest with the overhead."""
    limit = int(max(max_lost / step_s, save_s / (r * step_s))) + 3
    lost = [k * step_s + save_s for k in range(limit + 1)]
    both = [k for k in range(1, limit) if lost[k] <= max_lost and save_s / (k * step_s) <= r]
    if both:
        k = max(both)
        if max_steps is not None and k >= max_steps:
            k = max_steps if save_s / (max_steps * step_s) <= r else min(both)
        return k
    return next(k for k in range(1, limit) if save_s / (k * step_s) <= r)


def test_exact_against_brute_force_on_random_instances():
    rng = random.Random(7)
    for _ in range(400):
        step_s = rng.choice([0.1, 0.25, 0.3, 1.0, rng.uniform(0.01, 2.0)])
        save_s = rng.choice([0.0, 0.3, 0.7, rng.uniform(0.0, 5.0)])
        max_lost = rng.choice([1.0, 3.0, rng.uniform(0.05, 60.0)])
        r = rng.choice([0.05, 0.1, 0.5, 1.0, rng.uniform(0.01, 1.0)])
        max_steps = rng.choice([None, rng.randint(1, 200)])
        got = checkpoint_interval(step_s, save_s, max_lost, r, max_steps)
        want = _brute(step_s, save_s, max_lost, r, max_steps)
        assert got.steps == want, (step_s, save_s, max_lost, r, max_steps, got)
        assert got.overhead <= r + 1e-12  # the overhead bound always holds
        assert math.isclose(got.lost_seconds, got.steps * step_s + save_s)
        if got.bound == "max_lost_seconds":
            assert got.lost_seconds <= max_lost and (got.steps + 1) * step_s + save_s > max_lost
        if got.bound == "max_overhead":
            assert got.steps == 1 or save_s / ((got.steps - 1) * step_s) > r


def test_which_bound_wins():
    # 0.5 s steps, 1 s saves, lose at most 10 s: 18 steps (9 s + the 1 s save); overhead 1/9 = 11%
    loose = checkpoint_interval(0.5, 1.0, 10.0, 0.2)
    assert (loose.steps, loose.bound) == (18, "max_lost_seconds") and loose.lost_seconds == 10.0
    tight = checkpoint_interval(0.5, 1.0, 10.0, 0.1)
    assert (tight.steps, tight.bound) == (20, "max_overhead") and tight.lost_seconds == 11.0
    assert "overhead bound wins" in tight.describe()
    capped = checkpoint_interval(0.1, 0.01, 100.0, 0.1, max_steps=50)
    assert (capped.steps, capped.bound) == (50, "max_steps")
    assert young_daly_seconds(2.0, 3600.0) == pytest.approx(120.0)


@pytest.mark.parametrize("kw, word", [(dict(step_s=0.0), "step_s=0.0"), (dict(save_s=-1.0), "save_s=-1.0"),
                                      (dict(max_lost_s=0.0), "max_lost_s=0.0"),
                                      (dict(max_overhead=2.0), "max_overhead=2.0")])
def test_bad_input_names_the_value(kw, word):
    args = dict(step_s=1.0, save_s=1.0, max_lost_s=10.0, max_overhead=0.1) | kw
    with pytest.raises(ValueError, match=word):
        checkpoint_interval(**args)
