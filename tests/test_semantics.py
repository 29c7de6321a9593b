"""Training semantics users rely on, each against a one-process ``deepcopy`` reference: token-weighted losses,
parameters that get no gradient (unused, frozen, unfrozen later), the user's own optimizer with param groups
and an LR scheduler, a bf16 model's reported loss, and batches that are malformed or differ across ranks.

Tolerance as in test_equivalence (fp32, rtol 1e-5, atol 1e-6, AdamW lr 1e-3 unless said).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import Block, TinyLM, lm_batches, lm_loss, mse_side_by_side, reference_step

RTOL, ATOL = 1e-5, 1e-6


def _assert_same(engine, ref, losses, ref_losses):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


# --- 1. token-weighted losses --------------------------------------------------------------------------------
def _padded_batches(steps: int, batch: int, valid: list[int]):
    """LM batches whose row i holds ``valid[i]`` valid targets (the rest -100)."""
    out = []
    for x, y in lm_batches(steps, batch):
        y = y.clone()
        for i, v in enumerate(valid):
            y[i, v:] = -100
        out.append((x, y))
    return out


def _token_loss(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=spec.get("mb", 1), load_shares=spec.get("shares")))
    model = TinyLM(stage_layers=spec["layers"])
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for x, y in _padded_batches(3, len(spec["valid"]), spec["valid"]):
        losses.append(engine.step((x, y))["loss"])
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        ref_losses.append(reference_step(ref_opt, ref_loss))
    _assert_same(engine, ref, losses, ref_losses)
    return losses


@pytest.mark.parametrize("world,spec", [
    (2, {"layers": (2,), "valid": [1, 1, 1, 0, 8, 8, 8, 8]}),  # rank 0: 3 valid tokens, rank 1: 32
    (2, {"layers": (2,), "valid": [0, 0, 0, 0, 8, 8, 8, 5], "mb": 2, "shares": (3, 1)}),  # an empty micro-batch
    (4, {"layers": (1, 1), "valid": [2, 0, 1, 0, 8, 8, 7, 8], "mb": 2}),  # 2 stages x 2 lanes, tied weights
])
def test_token_weighted_loss_matches_one_process(world, spec):
    for losses in run_ranks(_token_loss, world, spec):
        assert all(torch.isfinite(torch.tensor(losses)))


# --- 2. parameters that get no gradient ----------------------------------------------------------------------
class Sometimes(nn.Module):
    """A block used only when ``use_extra`` is set, and one never used."""

    def __init__(self, d=8):
        super().__init__()
        self.first, self.extra, self.never = nn.Linear(d, d), Block(d), nn.Linear(d, d)
        self.use_extra = True

    def forward(self, x):
        x = self.first(x)
        return self.extra(x) if self.use_extra else x


def _no_grad(rank, world):
    ctx = wh.init(wh.Config(load_shares=(3, 1)))
    model = Sometimes()
    model.first.weight.requires_grad_(False)  # frozen when parallelize runs, unfrozen at step 2
    ref = copy.deepcopy(model)
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    engine = wh.parallelize(model, F.mse_loss, make, ctx=ctx)
    ref_opt = make(ref.parameters())
    g = torch.Generator().manual_seed(5)
    losses, ref_losses = [], []
    for step in range(5):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        engine.module.use_extra = ref.use_extra = step % 2 == 0
        if step == 2:
            engine.module.first.weight.requires_grad_(True)
            ref.first.weight.requires_grad_(True)
        losses.append(engine.step((x, y))["loss"])
        ref_losses.append(reference_step(ref_opt, F.mse_loss(ref(x), y)))
    _assert_same(engine, ref, losses, ref_losses)
    return model.never.weight.detach().clone()


def test_unused_frozen_and_unfrozen_parameters_match_one_process():
    never_0, never_1 = run_ranks(_no_grad, 2)
    assert torch.equal(never_0, never_1)


# --- 3. the user's optimizer, its param groups and LR scheduler -----------------------------------------------
def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-3}]


def _user_optimizer(rank, world, spec):
    from tests.test_split_runtime import Classifier

    ctx = wh.init(wh.Config(load_shares=spec.get("shares")))
    model = Classifier(classes=10) if spec["split"] else TinyLM(stage_layers=(2,))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(_groups(m), lr=1e-3) for m in (model, ref))
    warm = [lambda s: min(1.0, s / 2), lambda s: 0.5 ** s]  # a warm-up from 0, and a decay
    sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, warm) for o in (opt, ref_opt))
    loss_fn = wh.cross_entropy if spec["split"] else lm_loss
    engine = wh.parallelize(model, loss_fn, opt, ctx=ctx)
    assert engine.optimizer is opt
    g = torch.Generator().manual_seed(2)
    losses, ref_losses, lrs = [], [], []
    for x, y in (lm_batches(4, 8) if not spec["split"] else
                 [(torch.randn(8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]):
        losses.append(engine.step((x, y))["loss"])
        sched.step()
        ref_opt.zero_grad()
        loss = (F.cross_entropy if spec["split"] else lm_loss)(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        ref_losses.append(loss.item())
        lrs.append([grp["lr"] for grp in opt.param_groups])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    if not spec["split"]:
        _assert_same(engine, ref, losses, ref_losses)
    return lrs, [len(grp["params"]) for grp in opt.param_groups]


@pytest.mark.parametrize("spec", [{"split": False, "shares": (5, 3)}, {"split": True, "shares": (5, 3)}])
def test_the_users_optimizer_groups_and_scheduler_drive_training(spec):
    for lrs, sizes in run_ranks(_user_optimizer, 2, spec):
        assert lrs[0] == pytest.approx([0.5e-3, 0.5 * 2e-3]) and lrs[-1] == pytest.approx([1e-3, 2e-3 / 16])
        assert all(sizes)


def test_an_optimizer_that_stepped_or_belongs_to_a_copy_is_refused():
    from whale.runtime.optim import OptimizerError, bind_optimizer

    model = TinyLM()
    used = torch.optim.AdamW(model.parameters(), lr=0.1)
    lm_loss(model(lm_batches(1, 2)[0][0]), lm_batches(1, 2)[0][1]).backward()
    used.step()
    with pytest.raises(OptimizerError, match="already taken steps"):
        bind_optimizer(used, model, {id(p) for p in model.parameters()})
    other = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    with pytest.raises(OptimizerError, match="none of the model's parameters"):
        bind_optimizer(other, model, {id(p) for p in model.parameters()})


# --- 10. bf16 parameters: the reported loss is not rounded to bf16 -------------------------------------------
def _bf16(rank, world):
    ctx = wh.init(wh.Config(load_shares=(5, 3)))
    model = TinyLM(stage_layers=(2,)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, lambda out, y: lm_loss(out.float(), y),
                            lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    x, y = lm_batches(1, 8)[0]
    with torch.no_grad():
        expect = sum(float(lm_loss(ref(x[a:b]).float(), y[a:b])) * (b - a) / 8 for a, b in ((0, 5), (5, 8)))
    return engine.step((x, y))["loss"], expect


def test_a_bf16_models_loss_is_reported_in_fp32():
    for loss, expect in run_ranks(_bf16, 2):
        assert loss == pytest.approx(expect, rel=1e-6)


# --- 13, 15. malformed batches and batches that differ across ranks ------------------------------------------
def _bad_batches(rank, world):
    ctx = wh.init(wh.Config())
    engine = wh.parallelize(TinyLM(stage_layers=(2,)), lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    engine._batch_checks["step"] = 6  # check every one of these steps (3 by default)
    x, y = lm_batches(1, 8)[0]
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(rank))
    cases = [(x, y[:6]),                                  # every rank: rows disagree
             (x, y[:6] if rank else y),                    # one rank only: rows disagree
             (x + rank, y),                                # different batches
             (x[perm], y[perm]),                           # the same rows, shuffled differently per rank
             ((x, x) if rank else x, y)]                   # a different number of input tensors
    errors = []
    for batch in cases:
        try:
            engine.step(batch)
            errors.append("no error")
        except (wh.BatchError, wh.PlanError) as exc:
            errors.append(str(exc))
    return errors, engine.step((x, y))["loss"]


def test_malformed_or_per_rank_batches_fail_on_every_rank_and_lose_nothing():
    (e0, loss0), (e1, loss1) = run_ranks(_bad_batches, 2)
    assert "(8, 8), (6, 8)" in e0[0] and "same rows" in e0[0] and e0[0] == e1[0]
    assert "another rank's batch was refused" in e0[1] and "(8, 8), (6, 8)" in e1[1]
    for errors in (e0, e1):
        assert all("different batches" in e and "same GLOBAL batch" in e for e in errors[2:])
    assert loss0 == loss1 > 0


def test_an_optimizer_over_a_tensor_outside_the_model_is_refused():
    from whale.runtime.optim import OptimizerError, bind_optimizer

    model = TinyLM()
    temperature = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    with pytest.raises(OptimizerError, match=r"1 tensor\(s\) that are not parameters of the model .*shape \(\)"):
        bind_optimizer(opt, model, {id(p) for p in model.parameters()})


def _user_eval_mode(rank, world):
    ctx = wh.init(wh.Config(load_shares=(5, 3)))
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model[1].eval()  # frozen statistics while fine-tuning: the engine must not switch it back to train
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses = mse_side_by_side(engine, ref, ref_opt, 3, (8, 4), (8, 2),
                                          after_step=lambda x, y: engine.eval_step((x, y)))
    _assert_same(engine, ref, losses, ref_losses)
    return model[1].training, model[0].training


def test_the_users_own_module_modes_are_kept():
    for bn_training, linear_training in run_ranks(_user_eval_mode, 2):
        assert not bn_training and linear_training


# --- keyword inputs: a dict batch, per-sample tensors sliced by rows, the rest passed whole -------------------
class Masked(nn.Module):
    """``forward(ids, mask=None, scale=1.0)``: an embedding, a per-sample mask, and a whole (not per-sample)
    positional bias and flag; two stages when ``stages``."""

    def __init__(self, stages: bool, vocab=16, d=6):
        super().__init__()
        with (wh.replicate(1) if stages else contextlib.nullcontext()):
            self.emb = nn.Embedding(vocab, d)
        with (wh.replicate(1) if stages else contextlib.nullcontext()):
            self.head = nn.Linear(d, vocab)

    def forward(self, ids, mask=None, bias=None):
        x = self.emb(ids) * mask.unsqueeze(-1) + bias
        return self.head(x)


def _keywords(rank, world, stages):
    ctx = wh.init(wh.Config(num_micro_batch=2 if stages else 1, load_shares=None if stages else (5, 3)))
    torch.manual_seed(0)
    model = Masked(stages)
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.5), ctx=ctx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    bias = torch.linspace(0, 1, 6)  # [d]: one per feature, not per sample (6 != 8 rows): passed whole
    losses, ref_losses = [], []
    for x, y in [(x % 16, y % 16) for x, y in lm_batches(3, 8, seq=5, vocab=16)]:
        mask = (x > 3).float()
        losses.append(engine.step(({"ids": x, "mask": mask, "bias": bias}, y))["loss"])
        ref_losses.append(reference_step(ref_opt, lm_loss(ref(x, mask=mask, bias=bias), y)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    return losses


@pytest.mark.parametrize("stages", [False, True])
def test_keyword_inputs_are_sliced_per_sample_and_passed_whole_otherwise(stages):
    run_ranks(_keywords, 2, stages)


# --- the loss reduction never interleaves with gradient buckets; traced calls follow the model's mode ---------
class DataDependent(nn.Module):
    """A block that runs only when a row's first feature is positive: lanes differ in whether it is used."""

    def __init__(self, d=8):
        super().__init__()
        self.first, self.extra = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.first(x)
        return self.extra(h) if bool(x[:, 0].sum() > 0) else h


def _bf16_data_dependent(rank, world):
    ctx = wh.init(wh.Config())
    model = DataDependent().to(torch.bfloat16)  # a bf16 bucket: the loss is reduced on its own
    engine = wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    x = torch.randn(8, 8).abs().to(torch.bfloat16)
    x[4:, 0] = -x[4:, 0] - 1  # lane 0's rows use `extra`, lane 1's do not
    losses = [engine.step((x, x))["loss"] for _ in range(3)]
    return losses, [p.detach().float().clone() for p in model.parameters()]


def test_a_separately_reduced_loss_never_interleaves_with_gradient_buckets():
    (l0, p0), (l1, p1) = run_ranks(_bf16_data_dependent, 2)
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))


class FunctionalDropoutPipe(nn.Module):
    """Two stages with functional dropout (``training=self.training``) in the model's own forward."""

    def __init__(self, d=8):
        super().__init__()
        with wh.replicate(1):
            self.a = nn.Linear(d, d)
        with wh.replicate(1):
            self.b = nn.Linear(d, d)

    def forward(self, x):
        return self.b(F.dropout(self.a(x), 0.5, training=self.training))


def _eval_before_parallelize(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2))
    model = FunctionalDropoutPipe().eval()  # e.g. from_pretrained returns eval(): no dropout, as in one process
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses = mse_side_by_side(engine, ref, ref_opt, 2, (8, 8), (8, 8))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    return losses


def test_traced_functional_dropout_follows_the_models_mode():
    run_ranks(_eval_before_parallelize, 2)
