"""Buffers under the techniques the planner may add on its own (issue 23), against a one-process ``deepcopy``
reference (plain PyTorch, no checkpointing; AdamW lr 1e-3, fp32, rtol 1e-5 / atol 1e-6 as in test_equivalence):

- activation checkpointing does not update a buffer twice: BatchNorm2d/1d running statistics and
  ``num_batches_tracked``, and a user's step counter that forward updates and reads, end exactly as in one
  process after 3 steps, as do the parameters and an eval loss; world 2 data parallel (also under ZeRO-3), a
  2-stage pipeline with 2 micro-batches under 1F1B (fx and export captures), and checkpointing the planner adds
  by itself to fit an emulated device's memory;
- every persistent buffer and parameter of the model, read by forward or not (an unread buffer, an unread
  frozen parameter, an unread alias of a buffer), is in ``full_state_dict()`` and in checkpoints of a pipeline
  under either capture, non-persistent buffers are not: a strict ``load_state_dict`` into a fresh model works.
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
from tests.test_buffers_rng import _images, _ref_step

RTOL, ATOL = 1e-5, 1e-6
STEPS, BATCH = 3, 8


class Counted(nn.Module):
    """``[B, d] -> [B, d]``: a Linear scaled by ``1 + 1 / steps``, where ``steps`` is a buffer forward adds 1 to
    first (so a recompute that saw the updated counter would compute other activations)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)  # a bias before the next block's BatchNorm has zero gradient
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return self.lin(x) * (1 + 1 / self.steps)


class ConvBlock(nn.Module):
    """``[B, 3, 4, 4] -> [B, 64]``: conv, BatchNorm2d, ReLU, flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before BatchNorm has zero gradient
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))).flatten(1)


class DenseBlock(nn.Module):
    """``[B, d_in] -> [B, d]``: Linear, BatchNorm1d (``momentum=None``: cumulative average, which reads
    ``num_batches_tracked``), ReLU, :class:`Counted` (a Linear without ``counter``)."""

    def __init__(self, d_in: int, d: int, momentum: float | None, counter: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d, bias=False)
        self.bn = nn.BatchNorm1d(d, momentum=momentum)
        self.counted = Counted(d) if counter else nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.counted(F.relu(self.bn(self.lin(x))))


class NormNet(nn.Module):
    """``[B, 3, 4, 4] -> [B, 5]``: ``blocks`` = a :class:`ConvBlock` and ``depth`` :class:`DenseBlock` s of
    width ``width``, then a Linear head. ``stages=2`` puts the dense blocks and the head in a second
    replicate(1) stage."""

    def __init__(self, stages: int = 1, momentum: float | None = 0.1, depth: int = 1, width: int = 8,
                 counter: bool = True) -> None:
        super().__init__()
        scope = (lambda: wh.replicate(1)) if stages > 1 else contextlib.nullcontext
        with scope():
            blocks = [ConvBlock()]
        with scope():
            blocks += [DenseBlock(64 if i == 0 else width, width, momentum, counter) for i in range(depth)]
            self.head = nn.Linear(width, 5)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# --- activation checkpointing: buffers updated once, as in one process -----------------------------------
def _cluster(scale: float):
    """Two emulated V100s with ``scale`` of their memory (1.95e-5: NormNet(depth=2, width=64) on 64 rows fits
    with every block checkpointed, and not without)."""
    from whale.cluster import ClusterSpec

    return ClusterSpec.from_dict({"emulate": True, "memory_scale": scale, "nodes": [{"devices": ["V100-32GB"] * 2}]})


def _checkpointed(rank, world, spec):
    """Train a NormNet ``STEPS`` steps under ``spec``; compare with one process on rank 0 (parameters, every
    buffer, losses, an eval loss). Returns what the test asserts about the plan and the recompute."""
    batch, mb = spec.get("batch", BATCH), spec.get("mb", 1)
    cluster = _cluster(spec["scale"]) if "scale" in spec else None
    cfg = wh.Config(num_micro_batch=mb, seed=0, zero=spec.get("zero", 0), capture=spec.get("capture", "auto"),
                    activation_checkpoint=spec.get("checkpoint"), forbid=("zero", "offload") if cluster else (),
                    cluster=cluster)
    ctx = wh.init(cfg)
    torch.manual_seed(0)
    model = NormNet(spec.get("stages", 1), spec.get("momentum", 0.1), spec.get("depth", 1), spec.get("width", 8),
                    spec.get("counter", True))
    ref = copy.deepcopy(model)
    data = _images(STEPS + 1, batch)
    plan = wh.plan_model(model, world, cfg, sample_batch=data[0], loss_fn=F.cross_entropy)
    engine = wh.parallelize(model, F.cross_entropy, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx, plan=plan)
    calls = []  # Counted's forward calls on this rank (a recompute calls it again)
    for m in engine.module.modules():
        if isinstance(m, Counted):
            m.register_forward_pre_hook(lambda *_: calls.append(1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses = [engine.step(b)["loss"] for b in data[:STEPS]]
    ref_losses = [_ref_step(ref, ref_opt, x, y, mb) for x, y in data[:STEPS]]
    trained = len(calls)
    ev = engine.eval_step(data[STEPS])["loss"]
    full = engine.full_state_dict()
    ref.eval()
    with torch.no_grad():  # eval_step runs the plan's micro-batches too (each counted by Counted)
        x, y = data[STEPS]
        ref_eval = sum(float(F.cross_entropy(ref(xc), yc)) * len(yc) / len(y)
                       for xc, yc in zip(x.chunk(mb), y.chunk(mb), strict=True))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    if rank == 0:
        expected = ref.state_dict()
        assert set(full) == set(expected)
        for name, value in expected.items():  # parameters and every buffer, num_batches_tracked exactly
            torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        assert int(full["blocks.0.bn.num_batches_tracked"]) == STEPS * mb
        if "blocks.1.counted.steps" in full:  # every forward counted once, the eval step too
            assert int(full["blocks.1.counted.steps"]) == (STEPS + 1) * mb
    assert abs(ev - ref_eval) <= ATOL + RTOL * abs(ref_eval), (ev, ref_eval)
    code = engine.module._whale_train.code if hasattr(engine.module, "_whale_train") else \
        getattr(engine.module, "code", "")
    return {"checkpoint": plan.activation_checkpoint, "stage": engine.stage, "calls": trained,
            "graph_calls": code.count("whale_checkpoint_"), "capture": plan.capture}


def test_checkpointing_keeps_batchnorm_and_counter_buffers_data_parallel_and_zero3():
    for zero in (0, 3):
        results = run_ranks(_checkpointed, 2, {"checkpoint": "all", "momentum": None, "zero": zero}, timeout=120)
        for r in results:
            assert r["checkpoint"] == ("blocks.0", "blocks.1")
            assert r["calls"] == 2 * STEPS  # Counted ran twice per step (forward and recompute), counted once


def test_checkpointing_keeps_buffers_in_a_pipeline_with_micro_batches_in_flight():
    """2 stages, 2 micro-batches under 1F1B: stage 0 runs both forwards before its first recompute, so each
    recompute must start from the buffers its own forward saw (fx: BatchNorm calls, cumulative momentum;
    export: ATen ops, also the step counter, which an fx trace cannot record)."""
    for capture, momentum in (("fx", None), ("export", 0.1)):
        spec = {"checkpoint": "all", "stages": 2, "mb": 2, "capture": capture, "momentum": momentum,
                "counter": capture == "export"}
        results = run_ranks(_checkpointed, 2, spec, timeout=120)
        assert sorted(r["stage"] for r in results) == [0, 1] and results[0]["capture"] == capture
        assert all(r["graph_calls"] >= 1 for r in results)  # each stage recomputes its block in backward


def test_fx_capture_refuses_a_buffer_update_it_cannot_record_and_restores_the_buffer():
    """No processes. torch.fx runs ``self.steps.add_(1)`` on the real buffer while tracing and records nothing."""
    model = NormNet(stages=2)
    with pytest.raises(wh.StageError, match=r"updates buffer\(s\) \['blocks\.1\.counted\.steps'\] in place .*"
                                             r"Fix: Config\(capture='export'\)"):
        wh.plan_model(model, 2, wh.Config(num_micro_batch=2, capture="fx"))
    assert float(model.blocks[1].counted.steps) == 0.0


def test_checkpointing_the_planner_adds_to_fit_memory_keeps_buffers():
    """No checkpointing asked: the planner adds it (ZeRO and offload forbidden) to fit the emulated devices."""
    spec = {"scale": 1.95e-5, "batch": 64, "depth": 2, "width": 64}
    results = run_ranks(_checkpointed, 2, spec, timeout=120)
    for r in results:
        assert r["checkpoint"] == ("blocks.0", "blocks.1", "blocks.2")
        assert r["calls"] == 2 * 2 * STEPS  # two Counted blocks, each recomputed
