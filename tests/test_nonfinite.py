"""NaN/inf losses and gradients and non-scalar losses (:mod:`whale.runtime.nonfinite`, ``Config(nonfinite)``).

Every multi-process case runs at world 2 on gloo: the batch check no longer mistakes a NaN batch for different
batches; a NaN/inf loss or gradient found on ONE rank (one lane, one ZeRO slice, one pipeline stage) raises on
every rank before the update, with the weights of the step before (one-process reference), or is skipped on
every rank with later steps matching a one-process reference that skips the same step; an all-ignored
micro-batch under a plain mean loss points to wh.token_cross_entropy; a non-scalar loss raises on every rank.
Each route the flag takes is covered: no flag (DP, loss fused into the bucket), the loss all-reduce (tied
pipeline; fp16; a split head), clipping's norm all-reduce (ZeRO-2, ZeRO-3) and its own all-reduce (untied
pipeline: the NaN on stage 0 or 1, on one lane or two).
"""

from __future__ import annotations

import copy
import functools
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM
from tests.test_zero import ATOL, CLIP, RTOL, _batches, _groups, zero_engine
from whale.runtime.batch import fingerprint
from whale.runtime.nonfinite import NonFiniteGuard

HINT = r"use wh\.token_cross_entropy"


def _ce(mode: dict):
    """Plain mean cross-entropy over [B, T, V] logits (``mode["reduction"] = "none"``: a non-scalar)."""
    def loss(logits, y):
        return F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=-100, reduction=mode["reduction"])
    return loss


def _error(fn, kind) -> str:
    """The message of the ``kind`` error ``fn()`` raises."""
    with pytest.raises(kind) as info:
        fn()
    return str(info.value)


# --- no processes --------------------------------------------------------------------------------------------
def test_fingerprint_agrees_on_identical_batches_with_nan_and_inf_and_tells_different_ones_apart():
    x, y = torch.randn(4, 3), torch.arange(4)
    x[1, 2], x[3, 0] = math.nan, math.inf
    fp = fingerprint((x, y))
    assert all(math.isfinite(v) for v in fp) and fp == fingerprint((x.clone(), y.clone()))
    moved, sign, value, rows = x.clone(), x.clone(), x.clone(), x[[1, 0, 2, 3]]
    moved[1, 2], moved[2, 2] = 0.0, math.nan  # the NaN elsewhere
    sign[3, 0] = -math.inf
    value[0, 0] += 1.0
    for other in (moved, sign, value, rows):
        assert fingerprint((other, y)) != fp


def test_config_nonfinite_is_validated():
    assert wh.Config().nonfinite == "raise" and wh.Config(nonfinite="skip").nonfinite == "skip"
    with pytest.raises(wh.ConfigError, match=r"nonfinite='ignore' is unknown; choose 'raise' .* or 'skip'"):
        wh.Config(nonfinite="ignore")


def test_an_all_ignored_micro_batch_is_named_and_points_to_token_cross_entropy():
    """The guard at world 1: micro-batch 1's targets are all ignored, so its mean loss is 0/0."""
    logits = torch.randn(2, 4, 5, requires_grad=True)
    y = torch.tensor([[1, 2, 3, 0], [-100] * 4])
    for policy in ("raise", "skip"):
        guard = NonFiniteGuard(policy, _ce({"reduction": "mean"}), {}, 0, 1, torch.device("cpu"), 0, 1, 0, 1)
        guard.start()
        losses = [guard.loss_fn(logits[i: i + 1], y[i: i + 1]) for i in range(2)]
        assert math.isfinite(float(losses[0].detach())) and math.isnan(float(losses[1].detach()))
        assert guard.local([]) == 1.0
        text = r"step 7: the loss is not finite: the loss of micro-batch 1 is nan\. .*" + HINT
        if policy == "raise":
            assert "Config(nonfinite='skip')" in _error(lambda g=guard: g.act([], 7), wh.NonFiniteError)
            with pytest.raises(wh.NonFiniteError, match=text):
                guard.act([], 7)
        else:
            with pytest.warns(RuntimeWarning, match=r"whale: step 7 skipped .*" + text[8:]):
                guard.act([], 7)
            assert guard.metrics(True, False) == {"skipped": True, "nonfinite": "the loss of micro-batch 1 is nan"}


# --- data parallel: a NaN in the batch, different batches, a non-scalar loss -----------------------------------
def _dp_batch_errors(rank, world):
    ctx = wh.init(wh.Config())
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    mode = {"reduction": "mean"}
    engine = wh.parallelize(model, _ce(mode), lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    bad = x.clone()
    bad[5, 1] = math.nan  # a row of lane 1 (rows 4..7)
    errors = [_error(lambda: engine.step((bad, y)), wh.NonFiniteError),
              _error(lambda: engine.step((x + rank, y)), wh.BatchError)]  # ranks given different batches
    mode["reduction"] = "none"
    errors.append(_error(lambda: engine.step((x, y)), wh.LossShapeError))
    mode["reduction"] = "mean"
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, r)  # nothing was stepped
    out = engine.step((x, y))  # and the engine steps on as one process would
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
    return errors, out["loss"]


def test_nan_in_the_batch_is_a_nonfinite_error_not_different_batches_on_every_rank():
    results = run_ranks(_dp_batch_errors, 2)
    for errors, loss in results:
        nan, differ, shape = errors
        assert nan == results[0][0][0]  # the same message on every rank
        assert nan.startswith("step 0: the loss is not finite: the loss of micro-batch 0 of lane 1 is nan. Check "
                              "the batch for NaN/inf")
        assert "different batches" not in nan
        assert differ.startswith("the ranks were given different batches")
        assert shape.startswith("step 0: loss_fn returned a tensor of shape (4,) for micro-batch 0 of lane 0; loss_fn "
                                "must return a scalar (one element): reduce it, e.g. with .mean()")
        assert math.isfinite(loss)


# --- a pipeline: an all-ignored micro-batch, a non-scalar loss (train and eval), under fp32 and fp16 -------------
def _pipe_losses(rank, world, precision):
    ctx = wh.init(wh.Config(num_micro_batch=2, precision=precision))
    model = TinyLM(stage_layers=(1, 1), tied=False)
    mode = {"reduction": "mean"}
    engine = wh.parallelize(model, _ce(mode), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    x, y = _batches(1)[0]
    x, y = x[:4], y[:4].clone()
    y[2:] = -100  # micro-batch 1 (rows 2, 3) has no valid target
    errors = [_error(lambda: engine.step((x, y)), wh.NonFiniteError)]
    mode["reduction"] = "none"
    errors.append(_error(lambda: engine.step((x, y)), wh.LossShapeError))
    errors.append(_error(lambda: engine.eval_step((x, y)), wh.LossShapeError))
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    assert not engine.optimizer.state  # no optimizer step was taken
    return errors


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_pipeline_loss_errors_reach_every_stage(precision):
    """The loss is computed on stage 1 only; stage 0 raises the same error (fp16: a NaN loss is no overflow)."""
    a, b = run_ranks(_pipe_losses, 2, precision)
    assert a == b
    assert a[0].startswith("step 0: the loss is not finite: the loss of micro-batch 1 is nan. ")
    assert HINT.replace("\\", "") in a[0]
    assert a[1].startswith("step 0: loss_fn returned a tensor of shape (16,) for micro-batch 0; ")
    assert a[2].startswith("step 0: loss_fn returned a tensor of shape (16,) for micro-batch 0; ")


# --- a NaN gradient on ONE rank at step 2: every rank raises with the weights after step 1 ---------------------
def _poison(engine, spec, step):
    """A NaN gradient for ``spec["param"]`` on the rank at ``spec["poison"]`` = (stage, lane) at step
    ``spec["at"]`` (a tensor hook: before accumulation and any reduction; the loss stays finite)."""
    if (engine.stage, engine.lane) == tuple(spec["poison"]):
        p = dict(engine.module.named_parameters())[spec["param"]]
        p.register_hook(lambda g: torch.full_like(g, math.nan) if step[0] == spec["at"] else g)


def _reference(ref, steps: int, clip, skip: int | None = None):
    """One process: AdamW with the same groups, StepLR, token-mean loss, clipping; ``skip``: that step's
    update is skipped (gradients dropped; the scheduler still steps, as with GradScaler)."""
    opt = torch.optim.AdamW(_groups(ref), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    losses = []
    for s, (x, y) in enumerate(_batches(steps)):
        opt.zero_grad()
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        if s != skip:
            opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()" when step 0 is skipped
            sched.step()
        losses.append(loss.item())
    return losses


def _raise_at_step_2(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=spec.get("zero", 0), max_grad_norm=spec.get("clip")))
    engine, ref, opt = zero_engine(ctx, world, spec, functools.partial(TinyLM, tied=spec.get("tied", True)))
    step = [0]
    _poison(engine, spec, step)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    batches = _batches(3)
    for batch in batches[:2]:
        engine.step(batch)
        sched.step()
        step[0] += 1
    message = _error(lambda: engine.step(batches[2]), wh.NonFiniteError)
    _reference(ref, 2, spec.get("clip"))
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in engine.module.named_parameters(remove_duplicate=False):  # the weights after step 1
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert engine.steps_done == 2 and all(int(s["step"]) == 2 for s in opt.state.values())
    return message


@pytest.mark.parametrize("spec", [
    # untied 2-stage pipeline: only stage 1 sees the NaN (stage 0's gradients stay finite); the flag's own all-reduce
    {"layers": (1, 1), "tied": False, "poison": (1, 0), "at": 2, "param": "blocks.1.fc2.weight",
     "names": r"'blocks\.1\.fc2\.weight' \(stage 1\)"},
    # ZeRO-2 data parallel with clipping: the NaN is reduce-scattered onto one lane's slice only
    {"layers": (2,), "zero": 2, "clip": CLIP, "poison": (0, 1), "at": 2, "param": "blocks.0.fc1.weight",
     "names": r"'blocks\.0\.fc1\.weight'"},
], ids=["pipeline-stage1-only", "zero2-clip"])
def test_a_nan_gradient_on_one_rank_raises_everywhere_before_the_update(spec):
    messages = run_ranks(_raise_at_step_2, 2, spec)
    assert messages[0] == messages[1]
    pattern = (r"step 2: a gradient is not finite \(the losses are\): the gradient of " + spec["names"]
               + r" holds NaN\. .*set_detect_anomaly.*The optimizer step was not taken")
    assert messages[0].count("the gradient of") == 1
    assert re.match(pattern, messages[0]), messages[0]


# --- nonfinite="skip": the same step skipped everywhere, then the one-process trajectory that skips it ---------
def _same(a, b) -> bool:
    """Whether two (nested) state dicts hold equal values and tensors."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, z) for x, z in zip(a, b, strict=True))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _skip(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=spec.get("zero", 0), max_grad_norm=spec.get("clip"),
                            nonfinite="skip"))
    engine, ref, opt = zero_engine(ctx, world, spec, functools.partial(TinyLM, tied=spec.get("tied", True)))
    step = [0]
    _poison(engine, spec, step)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    outs, unchanged = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s, batch in enumerate(_batches(4)):
            state = copy.deepcopy(opt.state_dict())
            full = engine.full_state_dict()
            outs.append(engine.step(batch))
            if s == spec["at"]:
                after = engine.full_state_dict()
                unchanged = all(torch.equal(full[k], after[k]) for k in full) and _same(opt.state_dict(), state)
            sched.step()
            step[0] += 1
    ref_losses = _reference(ref, 4, spec.get("clip"), skip=spec["at"])
    torch.testing.assert_close(torch.tensor([o["loss"] for o in outs]), torch.tensor(ref_losses), rtol=RTOL,
                               atol=ATOL)
    full = engine.full_state_dict()
    for name, p in ref.named_parameters():
        if rank == 0:
            torch.testing.assert_close(full[name], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
    warned = [str(w.message) for w in caught if "whale: step" in str(w.message)]
    return [o["skipped"] for o in outs], [o.get("nonfinite") for o in outs], unchanged, warned


@pytest.mark.parametrize("spec", [
    # ZeRO-3 data parallel with clipping: the flag rides on the norm all-reduce
    {"layers": (2,), "zero": 3, "clip": CLIP, "poison": (0, 1), "at": 1, "param": "blocks.1.fc2.weight",
     "names": "the gradient of 'blocks.1.fc2.weight' holds NaN"},
    # tied 2-stage pipeline: the NaN on stage 0 only; the flag rides on the loss all-reduce
    {"layers": (1, 1), "poison": (0, 0), "at": 1, "param": "blocks.0.fc1.weight",
     "names": "the gradient of 'blocks.0.fc1.weight' (stage 0) holds NaN"},
    # untied 2-stage pipeline, the NaN on stage 0 only (the last backward of the step): the flag's own all-reduce
    {"layers": (1, 1), "tied": False, "poison": (0, 0), "at": 1, "param": "blocks.0.fc1.weight",
     "names": "the gradient of 'blocks.0.fc1.weight' (stage 0) holds NaN"},
    # the same on 2 lanes per stage (world 4), the NaN on one lane of stage 0 (before the lanes' reduction) ...
    {"layers": (1, 1), "tied": False, "world": 4, "poison": (0, 1), "at": 2,
     "param": "blocks.0.fc2.weight",
     "names": "the gradient of 'blocks.0.fc2.weight' (stage 0) holds NaN"},
    # ... and on one lane of stage 1
    {"layers": (1, 1), "tied": False, "world": 4, "poison": (1, 1), "at": 1,
     "param": "blocks.1.fc1.weight",
     "names": "the gradient of 'blocks.1.fc1.weight' (stage 1) holds NaN"},
], ids=["zero3-clip", "tied-pipeline-stage0-only", "pipeline-stage0-only", "pp2xdp2-stage0-lane1",
        "pp2xdp2-stage1-lane1"])
def test_skip_skips_the_same_step_everywhere_and_then_matches_one_process(spec):
    results = run_ranks(_skip, spec.get("world", 2), spec, timeout=90)
    for rank, (skipped, named, unchanged, warned) in enumerate(results):
        assert skipped == [s == spec["at"] for s in range(4)]
        assert named == [spec["names"] if s == spec["at"] else None for s in range(4)]
        assert unchanged  # parameters and optimizer state as before the skipped step
        assert len(warned) == (1 if rank == 0 else 0)
    assert results[0][3][0].startswith(f"whale: step {spec['at']} skipped (no optimizer step, gradients zeroed): "
                                       f"a gradient is not finite (the losses are): {spec['names']}")


# --- a split head: a NaN in ONE rank's shard of its gradient ---------------------------------------------------
def _split_shard(rank, world):
    from tests.test_split_runtime import Classifier

    ctx = wh.init(wh.Config())
    model = Classifier(classes=10)
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    step = [0]
    if rank == 1:  # only this rank's shard of the head gets a NaN gradient at step 1
        shard = dict(engine.module.named_parameters())["head.sharded.weight"]
        shard.register_hook(lambda g: torch.full_like(g, math.nan) if step[0] == 1 else g)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(2)]
    engine.step(batches[0])
    step[0] += 1
    message = _error(lambda: engine.step(batches[1]), wh.NonFiniteError)
    full = engine.full_state_dict()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(batches[0][0]), batches[0][1]).backward()
    ref_opt.step()
    for name, t in full.items():  # rank 0 only: the weights after step 0
        torch.testing.assert_close(t, ref.state_dict()[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return message


def test_a_nan_in_one_split_shard_raises_on_every_rank():
    messages = run_ranks(_split_shard, 2)
    assert messages[0] == messages[1]
    assert messages[0].startswith("step 1: a gradient is not finite (the losses are): the gradient of "
                                  "'head.weight (shard 1)' holds NaN. ")  # its original name


def test_max_abs_check_is_exact_on_cpu_also_when_a_sum_overflows():
    """The CPU fast path (a sum per gradient, the max-abs norm only where the sum is not finite) flags exactly the
    gradients holding a NaN or inf: finite values whose sum overflows to inf are no false alarm."""
    from whale.runtime.nonfinite import _max_abs

    big = torch.full((4,), 3e38)  # finite; its fp32 sum is inf
    nan, inf, ok = torch.tensor([1.0, math.nan]), torch.tensor([-math.inf, 2.0]), torch.ones(3)
    assert _max_abs([ok]) == [] and _max_abs([]) == []
    norms = _max_abs([ok, big, nan, inf, ok.half()])
    assert [bool(torch.isfinite(n)) for n in norms] == [True, False, False]
