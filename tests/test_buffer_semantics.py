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
    """``[B, 3, 4, 4] -> [B, 64]``: conv, BatchNorm2d, ReLU, flattened, :class:`Counted` (with ``counter``)."""

    def __init__(self, counter: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before BatchNorm has zero gradient
        self.bn = nn.BatchNorm2d(4)
        self.counted = Counted(64) if counter else nn.Identity()

    def forward(self, x):
        return self.counted(F.relu(self.bn(self.conv(x))).flatten(1))


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
    width ``width`` (each with a step counter, with ``counter``), then a Linear head. ``stages=2`` puts the
    dense blocks and the head in a second replicate(1) stage."""

    def __init__(self, stages: int = 1, momentum: float | None = 0.1, depth: int = 1, width: int = 8,
                 counter: bool = True) -> None:
        super().__init__()
        scope = (lambda: wh.replicate(1)) if stages > 1 else contextlib.nullcontext
        with scope():
            blocks = [ConvBlock(counter)]
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
    """Two emulated V100s with ``scale`` of their memory (2.15e-5: NormNet(depth=2, width=64) on 64 rows fits
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
        if "blocks.0.counted.steps" in full:  # every forward counted once, the eval step's too
            assert int(full["blocks.0.counted.steps"]) == int(full["blocks.1.counted.steps"]) == (STEPS + 1) * mb
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
            assert r["calls"] == 2 * 2 * STEPS  # each Counted ran twice per step (forward, recompute), counted once


def test_checkpointing_keeps_buffers_in_a_pipeline_with_micro_batches_in_flight():
    """2 stages, 2 micro-batches under 1F1B: stage 0 runs both forwards before its first recompute, so each
    recompute must start from the buffers its own forward saw (fx: BatchNorm calls, cumulative momentum;
    export: ATen ops, also the step counters, which an fx trace cannot record)."""
    for capture, momentum in (("fx", None), ("export", 0.1)):
        spec = {"checkpoint": "all", "stages": 2, "mb": 2, "capture": capture, "momentum": momentum,
                "counter": capture == "export"}
        results = run_ranks(_checkpointed, 2, spec, timeout=120)
        assert sorted(r["stage"] for r in results) == [0, 1] and results[0]["capture"] == capture
        assert all(r["graph_calls"] >= 1 for r in results)  # each stage recomputes its block in backward


def test_fx_capture_refuses_a_buffer_update_it_cannot_record_and_restores_the_buffer():
    """No processes. torch.fx runs ``self.steps.add_(1)`` on the real buffer while tracing and records nothing."""
    model = NormNet(stages=2)
    with pytest.raises(wh.StageError, match=r"updates buffer\(s\) \['blocks\.0\.counted\.steps', "
                                             r"'blocks\.1\.counted\.steps'\] in place .*"
                                             r"Fix: Config\(capture='export'\)"):
        wh.plan_model(model, 2, wh.Config(num_micro_batch=2, capture="fx"))
    assert float(model.blocks[0].counted.steps) == float(model.blocks[1].counted.steps) == 0.0


def test_checkpointing_the_planner_adds_to_fit_memory_keeps_buffers():
    """No checkpointing asked: the planner adds it (ZeRO and offload forbidden) to fit the emulated devices."""
    spec = {"scale": 2.15e-5, "batch": 64, "depth": 2, "width": 64}
    results = run_ranks(_checkpointed, 2, spec, timeout=120)
    for r in results:
        assert r["checkpoint"] == ("blocks.0", "blocks.1", "blocks.2")
        assert r["calls"] == 2 * 3 * STEPS  # three Counted, each recomputed


# --- every persistent buffer and parameter in full_state_dict() and checkpoints ------------------------------
class Keeper(nn.Module):
    """``[B, 4] -> [B, 4]``: a Linear times a non-persistent buffer; also holds a persistent buffer and a frozen
    parameter that forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5), persistent=False)
        self.register_buffer("unread", torch.arange(3.0))
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x):
        return self.lin(x) * self.scale


class StateNet(nn.Module):
    """``[B, 4] -> [B, 3]`` in two replicate(1) stages: :class:`Keeper`, then a Linear plus its buffer
    ``offset``; ``a.offset_alias`` is an unread second name of ``b.offset``; ``spare`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        with wh.replicate(1):
            self.a = Keeper()
        with wh.replicate(1):
            self.b = nn.Linear(4, 3)
            self.b.register_buffer("offset", torch.full((3,), 0.1))
            self.spare = nn.Linear(2, 2)
        self.a.register_buffer("offset_alias", self.b.offset)

    def forward(self, x):
        return self.b(self.a(x)) + self.b.offset


def _state_net() -> StateNet:
    """A StateNet whose buffers and frozen parameter hold values its constructor does not give."""
    torch.manual_seed(0)
    model = StateNet()
    with torch.no_grad():
        model.a.unread.fill_(7.0)
        model.a.frozen.fill_(3.0)
        model.b.offset.fill_(0.2)
    return model


def _rows(steps: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(steps)]


def _assert_state(state: dict, expected: dict) -> None:
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_stage_cut_holds_every_state_entry_read_or_not_and_no_other(capture):
    """No processes. The stages' state dicts together are the model's: unread buffer, unread frozen and
    trainable parameters, the unread alias (in the stage holding its tensor), no non-persistent buffer."""
    from whale.frontend.planning import plan_with_stages

    model = _state_net()
    plan, stages = plan_with_stages(model, 2, wh.Config(num_micro_batch=2, capture=capture),
                                    sample_batch=_rows(1)[0] if capture == "export" else None)
    first, second = plan.stage_cuts
    assert plan.capture == capture and {"a.frozen", "a.lin.weight"} <= set(first.params)
    assert "a.unread" in first.buffers and "a.offset_alias" in second.buffers  # the alias where its tensor is
    assert {"spare.weight", "b.weight"} <= set(second.params)  # unread, in the stage of its annotation
    merged = {k: v for st in stages for k, v in st.state_dict().items()}
    assert sorted(merged) == sorted(model.state_dict())
    assert "a.offset_alias" in stages[1].state_dict() and "a.scale" in dict(stages[0].named_buffers())
    fresh = StateNet()
    fresh.load_state_dict(merged, strict=True)
    _assert_state(fresh.state_dict(), model.state_dict())


def _exported_state(rank, world, path):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, capture="export"))
    model = _state_net()
    ref = copy.deepcopy(model)
    data = _rows(STEPS)
    plan = wh.plan_model(model, world, ctx.config, sample_batch=data[0])
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    engine = wh.parallelize(model, F.cross_entropy, opt, ctx=ctx, plan=plan)
    ref_opt = opt(ref.parameters())
    for x, y in data:
        engine.step((x, y))
        _ref_step(ref, ref_opt, x, y, 2)
    full = engine.full_state_dict()
    engine.save_checkpoint(path)
    with torch.no_grad():  # what the checkpoint must bring back, on every rank
        for t in model.state_dict(keep_vars=True).values():
            t.zero_()
    engine.load_checkpoint(path)
    loaded = engine.full_state_dict()
    if rank == 0:
        fresh = StateNet()
        fresh.load_state_dict(full, strict=True)
        _assert_state(fresh.state_dict(), ref.state_dict())
        _assert_state(loaded, ref.state_dict())
        assert "a.scale" not in full and float(full["a.unread"][0]) == 7.0 and float(loaded["a.frozen"][0]) == 3.0
    return plan.capture


def test_export_pipeline_full_state_dict_and_checkpoint_hold_unread_tensors(tmp_path):
    assert run_ranks(_exported_state, 2, str(tmp_path / "ckpt"), timeout=120) == ["export", "export"]
