"""Stages of different chunk counts keep dropout, bf16 and frozen parameters one-process exact.

Two maps of an interleaved pipeline (p = 2, v = 2, 4 chunks, world 2, gloo ranks of :mod:`tests.distributed`):
the given map (0, 1, 0, 0) (an untied TinyLM's plan, its chunks moved) and the map the planner picks on an
emulated H100 + T4 cluster ((0, 1, 1, 1), the H100's stage 1 holds 3 chunks, cut emb | blocks 0-1 | blocks 2-6 |
block 7, ln, head; tied TinyLM). On each, 3 steps:

- frozen parameters (``requires_grad_(False)``): a whole block of chunk 1, the ``fc1`` of a block of chunk 2
  (on the given map stage 0's later chunks) and the final LayerNorm of chunk 3 stay bit-identical and get no
  gradient; every other parameter and the losses equal a one-process ``deepcopy`` (SGD with momentum, fp32,
  rtol 1e-5 / atol 1e-6). On the cluster freezing moves the planner's cut (frozen blocks cost less), so the
  test freezes blocks.0 there and checks which chunk holds each frozen parameter;
- bf16 (``Config(precision="bf16")``): losses and parameters equal the one-process reference under
  ``torch.autocast("cpu", bfloat16)`` at :mod:`tests.test_precision`'s tolerances (losses rtol 2e-3,
  parameters rtol 1e-2 / atol 1e-3), fp32 master weights, and autocast really ran. SGD with momentum, not
  AdamW: AdamW moved one element of 2048 by 2e-3 = 2 lr over 3 steps (a ~0 gradient's rounding noise, divided
  by its own RMS: test_precision's caveat, twice), while SGD stays linear in the bf16-rounded gradients;
- dropout in training mode: per :mod:`whale.runtime.rng` each stage's forwards draw from its lane stream
  ``("lane", seed, stage, lane)`` (running on through the step's forwards, here in the stage's schedule order
  over its chunks), never from the user's stream; the reference applies the masks those streams draw. (Before
  the fix an interleaved stage's dropout drew from the user's generator: the stage module is
  :class:`whale.parallel.chunks.Chunks`, whose own forward never runs, so the lane stream now hooks each chunk.)
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import Block, TinyLM, lm_batches, lm_loss, reference_step
from whale.cluster import ClusterSpec
from whale.runtime.rng import Stream

RTOL, ATOL, STEPS, MB, BATCH, P = 1e-5, 1e-6, 3, 4, 8, 0.2
LR, LOSS_RTOL = 1e-3, 2e-3  # bf16, as tests/test_precision.py
MAPS = ["given", "h100"]
FROZEN = {"given": ("blocks.1.", "blocks.2.fc1.", "ln."), "h100": ("blocks.0.", "blocks.4.fc1.", "ln.")}


class DropBlock(Block):
    """:class:`tests.models.Block` with an ``nn.Dropout`` on the MLP output."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.drop = nn.Dropout(P)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


def _model(where: str, dropout: bool = False) -> TinyLM:
    """TinyLM of 4 chunk scopes (given: 1 block each, untied; h100: 2 each, tied), blocks with dropout if asked."""
    import tests.models as models

    layers, tied = ((1, 1, 1, 1), False) if where == "given" else ((2, 2, 2, 2), True)
    block, models.Block = models.Block, DropBlock if dropout else models.Block
    try:
        return TinyLM(stage_layers=layers, d=32, tied=tied)
    finally:
        models.Block = block


def _start(where: str, dropout: bool = False, **kw):
    """(ctx, model, plan or None) for a map; the given plan is made with the same config (precision)."""
    cluster = ClusterSpec.from_dict({"emulate": True, "nodes": [{"devices": ["H100-80GB", "T4"]}]})
    config = wh.Config(num_micro_batch=MB, schedule="Interleaved1F1B", virtual_stages=2, seed=0,
                       cluster=cluster if where == "h100" else None, **kw)
    ctx = wh.init(config)
    model = _model(where, dropout)
    plan = None
    if where == "given":
        plan = dataclasses.replace(wh.plan_model(_model(where, dropout), 2, config), chunk_positions=(0, 1, 0, 0))
    return ctx, model, plan


def _chunk_params(engine) -> dict[int, list[str]]:
    """This rank's model chunks (global numbers) -> the parameter names each holds."""
    chunks = engine.plan.chunks_of(engine.stage)
    return {chunks[i]: [n for n, _ in c.named_parameters()] for i, c in enumerate(engine.module.chunks)}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _frozen(rank, world, where):
    ctx, model, plan = _start(where)
    frozen = {n for n, p in model.named_parameters() if n.startswith(FROZEN[where])}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    ref = copy.deepcopy(model)
    x0, y0 = lm_batches(1, BATCH)[0]
    engine = wh.parallelize(model, lm_loss, _sgd, ctx=ctx, sample_batch=(x0, y0), plan=plan)
    ref_opt = _sgd([p for p in ref.parameters() if p.requires_grad])
    losses, ref_losses = [], []
    for x, y in lm_batches(STEPS, BATCH):
        losses.append(engine.step((x, y))["loss"])
        ref_losses.append(reference_step(ref_opt, lm_loss(ref(x), y)))
    held = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
    assert all(p.grad is None for n, p in engine.module.named_parameters() if n in frozen)
    full = engine.full_state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for name, value in (ref.state_dict().items() if rank == 0 else ()):
        if name in frozen:
            assert torch.equal(full[name], before[name]), f"frozen {name} changed"
        else:
            torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            assert not torch.equal(full[name], before[name]), f"{name} did not train"
    return {"plan": engine.plan.to_json(), "stage": engine.stage, "held": held, "frozen": sorted(frozen),
            "chunks": _chunk_params(engine)}


@pytest.mark.parametrize("where", MAPS)
def test_frozen_parameters_on_later_chunks_stay_and_the_rest_matches_one_process(where):
    results = run_ranks(_frozen, 2, where, timeout=180)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.chunk_positions == ((0, 1, 0, 0) if where == "given" else (0, 1, 1, 1))
    frozen = results[0]["frozen"]
    assert len(frozen) >= 4 and sorted(n for r in results for n in r["held"]) == frozen  # each frozen once, kept
    chunk_of = {n: c for r in results for c, names in r["chunks"].items() for n in names}
    chunks = [sorted({chunk_of[n] for n in frozen if n.startswith(prefix)}) for prefix in FROZEN[where]]
    assert chunks == [[1], [2], [3]]  # given: chunk 1 on stage 1, chunks 2 and 3 stage 0's later ones


def _bf16(rank, world, where):
    ctx, model, plan = _start(where, precision="bf16")
    ref = copy.deepcopy(model)
    x0, y0 = lm_batches(1, BATCH)[0]
    engine = wh.parallelize(model, lm_loss, _sgd, ctx=ctx, sample_batch=(x0, y0), plan=plan)
    assert engine.plan.precision == "bf16"
    ref_opt, fp32 = _sgd(ref.parameters()), copy.deepcopy(ref)
    losses, ref_losses, fp32_losses = [], [], []
    for x, y in lm_batches(STEPS, BATCH):
        losses.append(engine.step((x, y))["loss"])
        with torch.no_grad():
            fp32_losses.append(lm_loss(fp32(x), y).item())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ref(x)
        ref_losses.append(reference_step(ref_opt, lm_loss(logits.float(), y)))
        fp32.load_state_dict(ref.state_dict())
    full = engine.full_state_dict()
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())  # fp32 master weights
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    diff = 0.0
    for name, value in (ref.state_dict().items() if rank == 0 else ()):
        torch.testing.assert_close(full[name], value, rtol=1e-2, atol=LR, msg=lambda m, n=name: f"{n}: {m}")
        diff = max(diff, ((full[name] - value).abs() / (LR + 1e-2 * value.abs())).max().item())
    return {"gap": max(abs(a - b) for a, b in zip(losses, fp32_losses, strict=True)), "param_diff": diff,
            "loss_diff": max(abs(a / b - 1) for a, b in zip(losses, ref_losses, strict=True))}


@pytest.mark.parametrize("where", MAPS)
def test_bf16_matches_one_process_autocast(where):
    results = run_ranks(_bf16, 2, where, timeout=180)
    assert all(r["gap"] > 1e-4 for r in results)  # bf16 really ran: farther from fp32 than fp32 noise
    print(f"{where}: max loss rel diff {max(r['loss_diff'] for r in results):.1e}, "
          f"max param diff / tolerance {results[0]['param_diff']:.2f}")


def _masks(plan, orders, step, rows, blocks_of):
    """(chunk, micro-batch) -> masks of its blocks' dropouts, drawn from each stage's lane stream in the order
    that stage ran its forwards (lane 0: world 2 has one lane per stage)."""
    masks = {}
    for stage, order in orders.items():
        stream = Stream([torch.default_generator], ("lane", 0, stage, 0), lambda: step)
        for label in order:
            m, _, c = label[1:].partition("c")
            chunk = plan.chunks_of(stage)[int(c or 0)]
            stream.enter(True)
            masks[chunk, int(m)] = [F.dropout(torch.ones(rows, 8, 32), P) for _ in blocks_of[chunk]]
            stream.exit()
    return masks


def _dropout(rank, world, where):
    ctx, model, plan = _start(where, dropout=True)
    init = copy.deepcopy(model.state_dict())
    x0, y0 = lm_batches(1, BATCH)[0]
    engine = wh.parallelize(model, lm_loss, _sgd, ctx=ctx, sample_batch=(x0, y0), plan=plan)
    losses, user = [], []
    for x, y in lm_batches(STEPS, BATCH):
        state = torch.get_rng_state()
        losses.append(engine.step((x, y))["loss"])
        user.append(torch.equal(state, torch.get_rng_state()))
    order = [t[0] for t in engine.last_timeline if t[0].startswith("F")]
    return {"plan": engine.plan.to_json(), "stage": engine.stage, "order": order, "losses": losses,
            "user_stream_kept": user, "user_draw": torch.rand(4).tolist(), "init": init if rank == 0 else None,
            "full": engine.full_state_dict(), "chunks": _chunk_params(engine)}


@pytest.mark.parametrize("where", MAPS)
def test_dropout_draws_the_lane_streams_and_matches_one_process(where):
    results = run_ranks(_dropout, 2, where, timeout=180)
    assert all(all(r["user_stream_kept"]) for r in results)  # Whale never draws from the user's stream
    assert results[0]["user_draw"] == results[1]["user_draw"]  # ... so it stays identical on every rank
    plan = wh.Plan.from_json(results[0]["plan"])
    orders = {r["stage"]: r["order"] for r in results}
    ref = _model(where, dropout=True)
    ref.load_state_dict(results[0]["init"])
    drops = [b.drop for b in ref.blocks]
    blocks_of = {c: sorted({int(n.split(".")[1]) for n in names if n.startswith("blocks.")})
                 for r in results for c, names in r["chunks"].items()}  # chunk -> its blocks, in forward order
    where_is = {i: (c, j) for c, blocks in blocks_of.items() for j, i in enumerate(blocks)}
    opt, rows, ref_losses = _sgd(ref.parameters()), BATCH // MB, []
    for step, (x, y) in enumerate(lm_batches(STEPS, BATCH)):
        masks, opt_loss = _masks(plan, orders, step, rows, blocks_of), 0.0
        opt.zero_grad()
        for m in range(MB):
            for i, d in enumerate(drops):  # block i, the j-th of its chunk: its mask of micro-batch m
                chunk, j = where_is[i]
                d.forward = lambda h, mask=masks[chunk, m][j]: h * mask
            loss = lm_loss(ref(x[m * rows:(m + 1) * rows]), y[m * rows:(m + 1) * rows]) / MB
            loss.backward()
            opt_loss += loss.item()
        opt.step()
        ref_losses.append(opt_loss)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(results[0]["full"][name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda msg, n=name: f"{n}: {msg}")
