"""Mixed precision (``Config(precision=...)``) against one-process references that run the same autocast.

bf16 tolerance. bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 2e-3). Autocast rounds every matmul's
output to bf16, and micro-batching changes WHICH sums are rounded: the reference computes one weight gradient
over the whole batch and rounds it once, the engine rounds each micro-batch's (and lane's) partial gradient
before summing them in fp32, and a forward on fewer rows may take another kernel blocking. So the results
agree to bf16 roundings, not to fp32's 1e-6: the losses (fp32 cross-entropy of bf16 logits) within
rtol 2e-3 ~ u, one rounding of the logits; the parameters after AdamW steps at lr 1e-3 within atol 1e-3 = lr,
rtol 1e-2: Adam divides each gradient element by its own RMS, so an element whose gradient is ~0 can move
by up to lr on a few ulps of rounding noise, while a real bug (a missed or doubled micro-batch, an unscaled
gradient) moves many elements by ~lr every step. Measured on the DP x PP case: loss 2.5e-5 relative, parameters
2.5e-5 absolute (fp32 runs: 1e-7). fp16 keeps 11 bits (u = 2^-12): the same bounds hold a fortiori. The bf16 and
reported-loss tests also check that autocast really ran (the loss is farther from the fp32 loss than fp32 noise).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches

LR, STEPS = 1e-3, 3
LOSS_RTOL = 2e-3


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2 * LR}]


def _token_loss(logits, y):
    """One process's token-mean cross-entropy, in fp32 (as the engine computes it)."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)


def _padded(steps, batch, seed=1):
    """LM batches with some ignored targets, so the token weighting matters."""
    out = []
    for i, (x, y) in enumerate(lm_batches(steps, batch, seed=seed)):
        y = y.clone()
        y[i % batch, 3:] = -100
        y[(i + 3) % batch, 1:] = -100
        out.append((x, y))
    return out


def _assert_params_close(engine, ref):
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        assert p.dtype == torch.float32, f"{name} is {p.dtype}: master weights must stay fp32"
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-2, atol=LR,
                                   msg=lambda m, n=name: f"{n}: {m}")


# --- (a) bf16: DP x PP at world 4, token-weighted loss, AdamW with param groups and an LR scheduler ----------
def _bf16_dp_pp(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=spec["mb"], precision="bf16", max_grad_norm=spec.get("clip")))
    model = TinyLM(stage_layers=spec["layers"])
    ref, fp32 = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(_groups(m), lr=LR) for m in (model, ref))
    sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s) for o in (opt, ref_opt))
    engine = wh.parallelize(model, wh.token_cross_entropy(), opt, ctx=ctx)
    assert engine.plan.precision == "bf16"
    losses, ref_losses, fp32_losses = [], [], []
    for x, y in _padded(STEPS, 8):
        out = engine.step((x, y))
        losses.append(out["loss"])
        sched.step()
        with torch.no_grad():
            fp32_losses.append(float(_token_loss(fp32(x), y)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ref(x)
        loss = _token_loss(logits, y)
        ref_opt.zero_grad()
        loss.backward()
        if spec.get("clip"):
            torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["clip"])
        ref_opt.step()
        ref_sched.step()
        ref_losses.append(loss.item())
        fp32.load_state_dict(ref.state_dict())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    _assert_params_close(engine, ref)
    return losses, fp32_losses, [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("spec", [{"layers": (1, 1), "mb": 2}, {"layers": (1, 1), "mb": 2, "clip": 0.5}])
def test_bf16_dp_x_pp_matches_one_process_autocast(spec):
    results = run_ranks(_bf16_dp_pp, 4, spec, timeout=120)
    losses, fp32_losses, lrs = results[0]
    assert all(r[0] == losses for r in results)  # every rank reports the same global loss
    assert max(abs(a - b) for a, b in zip(losses, fp32_losses, strict=True)) > 1e-4  # bf16 really ran
    assert lrs == pytest.approx([LR / 8, 2 * LR / 8])  # the scheduler drove the user's groups


# --- (b) fp16: dynamic loss scaling identical everywhere; an overflow on ONE rank skips every rank's step ------
INF_STEP = 2


def _poison(engine, spec, step):
    """On the one rank named by ``spec["poison"]`` = (stage, lane), make ``spec["param"]``'s gradient inf at
    step ``INF_STEP`` (a tensor hook: before accumulation and before any all-reduce)."""
    if (engine.stage, engine.lane) != tuple(spec["poison"]):
        return
    params = dict(engine.module.named_parameters())
    p = params[spec["param"]]
    p.register_hook(lambda g: torch.full_like(g, math.inf) if step[0] == INF_STEP else g)


def _fp16(rank, world, spec):
    scale = wh.LossScale(init_scale=2.0 ** 10, growth_interval=2)
    ctx = wh.init(wh.Config(num_micro_batch=spec["mb"], precision="fp16", loss_scale=scale,
                            max_grad_norm=spec.get("clip"), zero=spec.get("zero", 0)))
    model = TinyLM(stage_layers=spec["layers"], tied=spec.get("tied", True))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(_groups(m), lr=LR) for m in (model, ref))
    engine = wh.parallelize(model, wh.token_cross_entropy(), opt, ctx=ctx)
    step = [0]
    _poison(engine, spec, step)
    ref_step = [0]
    ref_p = dict(ref.named_parameters())[spec["param"]]
    ref_p.register_hook(lambda g: torch.full_like(g, math.inf) if ref_step[0] == INF_STEP else g)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    record = []
    for x, y in _padded(5, 8):
        before = [p.detach().clone() for p in engine.module.parameters()]
        counts = [int(s["step"]) for s in opt.state.values()]
        out = engine.step((x, y))
        changed = any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True))
        record.append({"loss": out["loss"], "scale": out["loss_scale"], "skipped": out["skipped"],
                       "changed": changed, "counts": counts, "after": [int(s["step"]) for s in opt.state.values()]})
        step[0] += 1
        with torch.autocast("cpu", dtype=torch.float16):
            logits = ref(x)
        loss = _token_loss(logits, y)
        ref_opt.zero_grad()
        scaler.scale(loss).backward()
        if spec.get("clip"):
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["clip"])
        scaler.step(ref_opt)
        scaler.update()
        ref_step[0] += 1
        record[-1].update(ref_loss=loss.item(), ref_scale=scaler.get_scale())
    _assert_params_close(engine, ref)  # 4 steps taken, one skipped
    return record


@pytest.mark.parametrize("world,spec", [
    (2, {"layers": (2,), "mb": 2, "poison": (0, 1), "param": "blocks.1.fc2.weight"}),  # DP + accumulation
    (2, {"layers": (1, 1), "mb": 2, "poison": (0, 0), "param": "blocks.0.fc1.weight", "tied": False}),  # PP
    (4, {"layers": (1, 1), "mb": 2, "poison": (0, 1), "param": "blocks.0.fc1.weight", "tied": False,
         "clip": 0.5}),  # DP x PP: the overflow is in stage 0 lane 1 only; stage 1 never sees an inf gradient
    (4, {"layers": (1, 1), "mb": 2, "poison": (0, 1), "param": "blocks.0.fc1.weight", "clip": 0.5,
         "zero": 2}),  # ZeRO-2 (tied embedding): the inf is reduce-scattered onto its owner's slice
])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world, spec):
    records = run_ranks(_fp16, world, spec, timeout=120)
    for record in records:
        assert [r["skipped"] for r in record] == [s == INF_STEP for s in range(5)]
        assert [r["changed"] for r in record] == [s != INF_STEP for s in range(5)]  # params unchanged when skipped
        assert record[INF_STEP]["after"] == record[INF_STEP]["counts"]  # the optimizer did not count a step
        # GradScaler's rule (init 2^10, growth every 2 finite steps), the same on every rank and as torch's
        assert [r["scale"] for r in record] == [2.0 ** 10, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11]
        assert [r["scale"] for r in record] == [r["ref_scale"] for r in record]
        same = ("loss", "scale", "skipped", "changed")  # identical on every rank (stages hold other parameters)
        assert [[r[k] for k in same] for r in record] == [[r[k] for k in same] for r in records[0]]
        # (c) the reported loss is a float, unscaled (~14 for this model, not 2^10 times that), close to torch's
        for r in record:
            assert isinstance(r["loss"], float) and r["loss"] < 100
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=LOSS_RTOL)


# --- (c) the reported loss is fp32 and unscaled ---------------------------------------------------------------
def _first_loss(rank, world, precision):
    ctx = wh.init(wh.Config(precision=precision, loss_scale=wh.LossScale(init_scale=2.0 ** 12)))
    model = TinyLM(stage_layers=(2,))
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    x, y = _padded(1, 8)[0]
    with torch.no_grad():
        fp32 = float(_token_loss(ref(x), y))
        with torch.autocast("cpu", dtype=wh.runtime.precision.DTYPES[precision]):
            logits = ref(x)
    eval_loss = engine.eval_step((x, y))["loss"]
    return engine.step((x, y))["loss"], float(_token_loss(logits, y)), eval_loss, fp32


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_reported_loss_is_fp32_and_unscaled(precision):
    for loss, expect, eval_loss, fp32 in run_ranks(_first_loss, 2, precision):
        # each lane's rows see the same autocast ops as the reference's: only fp32 summation order differs
        assert isinstance(loss, float) and loss == pytest.approx(expect, rel=1e-6)
        assert eval_loss == pytest.approx(expect, rel=1e-6)  # eval runs under the same autocast
        assert abs(loss - fp32) > 4e-6 * fp32  # autocast really ran (fp16: ~1e-5 from fp32; bf16: more)


# --- fp16 with split: an overflow in ONE rank's shard of a class-sharded head ---------------------------------
def _fp16_split(rank, world):
    from tests.test_split_runtime import Classifier

    scale = wh.LossScale(init_scale=2.0 ** 8, growth_interval=2)
    ctx = wh.init(wh.Config(precision="fp16", loss_scale=scale, max_grad_norm=1.0))
    model = Classifier(classes=10)
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.cross_entropy, lambda ps: torch.optim.AdamW(ps, lr=LR), ctx=ctx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    step = [0]
    if rank == 1:  # only this rank's shard of the head gets an inf gradient; no collective carries it
        shard = next(p for n, p in engine.module.named_parameters() if "head" in n and n.endswith("weight"))
        shard.register_hook(lambda g: torch.full_like(g, math.inf) if step[0] == INF_STEP else g)
    ref.head.weight.register_hook(lambda g: torch.full_like(g, math.inf) if step[0] == INF_STEP else g)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    g = torch.Generator().manual_seed(3)
    record = []
    for _ in range(4):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        out = engine.step((x, y))
        with torch.autocast("cpu", dtype=torch.float16):
            logits = ref(x)
        loss = F.cross_entropy(logits.float(), y)
        ref_opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(ref_opt)
        scaler.update()
        step[0] += 1
        record.append((out["skipped"], out["loss_scale"], scaler.get_scale(), out["loss"], loss.item()))
    full = engine.full_state_dict()
    for name, t in full.items():
        torch.testing.assert_close(t, ref.state_dict()[name], rtol=1e-2, atol=LR, msg=lambda m, n=name: f"{n}: {m}")
    return record


def test_fp16_overflow_in_one_split_shard_skips_every_rank():
    records = run_ranks(_fp16_split, 2, timeout=120)
    for record in records:
        assert [r[0] for r in record] == [s == INF_STEP for s in range(4)]
        assert [r[1] for r in record] == [r[2] for r in record] == [2.0 ** 8, 2.0 ** 9, 2.0 ** 8, 2.0 ** 8]
        for r in record:
            assert r[3] == pytest.approx(r[4], rel=LOSS_RTOL)
    assert [r[:2] for r in records[0]] == [r[:2] for r in records[1]]


# --- the scaler's state is checkpointed -----------------------------------------------------------------------
def _scaler_checkpoint(rank, world, path):
    def make():
        ctx = wh.init(wh.Config(num_micro_batch=2, precision="fp16",
                                loss_scale=wh.LossScale(init_scale=4.0, growth_interval=1)))
        return wh.parallelize(TinyLM(stage_layers=(1, 1)), wh.token_cross_entropy(),
                              lambda ps: torch.optim.AdamW(ps, lr=LR), ctx=ctx)
    engine = make()
    for batch in _padded(3, 8):
        engine.step(batch)
    engine.save_checkpoint(path)
    saved = engine.state_dict()["loss_scale"]
    again = make()
    again.load_checkpoint(path)
    return saved, again.state_dict()["loss_scale"], again.step(_padded(1, 8)[0])["loss_scale"]


def test_the_loss_scale_is_saved_and_restored(tmp_path):
    for saved, restored, next_scale in run_ranks(_scaler_checkpoint, 2, str(tmp_path), timeout=120):
        assert saved == restored == {"scale": 32.0, "growth_tracker": 0}  # 4 * 2^3: grew every finite step
        assert next_scale == 64.0


# --- configuration and plan -----------------------------------------------------------------------------------
def test_precision_is_validated_recorded_in_the_plan_and_round_trips():
    with pytest.raises(wh.ConfigError, match="precision='fp8' is unknown"):
        wh.Config(precision="fp8")
    with pytest.raises(wh.ConfigError, match="backoff_factor"):
        wh.LossScale(backoff_factor=1.5)
    with pytest.raises(wh.ConfigError, match="growth_interval"):
        wh.LossScale(growth_interval=0)
    plan = wh.plan_model(TinyLM(stage_layers=(1, 1)), 4, wh.Config(num_micro_batch=2, precision="fp16"))
    assert plan.precision == "fp16" and wh.Plan.from_json(plan.to_json()) == plan
    assert "fp16 autocast + dynamic loss scaling" in str(plan).splitlines()[0]
    old = plan.to_dict()
    del old["precision"]  # a plan written before the field existed loads, as fp32
    assert wh.Plan.from_dict(old).precision == "fp32"
    with pytest.raises(wh.PlanError, match="precision 'bf17' is unknown"):
        wh.Plan.from_dict({**old, "precision": "bf17"})


def test_a_plan_for_another_precision_is_refused():
    from whale.runtime.context import Context
    from whale.runtime.parallelize import check_plan_fits

    plan = wh.plan_model(TinyLM(), 1, wh.Config(precision="bf16"))
    ctx = Context(config=wh.Config(), rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(wh.PlanError, match="precision 'bf16' but this job has 'fp32'"):
        check_plan_fits(plan, ctx)


def test_whale_plan_command_takes_precision(capsys):
    from whale.cli import main

    rc = main(["plan", "--model", "examples.gpt.model:for_plan", "--world", "2", "--json", "--precision", "bf16",
               "--args", "stages=1"])
    assert rc == 0 and wh.Plan.from_json(capsys.readouterr().out).precision == "bf16"
