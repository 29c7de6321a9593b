"""Every strategy trains to the same losses and parameters as one process on the same global batch.

Reference: a ``deepcopy`` of the model trained by plain PyTorch on the whole batch with the same AdamW.
Gradients are compared at every step as well as parameters (Adam would hide a wrong gradient scale).
Tolerance: fp32, rtol 1e-5 / atol 1e-6 on losses and on every parameter after each compared run. AdamW runs
at lr 1e-3: Adam normalizes each gradient element, so an element whose true gradient is ~0 moves by up to lr
whatever low bits fp32 summation order leaves in it; at lr 1e-3 that stays inside atol.
"""

from __future__ import annotations

import copy

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import (
    RecordingAdamW,
    RecordingSGD,
    SkipLM,
    TinyLM,
    lm_batches,
    lm_loss,
    mse_side_by_side,
)

RTOL, ATOL = 1e-5, 1e-6


def _train_compare(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=spec.get("mb", 1), schedule=spec.get("schedule", "1F1B"),
                            load_shares=spec.get("shares"), seed=0, cluster=spec.get("cluster"),
                            max_grad_norm=spec.get("clip")))
    model = SkipLM() if spec.get("skip") else TinyLM(stage_layers=spec["layers"], tied=spec.get("tied", True))
    ref = copy.deepcopy(model)
    sample = lm_batches(1, spec["batch"])[0] if spec.get("cluster") else None
    make_opt = (lambda ps: RecordingSGD(ps, lr=0.1, momentum=0.9)) if spec.get("sgd") else \
        (lambda ps: RecordingAdamW(ps, lr=1e-3))
    engine = wh.parallelize(model, lm_loss, make_opt, ctx=ctx, sample_batch=sample)
    ref_opt = make_opt(ref.parameters())
    losses, ref_losses = [], []
    for x, y in lm_batches(spec.get("steps", 3), spec["batch"]):
        losses.append(engine.step((x, y))["loss"])
        ref_opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        if spec.get("clip"):
            torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["clip"])
        ref_opt.step()
        ref_losses.append(loss.item())
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    names = []
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        for step, (mine, theirs) in enumerate(zip(engine.optimizer.grads, ref_opt.grads, strict=True)):
            torch.testing.assert_close(mine[id(p)], theirs[id(ref_params[name])], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name, s=step: f"grad of {n} at step {s}: {m}")
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
        names.append(name)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    return {"losses": losses, "names": names, "stage": engine.stage, "plan": engine.plan.to_json()}


def _check(world, spec):
    results = run_ranks(_train_compare, world, spec)
    covered = {n for r in results for n in r["names"]}
    model = SkipLM() if spec.get("skip") else TinyLM(stage_layers=spec["layers"], tied=spec.get("tied", True))
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert covered == expected, f"parameters never compared: {expected - covered}"
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks disagree on the global loss"
    return results


@pytest.mark.parametrize("world,shares", [(2, None), (2, (5, 3)), (4, None), (4, (1, 2, 3, 2))])
def test_data_parallel_equal_and_uneven_shares(world, shares):
    results = _check(world, {"layers": (2,), "batch": 8, "shares": shares})
    plan = wh.Plan.from_json(results[0]["plan"])
    rows = [b - a for lane in plan.micro_batch_rows(8) for a, b in lane]
    assert rows == list(shares or [8 // world] * world)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_two_stage_pipeline_unequal_layers(schedule):
    _check(2, {"layers": (3, 1), "batch": 8, "mb": 4, "schedule": schedule})


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_four_stage_pipeline_unequal_layers(schedule):
    results = _check(4, {"layers": (2, 1, 1, 3), "batch": 8, "mb": 4, "schedule": schedule})
    assert sorted(r["stage"] for r in results) == [0, 1, 2, 3]


def test_data_parallel_times_pipeline_on_four_ranks():
    results = _check(4, {"layers": (1, 2), "batch": 8, "mb": 2, "shares": (3, 1)})
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.num_replicas == 2 and plan.num_stages == 2


def test_gradient_accumulation_one_task_graph():
    _check(2, {"layers": (2,), "batch": 8, "mb": 4})


def test_gradient_accumulation_single_process():
    _check(1, {"layers": (2,), "batch": 6, "mb": 3})


def test_tied_weights_across_stages_stay_identical():
    results = _check(2, {"layers": (1, 1), "batch": 4, "mb": 2, "tied": True, "steps": 4})
    plan = wh.Plan.from_json(results[0]["plan"])
    assert [sp.names for sp in plan.shared_params] == [("emb.weight", "head.weight")]


def test_untied_pipeline():
    results = _check(2, {"layers": (1, 1), "batch": 4, "mb": 2, "tied": False})
    assert wh.Plan.from_json(results[0]["plan"]).shared_params == ()


MIXED = {"nodes": [{"devices": ["P100-16GB", "V100-32GB"]}, {"devices": ["T4", "V100-32GB"]}]}


def test_hardware_aware_uneven_cuts_and_shares_match_one_process():
    from whale.cluster import ClusterSpec

    # not MIXED: there the planner's exact min-max shares are equal (the two V100s of stage 0 are every lane's
    # bottleneck); here lane 1 (A100 + V100) is faster than lane 0 (V100 + P100) at every stage
    spec = ClusterSpec.from_dict({"nodes": [{"devices": ["P100-16GB", "V100-32GB"]},
                                            {"devices": ["A100-40GB", "V100-32GB"]}]})
    results = _check(4, {"layers": (2, 2), "batch": 16, "mb": 2, "cluster": spec})
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.device_order and plan.stage_cuts[0].units  # reordered devices and a planner-made cut
    assert len(set(plan.lane_weights)) > 1  # the lanes get different shares (3 and 5 rows of 8)


def test_hardware_aware_data_parallel_shares_match_one_process():
    from whale.cluster import ClusterSpec

    results = _check(4, {"layers": (2,), "batch": 16, "cluster": ClusterSpec.from_dict(MIXED)})
    plan = wh.Plan.from_json(results[0]["plan"])
    assert sorted(b - a for lane in plan.micro_batch_rows(16) for a, b in lane) != [4, 4, 4, 4]


def test_gradient_clipping_matches_clip_grad_norm():
    # SGD with momentum: its update is linear in the gradient, so a wrong clip coefficient shows in the
    # parameters (Adam would normalize it away)
    _check(4, {"layers": (1, 2), "batch": 8, "mb": 2, "clip": 0.05, "shares": (3, 1), "sgd": True})


def test_several_values_and_a_relayed_skip_cross_stage_boundaries():
    # float activation, bool mask, a Python int and a stage-0 tensor used in stage 2 (relayed through 1)
    results = _check(3, {"layers": None, "skip": True, "batch": 6, "mb": 3})
    assert sorted(r["stage"] for r in results) == [0, 1, 2]


class _Transposing(torch.nn.Module):
    """Two stages whose boundary values are not contiguous: stage 0 hands over ``linear(x).t()``-style views."""

    def __init__(self, d=8):
        super().__init__()
        with wh.replicate(1):
            self.a = torch.nn.Linear(d, d)
        with wh.replicate(1):
            self.b = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x).t()  # [d, rows]: a strided view of stage 0's output crosses the boundary
        return (self.b.weight @ h).t() + self.b.bias


def _strided(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2))
    model = _Transposing()
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, torch.nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses = mse_side_by_side(engine, ref, ref_opt, 3, (8, 8), (8, 8))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    return losses


def test_non_contiguous_boundary_values_cross_both_ways():
    run_ranks(_strided, 2)
