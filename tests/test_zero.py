"""ZeRO stages 1 and 2 (Rajbhandari et al., SC 2020) under Whale, each against a one-process ``deepcopy``
reference: data parallel at world 2 and DP2 x PP2 at world 4 (tied embedding/head across stages), uneven
hardware-aware shards (cluster spec or explicit weights), AdamW with two param groups and an LR scheduler, a
token-weighted loss with ignored targets, a frozen parameter and gradient clipping; each rank's optimizer state
holds only its slice; checkpoints resume exactly; split shards compose; non-elementwise optimizers are refused.

Tolerance as in test_equivalence (fp32, rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile

import pytest
import torch
import torch.nn.functional as F

import whale as wh
from tests.distributed import run_ranks
from tests.models import PipeWithSplit, TinyLM, lm_batches
from whale.parallel.zero import state_bytes

RTOL, ATOL = 1e-5, 1e-6
CLIP = 0.05  # small enough that every step clips


def _groups(model):
    """Two param groups: matrices with weight decay, vectors without (and their own learning rate)."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 2e-3}]


def _batches(steps):
    """LM batches [8, 8] with ignored targets (-100): a short row, an empty row."""
    out = []
    for x, y in lm_batches(steps, 8):
        y = y.clone()
        y[0, 3:] = -100
        y[5, :] = -100
        out.append((x, y))
    return out


def _reference(ref, steps, before=None):
    """One process: the same groups, scheduler, token-mean loss and clipping; ``before(k)`` runs before step k."""
    opt = torch.optim.AdamW(_groups(ref), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    losses = []
    for k, (x, y) in enumerate(_batches(steps)):
        if before is not None:
            before(k)
        opt.zero_grad()
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _make(world, spec):
    """Model (frozen fc1.bias in block 0), its one-process copy, plan and engine for ``spec``."""
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=spec["zero"], max_grad_norm=CLIP, cluster=spec.get("cluster")))
    return zero_engine(ctx, world, spec)


def zero_engine(ctx, world, spec, model_cls=TinyLM):
    """(engine, one-process copy, optimizer) of ``model_cls`` with ``spec["layers"]`` (frozen fc1.bias in block 0),
    planned under ``ctx`` with ``spec["weights"]`` as ZeRO weights when given; AdamW with two param groups."""
    torch.manual_seed(0)
    model = model_cls(stage_layers=spec["layers"])
    model.blocks[0].fc1.bias.requires_grad_(False)
    return zero_engine_of(model, ctx, world, spec)


def zero_engine_of(model, ctx, world, spec):
    """(engine, one-process copy, optimizer) of ``model``, planned under ``ctx`` with ``spec["weights"]`` as ZeRO
    weights when given; AdamW with two param groups, a token-weighted loss."""
    ref = copy.deepcopy(model)
    plan = wh.plan_model(model, world, ctx.config)
    if "weights" in spec:
        plan = dataclasses.replace(plan, zero_weights=spec["weights"])
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    engine = wh.parallelize(model, wh.token_cross_entropy(), opt, ctx=ctx, plan=plan)
    return engine, ref, opt


def _equivalence(rank, world, spec):
    engine, ref, opt = _make(world, spec)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    losses = []
    for batch in _batches(4):
        losses.append(engine.step(batch)["loss"])
        sched.step()
    ref_losses = _reference(ref, 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    out = {"stage": engine.stage, "lane": engine.lane, "total": state_bytes(opt),
           "lrs": [g["lr"] for g in opt.param_groups],
           "weights": engine.plan.zero_weights[engine.stage] if engine.plan.zero_weights else None}
    zero = engine.zero
    for kind, lanes in (("lanes", True), ("tied", False)):  # the stage's lanes; a tensor tied across stages
        mine = [k for k, b in enumerate(zero.buckets) if (b.group is engine.mesh.lanes) == lanes] if zero else []
        out[kind] = sum(state_bytes_of(opt, pc.param) for pc in zero.pieces if pc.bucket in mine) if zero else 0
        out[f"{kind}_trainable"] = sum(p.numel() * 8 for k in mine for p in zero.buckets[k].params
                                       if p.requires_grad)
    return out


def state_bytes_of(opt, param) -> int:
    """Bytes of the optimizer's state tensors (of one dim or more) for one parameter."""
    return sum(t.numel() * t.element_size() for t in opt.state.get(param, {}).values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


CASES = [
    (2, {"zero": 1, "layers": (2,)}),
    (2, {"zero": 2, "layers": (2,), "weights": ((3.0, 1.0),)}),
    (2, {"zero": 1, "layers": (2,), "cluster": "examples/clusters/v100_p100_2.yaml"}),
    (4, {"zero": 1, "layers": (1, 1), "cluster": "examples/clusters/v100_p100.yaml"}),
    (4, {"zero": 2, "layers": (1, 1), "cluster": "examples/clusters/v100_p100.yaml"}),
    (4, {"zero": 2, "layers": (1, 1), "weights": ((1.0, 3.0), (2.0, 1.0))}),
]


def _case_id(world, spec):
    how = "cluster" if "cluster" in spec else "weights" if "weights" in spec else "even"
    return f"w{world}-zero{spec['zero']}-{how}"


@pytest.mark.parametrize("world,spec", CASES, ids=[_case_id(w, s) for w, s in CASES])
def test_zero_matches_one_process_and_shards_the_optimizer_state(world, spec):
    results = run_ranks(_equivalence, world, spec, timeout=120)
    for r in results:
        assert r["lrs"] == pytest.approx([1e-3 * 0.7 ** 4, 2e-3 * 0.7 ** 4])  # the scheduler drove the groups
    for stage in {r["stage"] for r in results}:
        lanes = sorted((r for r in results if r["stage"] == stage), key=lambda r: r["lane"])
        weights = lanes[0]["weights"] or (1.0,) * len(lanes)
        assert sum(r["lanes"] for r in lanes) == lanes[0]["lanes_trainable"] > 0  # every element's state once
        for r, w in zip(lanes, weights, strict=True):
            share = r["lanes"] / lanes[0]["lanes_trainable"]
            assert share == pytest.approx(w / sum(weights), abs=0.04), (stage, r["lane"], share, weights)
    if world == 4:  # the tied embedding/head: sliced over every rank of both stages, each element once
        assert sum(r["tied"] for r in results) == results[0]["tied_trainable"] > 0
        assert all(0 < r["tied"] < results[0]["tied_trainable"] for r in results)
    if "cluster" in spec:  # a 32 GB device holds more of the state than a 16 GB one
        assert all(r["weights"][0] > 1.5 * r["weights"][1] for r in results)


# --- checkpoints: resume exactly; the consolidated model is whole -------------------------------------------
def _resume(rank, world, spec, path):
    engine, ref, _ = _make(world, spec)
    batches = _batches(4)
    for batch in batches[:2]:
        engine.step(batch)
    engine.save_checkpoint(path)
    after = [engine.step(b)["loss"] for b in batches[2:]]
    full = engine.full_state_dict()
    fresh, _, _ = _make(world, spec)
    fresh.load_checkpoint(path)
    again = [fresh.step(b)["loss"] for b in batches[2:]]
    same = all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), fresh.module.parameters(), strict=True))
    if rank == 0:
        plain = TinyLM(stage_layers=spec["layers"])
        plain.load_state_dict(full, strict=True)
    return {"after": after, "again": again, "same": same}


@pytest.mark.parametrize("world,spec", [(2, {"zero": 2, "layers": (2,), "weights": ((3.0, 1.0),)}),
                                        (4, {"zero": 1, "layers": (1, 1), "weights": ((1.0, 2.0), (2.0, 1.0))})])
def test_zero_checkpoint_resumes_exactly(world, spec):
    with tempfile.TemporaryDirectory() as tmp:
        for r in run_ranks(_resume, world, spec, tmp, timeout=120):
            assert r["after"] == r["again"] and r["same"], r


# --- split shards are left out of ZeRO; the rest of the stage shards ----------------------------------------
def _with_split(rank, world, zero):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=zero, seed=0))
    torch.manual_seed(0)
    model = PipeWithSplit(tied=True)
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-2), ctx=ctx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for _ in range(3):
        x = torch.randint(0, 16, (8, 5), generator=g)
        y = torch.roll(x, 1, dims=1)
        losses.append(engine.step((x, y))["loss"])
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    full = engine.full_state_dict()
    if rank == 0:
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(full[name], t, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    split = {id(p) for r in engine.split.regions for p in r.sharded.parameters()}
    return {"split_in_zero": any(id(p) in split for b in engine.zero.buckets for p in b.params),
            "pieces": len(engine.zero.pieces)}


def test_zero2_composes_with_split_and_tied_parameters_in_a_pipeline():
    for r in run_ranks(_with_split, 4, 2, timeout=120):
        assert not r["split_in_zero"] and r["pieces"] > 0, r


# --- refusals -------------------------------------------------------------------------------------------------
def _factored(rank, world):
    ctx = wh.init(wh.Config(zero=1))
    model = TinyLM()
    try:
        wh.parallelize(model, wh.token_cross_entropy(), torch.optim.Adafactor(model.parameters()), ctx=ctx)
    except TypeError as exc:
        return str(exc)
    return None


def test_zero_refuses_an_optimizer_that_is_not_elementwise():
    for msg in run_ranks(_factored, 2):
        assert msg is not None and "Adafactor" in msg and "zero=0" in msg and "AdamW" in msg, msg


# --- stages of different widths (a 2-lane stage feeding a 1-lane stage), SGD with momentum ------------------
def _widths(rank, world, zero):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=zero, max_grad_norm=CLIP))
    torch.manual_seed(0)
    model = TinyLM(stage_layers=(1, 1), stage_widths=(2, 1))
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.token_cross_entropy(),
                            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ctx=ctx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for x, y in lm_batches(3, 8):
        losses.append(engine.step((x, y))["loss"])
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    return len(engine.zero.pieces)


def test_zero2_with_stages_of_different_widths():
    assert all(n > 0 for n in run_ranks(_widths, 3, 2, timeout=120))
