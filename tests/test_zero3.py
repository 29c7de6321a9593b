"""ZeRO stage 3 (parameters sharded, gathered per unit; :mod:`whale.parallel.zero3`) against a one-process
``deepcopy`` reference: world 2 with uneven shares, world 4 as DP2 x PP2 (1F1B; the embedding/head tied across
stages keeps whole values, its gradients and optimizer state sliced as under ZeRO-2) and as DP4 on an emulated
mixed cluster (shares by free memory); AdamW with two param groups and an LR scheduler, a token-weighted loss
with ignored targets, a frozen and an unused parameter, gradient clipping, recompute inside units; parameter
bytes measured by the storage tracker follow each rank's share; bf16 against one process under autocast;
checkpoints resume exactly; split shards in a pipeline are left out.

Tolerance as in test_zero (fp32, rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import PipeWithSplit, TinyLM, lm_loss
from tests.test_zero import ATOL, CLIP, RTOL, _batches, _groups, _reference, zero_engine


class UnusedLM(TinyLM):
    """TinyLM with a module never called (its parameter gets no gradient on any rank)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.unused = nn.Linear(4, 4)


SCALE = wh.LossScale(init_scale=2.0 ** 10, growth_interval=2)


def _make(world, spec):
    cfg = wh.Config(num_micro_batch=2, zero=3, max_grad_norm=CLIP, cluster=spec.get("cluster"),
                    precision=spec.get("precision", "fp32"), track_memory=True, loss_scale=SCALE,
                    activation_checkpoint=spec.get("checkpoint"))
    return zero_engine(wh.init(cfg), world, spec, UnusedLM if spec.get("unused") else TinyLM)


def _equivalence(rank, world, spec):
    engine, ref, opt = _make(world, spec)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    losses, params = [], []
    for batch in _batches(4):
        out = engine.step(batch)
        losses.append(out["loss"])
        params.append(engine.memory.tracker.current["parameters"])
        sched.step()
    ref_losses = _reference(ref, 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    full = engine.full_state_dict()
    if rank == 0:
        for name, t in full.items():
            if name in ref_params:
                torch.testing.assert_close(t, ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                           msg=lambda m, n=name: f"{n}: {m}")
    zero = engine.zero
    assert all(p.numel() == 0 for u in zero.units for p in u.params)  # freed between steps
    with zero.whole():  # collective: every lane gathers every unit
        stage_numel = sum(p.numel() for p in engine.module.parameters())
    return {"stage": engine.stage, "lane": engine.lane, "lrs": [g["lr"] for g in opt.param_groups],
            "weights": engine.plan.zero_weights[engine.stage] if engine.plan.zero_weights else None,
            "piece_numel": sum(pc.param.numel() for pc in zero.pieces),
            "sharded_numel": sum(u.flat.numel() for u in zero.units), "stage_numel": stage_numel,
            "param_bytes": params[-1], "units": [u.name for u in zero.units],
            "tied_numel": sum(pc.param.numel() for pc in zero.tied.pieces) if zero.tied is not None else 0}


CASES = [
    (2, {"layers": (2,), "weights": ((3.0, 1.0),), "unused": True, "checkpoint": "all"}),
    (4, {"layers": (1, 1), "weights": ((1.0, 3.0), (2.0, 1.0))}),
    (4, {"layers": (2,), "cluster": "examples/clusters/v100_p100.yaml"}),
]


@pytest.mark.parametrize("world,spec", CASES, ids=["w2-uneven-unused-recompute", "w4-pp2x2-uneven", "w4-cluster"])
def test_zero3_matches_one_process(world, spec):
    results = run_ranks(_equivalence, world, spec, timeout=90)
    for r in results:
        assert r["lrs"] == pytest.approx([1e-3 * 0.7 ** 4, 2e-3 * 0.7 ** 4])
    for stage in {r["stage"] for r in results}:
        lanes = sorted((r for r in results if r["stage"] == stage), key=lambda r: r["lane"])
        weights = lanes[0]["weights"] or (1.0,) * len(lanes)
        total = lanes[0]["sharded_numel"]
        assert sum(r["piece_numel"] for r in lanes) == total > 0  # every element on exactly one lane
        for r, w in zip(lanes, weights, strict=True):
            share = r["piece_numel"] / total
            assert share == pytest.approx(w / sum(weights), abs=0.04), (stage, r["lane"], share, weights)
            # measured between steps: the lane's shard plus what ZeRO-3 leaves whole (tied across stages)
            whole = 4 * (r["stage_numel"] - total)
            assert r["param_bytes"] == pytest.approx(4 * r["piece_numel"] + whole, rel=0.01), r
    if world == 2:
        assert results[0]["units"] == ["blocks.0", "blocks.1", "<root>"]
    if len({r["stage"] for r in results}) > 1:  # the tied embedding/head: its state sliced over both stages
        assert sum(r["tied_numel"] for r in results) == 32 * 16 and all(r["tied_numel"] < 32 * 16 for r in results)
    if "cluster" in spec:
        assert all(r["weights"][0] > 1.5 * r["weights"][-1] for r in results)


# --- bf16 / fp16 autocast compose (fp16: loss scaling as GradScaler's); eval; checkpoints resume exactly ----
def _mixed(rank, world, precision):
    engine, ref, _ = _make(world, {"layers": (2,), "weights": ((1.0, 2.0),), "precision": precision})
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2, enabled=precision == "fp16")
    losses, ref_losses = [], []
    for x, y in _batches(3):
        losses.append(engine.step((x, y))["loss"])
        with torch.autocast("cpu", dtype=dtype):
            logits = ref(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        ref_opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        scaler.step(ref_opt)
        scaler.update()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    x, y = _batches(5)[4]
    evaluated = engine.eval_step((x, y))["loss"]  # the root unit is freed after the eval forward
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        ref_eval = torch.nn.functional.cross_entropy(ref(x).float().flatten(0, 1), y.flatten(), ignore_index=-100)
    assert evaluated == pytest.approx(float(ref_eval), rel=2e-3)
    assert not any(u.gathered for u in engine.zero.units)
    full = engine.full_state_dict()  # tolerance as in test_precision (bf16: 8 bits; fp16 holds a fortiori)
    for name, p in ref.named_parameters():
        if rank == 0:
            torch.testing.assert_close(full[name], p.detach(), rtol=1e-2, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero3_mixed_precision_matches_one_process_autocast(precision):
    run_ranks(_mixed, 2, precision, timeout=60)


def _resume(rank, world, path):
    spec = {"layers": (2,), "weights": ((3.0, 1.0),)}
    engine, _, _ = _make(world, spec)
    batches = _batches(4)
    for batch in batches[:2]:
        engine.step(batch)
    engine.save_checkpoint(path)
    after = [engine.step(b)["loss"] for b in batches[2:]]
    fresh, _, _ = _make(world, spec)
    fresh.load_checkpoint(path)
    again = [fresh.step(b)["loss"] for b in batches[2:]]
    return after, again, engine.state_dict()["model"], fresh.state_dict()["model"]


def test_zero3_checkpoint_resumes_exactly(tmp_path):
    for after, again, model, fresh in run_ranks(_resume, 2, str(tmp_path), timeout=60):
        assert after == again
        assert model.keys() == fresh.keys() and all(torch.equal(model[k], fresh[k]) for k in model)


# --- split shards are left out of ZeRO-3 (already cut); tied embedding/head across stages stay whole --------
def _with_split(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=3, seed=0))
    torch.manual_seed(0)
    model = PipeWithSplit(tied=True)
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2), ctx=ctx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for _ in range(3):
        x = torch.randint(0, 16, (8, 5), generator=g)
        y = torch.roll(x, 1, dims=1)
        losses.append(engine.step((x, y))["loss"])
        ref_opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    full = engine.full_state_dict()
    if rank == 0:
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(full[name], t, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    split = {id(p) for r in engine.split.regions for p in r.sharded.parameters()}
    sharded = {id(p) for u in engine.zero.units for p in u.params}
    return {"split_in_zero": bool(split & sharded), "pieces": len(engine.zero.pieces)}


def test_zero3_composes_with_split_and_tied_parameters_in_a_pipeline():
    for r in run_ranks(_with_split, 4, timeout=90):
        assert not r["split_in_zero"] and r["pieces"] > 0, r
