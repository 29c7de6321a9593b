"""Buffers, random streams and train/eval mode across ranks.

- BatchNorm (1d/2d, affine or not, cumulative momentum, no running statistics) trains like one process on the
  whole batch (with micro-batches: one process doing the same gradient accumulation), with equal and uneven
  lane shares and inside a pipeline stage; running statistics are identical on every lane after every step and
  equal to one process's; eval uses the running statistics without communicating. Other buffers a model
  updates in forward follow lane 0. Reference: a ``deepcopy`` trained by plain PyTorch, AdamW lr 1e-3, fp32,
  rtol 1e-5 / atol 1e-6 as in test_equivalence.
- Dropout masks differ across lanes, pipeline stages and shards of a split layer, agree across the ranks of a
  split group on replicated values, and are reproducible from ``Config.seed`` (and from the step, so a resumed
  run draws the same masks); the user's random stream stays identical on every rank.

Train/eval mode in a pipeline (functional dropout, branching on ``self.training``): tests/test_pipeline_mode.py.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import RecordingAdamW

RTOL, ATOL = 1e-5, 1e-6


# --- BatchNorm -------------------------------------------------------------------------------------------
class BNNet(nn.Module):
    """[B, 3, 4, 4] -> [B, 5]: conv, BatchNorm2d, conv, BatchNorm2d(affine=False), Linear, BatchNorm1d
    (momentum=None), optionally BatchNorm1d without running statistics, Linear. ``stages=2`` puts everything
    after the first BatchNorm in a second replicate(1) stage."""

    def __init__(self, stages: int = 1, no_running: bool = False) -> None:
        super().__init__()
        scope = (lambda: wh.replicate(1)) if stages > 1 else contextlib.nullcontext
        with scope():
            self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before BatchNorm has zero gradient
            self.bn1 = nn.BatchNorm2d(4)
        with scope():
            self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(4, affine=False)
            self.fc1 = nn.Linear(64, 8, bias=False)
            self.bn3 = nn.BatchNorm1d(8, momentum=None)
            self.bn4 = nn.BatchNorm1d(8, track_running_stats=False) if no_running else nn.Identity()
            self.fc2 = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc2(self.bn4(F.relu(self.bn3(self.fc1(x.flatten(1))))))


def _images(steps: int, batch: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 4, 4, generator=g) * 2 + 0.5, torch.randint(0, 5, (batch,), generator=g))
            for _ in range(steps)]


def _ref_step(ref, opt, x, y, m):
    """One process: gradient accumulation over ``m`` equal micro-batches, each loss weighted rows/batch."""
    opt.zero_grad()
    total = 0.0
    for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
        loss = F.cross_entropy(ref(xc), yc) * (len(yc) / len(y))
        loss.backward()
        total += loss.item()
    opt.step()
    return total


def _count_collectives(group, calls):
    """Wrap ``dist.all_reduce`` so that calls on ``group`` are appended to ``calls``."""
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if kwargs.get("group") is group and group is not None:
            calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    return original


def _bn_compare(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=spec.get("mb", 1), load_shares=spec.get("shares"), seed=0))
    model = BNNet(spec.get("stages", 1), spec.get("no_running", False))
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, F.cross_entropy, lambda ps: RecordingAdamW(ps, lr=1e-3), ctx=ctx)
    ref_opt = RecordingAdamW(ref.parameters(), lr=1e-3)
    ref_state = ref.state_dict()
    calls: list[int] = []
    original = _count_collectives(engine.buffers.group, calls)
    states, losses, ref_losses = [], [], []
    try:
        for x, y in _images(3, spec["batch"]):
            losses.append(engine.step((x, y))["loss"])
            ref_losses.append(_ref_step(ref, ref_opt, x, y, spec.get("mb", 1)))
            mine = engine.module.state_dict()
            for name, t in mine.items():  # parameters and buffers, after every step
                torch.testing.assert_close(t, ref_state[name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, n=name: f"{n} after step {len(losses)}: {m}")
            states.append({k: v.clone() for k, v in mine.items() if "running" in k or "tracked" in k})
        train_calls = len(calls)
        x, y = _images(1, spec["batch"], seed=9)[0]
        ev = engine.eval_step((x, y))["loss"]
        eval_calls = len(calls) - train_calls
    finally:
        dist.all_reduce = original
    ref.eval()
    with torch.no_grad():
        ref_eval = float(F.cross_entropy(ref(x), y))
    for name, p in engine.module.named_parameters():
        grads = [g[id(p)] for g in engine.optimizer.grads]
        ref_grads = [g[id(dict(ref.named_parameters())[name])] for g in ref_opt.grads]
        for step, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name, s=step: f"grad {n} {s}: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    first = engine.buffers.batchnorms[0]
    copied = copy.deepcopy(engine.module).get_submodule(first)  # a copy is a plain, local BatchNorm
    return {"stage": engine.stage, "states": states, "eval": ev, "ref_eval": ref_eval, "train_calls": train_calls,
            "eval_calls": eval_calls, "converted": engine.buffers.batchnorms,
            "class": type(engine.module.get_submodule(first)).__mro__[1].__name__,
            "copy_class": type(copied).__module__ + "." + type(copied).__name__}


def _check_bn(world, spec):
    results = run_ranks(_bn_compare, world, spec)
    by_stage: dict[int, list] = {}
    for r in results:
        by_stage.setdefault(r["stage"], []).append(r)
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=RTOL, abs=ATOL)
    for lanes in by_stage.values():  # the lanes of a stage hold bit-identical running statistics
        for other in lanes[1:]:
            for a, b in zip(lanes[0]["states"], other["states"], strict=True):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return results


@pytest.mark.parametrize("world,shares,mb", [(2, None, 1), (2, (5, 3), 1), (2, (5, 3), 2), (3, (1, 2, 3), 2)])
def test_batchnorm_data_parallel_matches_one_process(world, shares, mb):
    results = _check_bn(world, {"batch": 12 if world == 3 else 8, "shares": shares, "mb": mb})
    for r in results:
        assert r["converted"] == ["bn1", "bn2", "bn3"] and r["class"] == "GlobalBatchNorm"
        assert r["copy_class"] == "torch.nn.modules.batchnorm.BatchNorm2d"
        assert r["train_calls"] > 0  # statistics all-reduced in training...
        assert r["eval_calls"] == 0  # ...and running statistics used in eval, with no communication


def test_batchnorm_in_pipeline_stages_with_uneven_lanes():
    results = _check_bn(4, {"batch": 8, "mb": 2, "shares": (3, 1), "stages": 2})
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]
    assert {tuple(r["converted"]) for r in results} == {("bn1",), ("bn2", "bn3")}


def test_batchnorm_without_running_statistics_uses_global_batch_statistics_in_eval():
    results = _check_bn(2, {"batch": 8, "shares": (5, 3), "no_running": True})
    assert all(r["eval_calls"] > 0 for r in results)  # eval normalizes by the whole batch, as one process


class OwnForwardBN(nn.BatchNorm1d):
    def forward(self, x):
        return super().forward(x) * 2


def _custom_bn(rank, world):
    ctx = wh.init(wh.Config(seed=0))
    model = nn.Sequential(nn.Linear(4, 4), OwnForwardBN(4))
    try:
        wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    except ValueError as exc:
        return str(exc)
    return None


def test_batchnorm_subclass_with_its_own_forward_is_refused_by_name():
    for message in run_ranks(_custom_bn, 2):
        assert message and "'1'" in message and "OwnForwardBN" in message and "Fix:" in message


class Tracking(nn.Module):
    """Linear with buffers updated in forward (a row counter and an EMA of the input mean) and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("const", torch.arange(4.0))

    def forward(self, x):
        if self.training:
            self.seen.add_(x.size(0))
            self.ema.mul_(0.5).add_(x.detach().mean(0) * 0.5)
        return self.lin(x)


def _tracking(rank, world):
    ctx = wh.init(wh.Config(load_shares=(5, 3), seed=0))
    model = Tracking()
    engine = wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    version = model.const._version
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(2):
        x = torch.randn(8, 4, generator=g)
        engine.step((x, x))
        out.append((int(model.seen), model.ema.clone()))
    return {"out": out, "const_untouched": model.const._version == version, "again": engine.buffers.after_step()}


def test_buffers_updated_in_forward_follow_lane_zero_after_every_step():
    results = run_ranks(_tracking, 2)
    g = torch.Generator().manual_seed(2)
    ema = torch.zeros(4)
    for step in range(2):
        x = torch.randn(8, 4, generator=g)
        ema = ema * 0.5 + x[:5].mean(0) * 0.5  # lane 0 holds rows 0-4 of every batch
        for r in results:
            seen, mine = r["out"][step]
            assert seen == 5 * (step + 1)  # lane 1's own count (3 per step) never survives a step
            torch.testing.assert_close(mine, ema)
    for r in results:
        assert r["const_untouched"] and r["again"] == 0  # unchanged buffers are not sent


# --- random streams --------------------------------------------------------------------------------------
class DropNet(nn.Module):
    """Backbone Linear + Dropout (replicated); split head Linear -> Dropout -> Linear -> Dropout: the first
    dropout acts on column shards, the second on the row-parallel (replicated) output. ``count=2`` nests the
    split in the replicate (nested data parallelism on 4 ranks); otherwise the head is colocated."""

    def __init__(self, count=None) -> None:
        super().__init__()
        head = lambda: nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 16), nn.Dropout(0.5))  # noqa: E731
        with wh.replicate(count):
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5))
            if count:
                with wh.split(count):
                    self.head = head()
        if not count:
            with wh.split(count):
                self.head = head()

    def forward(self, x):
        return self.head(self.backbone(x))


def _capture(module: nn.Module, masks: dict) -> None:
    """Record every Dropout's kept-elements mask (its output is nonzero exactly where it keeps)."""
    for name, m in module.named_modules():
        if isinstance(m, nn.Dropout):
            m.register_forward_hook(lambda mod, args, out, n=name: masks.setdefault(n, []).append(out != 0))


def _masks(rank, world, seed, count, steps=2, start=0):
    ctx = wh.init(wh.Config(seed=seed))
    engine = wh.parallelize(DropNet(count), F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.01), ctx=ctx)
    engine.steps_done = start  # as load_checkpoint restores it
    masks: dict = {}
    _capture(engine.module, masks)
    g = torch.Generator().manual_seed(4)
    for _ in range(steps):
        x = torch.randn(8, 8, generator=g)
        engine.step((x, torch.zeros(8, 16)))
    return {"masks": masks, "user": torch.rand(4), "lane": engine.lane}


def _names(results):
    """(backbone dropout, dropout on column shards, dropout on the replicated row-parallel output)."""
    names = sorted(results[0]["masks"])
    return tuple(next(n for n in names if n.startswith(p) and n.endswith(e))
                 for p, e in (("backbone", ""), ("head", "1"), ("head", "3")))


def _same(a, b):
    return a.shape == b.shape and torch.equal(a, b)


def test_dropout_streams_colocated_split_head():
    results = run_ranks(_masks, 2, 0, None)
    back, sharded, replicated = _names(results)
    r0, r1 = (r["masks"] for r in results)
    assert not _same(r0[back][0], r1[back][0])  # data-parallel lanes: own masks
    assert not _same(r0[sharded][0], r1[sharded][0])  # column shards: own masks
    assert _same(r0[replicated][0], r1[replicated][0])  # replicated values in the split group: one mask
    assert not _same(r0[back][0], r0[back][1])  # the stream moves on from step to step
    assert torch.equal(results[0]["user"], results[1]["user"])  # the user's stream is the same everywhere
    again = run_ranks(_masks, 2, 0, None)
    other = run_ranks(_masks, 2, 1, None)
    for r, a, o in zip(results, again, other, strict=True):
        for name, ms in r["masks"].items():
            assert all(torch.equal(m, n) for m, n in zip(ms, a["masks"][name], strict=True))  # same seed
            assert not all(torch.equal(m, n) for m, n in zip(ms, o["masks"][name], strict=True))  # other seed


def test_dropout_streams_nested_split_and_resume():
    results = run_ranks(_masks, 4, 0, 2)
    back, sharded, replicated = _names(results)
    first = {r["lane"]: r["masks"] for r in results}
    for a in range(4):
        for b in range(a + 1, 4):
            assert not _same(first[a][back][0], first[b][back][0])
            assert not _same(first[a][sharded][0], first[b][sharded][0])
            same_group = a // 2 == b // 2
            assert _same(first[a][replicated][0], first[b][replicated][0]) == same_group
    resumed = {r["lane"]: r["masks"] for r in run_ranks(_masks, 4, 0, 2, 1, 1)}  # step 1 of a resumed run
    for lane in range(4):
        for name in (back, sharded, replicated):
            assert torch.equal(resumed[lane][name][0], first[lane][name][1])
