"""split keeps one-process semantics: out-of-range ids and targets raise, gradient clipping counts a replicated
bias once, a weight tied inside the split stays tied, the cross-entropy options of F.cross_entropy work on
class-sharded logits, and the consolidated model has the original names and full shapes.

Every distributed check compares with one process (a ``deepcopy`` trained by plain PyTorch, or
``F.cross_entropy`` on the full logits) on gloo ranks, with uneven shards and uneven lane shares; fp32,
rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import PipeWithSplit, RecordingAdamW, RecordingSGD, reference_step
from tests.test_split_runtime import Classifier, _with_shard_weights
from whale.parallel.bridge import ShardedLogits
from whale.parallel.split import (
    RowParallelLinear,
    SplitError,
    VocabParallelEmbedding,
    offsets,
    register_split_rule,
    shard_module,
)
from whale.parallel.split_loss import sharded_cross_entropy
from whale.parallel.split_state import check_cross_stage_ties, local_param, shard_ties
from whale.runtime.checkpoint import read_model_state

RTOL, ATOL = 1e-5, 1e-6


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL):
        err = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {err:.3g}\n{actual}\n{expected}")


# --- sharded cross-entropy options and range checks (no engine) -----------------------------------------
def _ce_cases(c, g):
    target = torch.randint(0, c, (6, 2), generator=g)
    ignored = target.clone()
    ignored[0, 1] = ignored[3, 0] = -100
    own_ignore = target.clone()
    own_ignore[1, 0] = own_ignore[4, 1] = 3  # ignore_index inside [0, C)
    weight = torch.rand(c, generator=g) + 0.2
    return [({}, ignored), ({"ignore_index": 3}, own_ignore), ({"label_smoothing": 0.15}, ignored),
            ({"weight": weight}, ignored), ({"weight": weight, "label_smoothing": 0.3, "ignore_index": 3}, own_ignore)]


def _ce_options(rank, group, sizes):
    c, start, size = sum(sizes), offsets(sizes)[rank], sizes[rank]
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 2, c, generator=g) * 2
    for opts, target in _ce_cases(c, g):
        for reduction in ("mean", "sum", "none"):
            whole = full.clone().requires_grad_()
            ref = F.cross_entropy(whole.reshape(-1, c), target.reshape(-1), reduction=reduction, **opts)
            local = full[..., start:start + size].clone().requires_grad_()
            got = wh.cross_entropy(ShardedLogits(local, start, group, c), target, reduction=reduction, **opts)
            what = f"cross-entropy {reduction} {sorted(opts)}"
            _close(got, ref.view(got.shape), what)
            up = torch.randn(ref.shape, generator=g)
            (ref * up).sum().backward()
            (got * up.view(got.shape)).sum().backward()
            _close(local.grad, whole.grad[..., start:start + size], f"grad of {what}")
    # C unknown to the caller: the shards' sizes are added up by an all-reduce
    opts, target = _ce_cases(c, g)[4]
    got = sharded_cross_entropy(full[..., start:start + size], target, start, group, **opts)
    _close(got, F.cross_entropy(full.reshape(-1, c), target.reshape(-1), **opts), "cross-entropy, C from shards")
    flat = wh.cross_entropy(ShardedLogits(full[..., start:start + size], start, group, c), target.reshape(-1),
                            reduction="none", **opts)  # a flat target over [*, C_local] logits
    _close(flat, F.cross_entropy(full.reshape(-1, c), target.reshape(-1), reduction="none", **opts), "flat target")


def _range_errors(rank, group, sizes):
    """Each bad input raises on every rank before any collective; a collective afterwards still pairs up."""
    c, start, size = sum(sizes), offsets(sizes)[rank], sizes[rank]
    logits = ShardedLogits(torch.randn(4, size), start, group, c)
    for bad in (c + 3, -1):
        target = torch.tensor([0, bad, 1, -100])
        with pytest.raises(IndexError, match=rf"target {bad} is out of range for {c} classes \(valid targets: "
                                             rf"0 to {c - 1}, or ignore_index=-100\)"):
            wh.cross_entropy(logits, target)
    with pytest.raises(ValueError, match=rf"one entry per class \({c}\), got shape \(3,\)"):
        wh.cross_entropy(logits, torch.zeros(4, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="integer class ids"):
        wh.cross_entropy(logits, torch.zeros(4))
    emb = VocabParallelEmbedding(nn.Embedding(c, 3), group, sizes)
    for bad in (c, -1):
        with pytest.raises(IndexError, match=rf"embedding id {bad} is out of range for a vocabulary of {c} "
                                             rf"\(valid ids: 0 to {c - 1}\)"):
            emb(torch.tensor([[0, bad], [1, 2]]))
    ref = nn.Embedding(c, 3)
    ref.weight.data.copy_(torch.cat(_all_gather_rows(emb.weight.detach(), group, sizes)))
    ids = torch.tensor([[0, c - 1], [1, 2]])
    _close(emb(ids), ref(ids), "embedding after the refused ids")


def _all_gather_rows(x, group, sizes):
    pad = x.new_zeros(max(sizes), *x.shape[1:])
    pad[: x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(parts, pad, group=group)
    return [p[:s] for p, s in zip(parts, sizes, strict=True)]


def _meta_row_bias(rank, group, sizes):
    """A row-parallel layer too big to build whole: its replicated bias is materialized once and broadcast,
    so every rank holds the same one (the seeds differ per rank here)."""
    torch.manual_seed(rank)
    with torch.device("meta"):
        full = nn.Linear(sum(sizes), 4)
    row = RowParallelLinear(full, group, sizes)
    assert not row.bias.is_meta and row.shard_layout() == {"weight": 1, "bias": None}
    gathered = [torch.empty_like(row.bias) for _ in sizes]
    dist.all_gather(gathered, row.bias.detach(), group=group)
    assert all(torch.equal(b, gathered[0]) for b in gathered), "the replicated bias differs across the group"


def _functional(rank, world, sizes):
    group = dist.group.WORLD
    _ce_options(rank, group, sizes)
    _range_errors(rank, group, sizes)
    _meta_row_bias(rank, group, sizes)
    return True


@pytest.mark.parametrize("world,sizes", [(2, [2, 5]), (3, [1, 4, 2])], ids=["world2", "world3"])
def test_cross_entropy_options_and_out_of_range_inputs_match_one_process(world, sizes):
    assert run_ranks(_functional, world, sizes) == [True] * world


# --- engine: clipping with a row-parallel bias, consolidated state, model.pt ----------------------------
class SplitMLP(nn.Module):
    """[B, 6] -> [B, 5]: replicated input layer, then a split MLP (column then row, both with biases)."""

    def __init__(self):
        super().__init__()
        with wh.replicate():
            self.inp = nn.Linear(6, 6)
        with wh.split():
            self.mlp = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 5))

    def forward(self, x):
        return self.mlp(torch.tanh(self.inp(x)))


def _steps(n, batch, make_x, classes, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(make_x(g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def _same_state(full: dict, ref: nn.Module) -> str | None:
    """Load ``full`` strictly into a copy of the plain model; ``None`` when it equals ``ref``, else the diff."""
    plain = copy.deepcopy(ref)
    for p in plain.parameters():
        p.data.zero_()
    plain.load_state_dict(full, strict=True)
    for name, t in ref.state_dict().items():
        got = plain.state_dict()[name]
        if got.shape != t.shape or not torch.allclose(got, t, rtol=RTOL, atol=ATOL):
            return f"{name}: {tuple(got.shape)} vs {tuple(t.shape)}, max diff {(got - t).abs().max():.3g}"
    return None


def _clip_run(rank, world, shares, shard_weights, tmp):
    ctx = wh.init(wh.Config(max_grad_norm=0.3, load_shares=shares, seed=0))
    model = SplitMLP()
    ref = copy.deepcopy(model)
    plan = _with_shard_weights(wh.plan_model(model, world, ctx.config), shard_weights)
    engine = wh.parallelize(model, F.cross_entropy, lambda ps: RecordingSGD(ps, lr=0.5), ctx=ctx, plan=plan)
    ref_opt = RecordingSGD(ref.parameters(), lr=0.5)
    norms, ref_norms = [], []
    for x, y in _steps(3, 12, lambda g: torch.randn(12, 6, generator=g), 5):
        norms.append(engine.step((x, y))["grad_norm"])
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)))
        ref_opt.step()
    bias = engine.split.regions[0].sharded[2].bias
    bias_grads = [g[id(bias)] for g in engine.optimizer.grads]
    ref_bias = [g[id(ref.mlp[2].bias)] for g in ref_opt.grads]
    for step, (mine, theirs) in enumerate(zip(bias_grads, ref_bias, strict=True)):
        _close(mine, theirs, f"row-parallel bias grad, step {step}")
    full = engine.full_state_dict()
    engine.save_checkpoint(tmp)
    out = {"norms": norms, "ref_norms": ref_norms, "bias_grads": [g.tolist() for g in bias_grads]}
    if rank == 0:
        out["full"] = _same_state(full, ref)
        out["model_pt"] = _same_state(read_model_state(tmp), ref)  # the checkpoint's model, whole
        out["keys"] = sorted(full)
    return out


@pytest.mark.parametrize("world,shares,shard_weights", [(2, (5, 3), (1, 3)), (3, (1, 2, 3), (3, 1, 2))],
                         ids=["world2", "world3"])
def test_clipping_counts_a_row_parallel_bias_once(world, shares, shard_weights):
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_clip_run, world, shares, shard_weights, tmp)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r["ref_norms"]), rtol=RTOL, atol=ATOL)
        assert r["bias_grads"] == results[0]["bias_grads"], "the replicated bias's gradient differs in the group"
    assert results[0]["ref_norms"][0] > 0.3, "the test must clip"
    assert results[0]["full"] is None and results[0]["model_pt"] is None, results[0]
    assert results[0]["keys"] == sorted(SplitMLP().state_dict())


# --- engine: an embedding and an LM head tied inside the split ------------------------------------------
class TiedSplitLM(nn.Module):
    """[B, T] ids -> class-sharded logits [B, T, V]; embedding and head split and tied, block replicated."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        with wh.split():
            self.emb = nn.Embedding(vocab, d)
        with wh.replicate():
            self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        with wh.split():
            self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.block(self.emb(idx)))


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _tied_run(rank, world, shares, shard_weights):
    ctx = wh.init(wh.Config(load_shares=shares, seed=0))
    model = TiedSplitLM()
    ref = copy.deepcopy(model)
    plan = _with_shard_weights(wh.plan_model(model, world, ctx.config), shard_weights)
    engine = wh.parallelize(model, wh.cross_entropy, lambda ps: RecordingAdamW(ps, lr=1e-2), ctx=ctx, plan=plan)
    ref_opt = RecordingAdamW(ref.parameters(), lr=1e-2)
    emb, head = (r.sharded for r in engine.split.regions)
    assert emb.weight is head.weight, "the tie must survive sharding"
    losses, ref_losses = [], []
    for x, _ in _steps(4, 6, lambda g: torch.randint(0, 11, (6, 5), generator=g), 11):
        y = torch.roll(x, 1, dims=1)
        losses.append(engine.step((x, y))["loss"])
        ref_losses.append(reference_step(ref_opt, _lm_loss(ref(x), y)))
    full = engine.full_state_dict()
    errors = []
    for bad_x, bad_y in [(torch.full((6, 5), 11), torch.zeros(6, 5, dtype=torch.long)),
                         (torch.zeros(6, 5, dtype=torch.long), torch.full((6, 5), 40))]:
        try:
            engine.step((bad_x, bad_y))
        except IndexError as exc:
            errors.append(str(exc))
    return {"losses": losses, "ref_losses": ref_losses, "errors": errors,
            "full": _same_state(full, ref) if rank == 0 else None}


@pytest.mark.parametrize("world,shares,shard_weights", [(2, (2, 1), (3, 1)), (3, (1, 2, 3), (3, 1, 2))],
                         ids=["world2", "world3"])
def test_embedding_and_head_tied_inside_split_stay_tied(world, shares, shard_weights):
    results = run_ranks(_tied_run, world, shares, shard_weights)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=RTOL, atol=ATOL)
        assert len(r["errors"]) == 2, r["errors"]  # every rank refused both, none hung
        assert "embedding id 11 is out of range for a vocabulary of 11" in r["errors"][0]
        assert "target 40 is out of range for 11 classes" in r["errors"][1]
    assert results[0]["full"] is None, results[0]["full"]


# --- engine: consolidated state of split inside a pipeline stage, and with nested data parallelism ------
def _full_state_run(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=spec.get("mb", 1), load_shares=spec.get("shares"), seed=0))
    if spec["model"] == "pipe":
        model, loss_fn, ref_loss_fn, classes = PipeWithSplit(), _lm_loss, _lm_loss, 16
        make_x = lambda g: torch.randint(0, 16, (8, 5), generator=g)  # noqa: E731
    else:
        model, loss_fn, ref_loss_fn, classes = Classifier(9, count=2), wh.cross_entropy, F.cross_entropy, 9
        make_x = lambda g: torch.randn(8, 8, generator=g)  # noqa: E731
    ref = copy.deepcopy(model)
    plan = _with_shard_weights(wh.plan_model(model, world, ctx.config), spec["shard_weights"])
    engine = wh.parallelize(model, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-2), ctx=ctx, plan=plan)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in _steps(2, 8, make_x, classes):
        y = torch.roll(x, 1, dims=1) if spec["model"] == "pipe" else y
        engine.step((x, y))
        ref_opt.zero_grad()
        ref_loss_fn(ref(x), y).backward()
        ref_opt.step()
    full = engine.full_state_dict()
    return {"full": _same_state(full, ref), "n": len(full)} if rank == 0 else {"full": None, "n": len(full)}


@pytest.mark.parametrize("spec", [
    {"model": "pipe", "mb": 2, "shares": (3, 1), "shard_weights": (1, 3)},
    {"model": "cls", "shard_weights": (2, 1)},
], ids=["split-in-pipeline-stage", "nested-data-parallel"])
def test_full_state_dict_has_original_names_and_full_shapes(spec):
    results = run_ranks(_full_state_run, 4, spec)
    assert results[0]["full"] is None, results[0]["full"]
    assert [r["n"] for r in results[1:]] == [0, 0, 0]


# --- no processes -----------------------------------------------------------------------------------------
def test_ties_that_sharding_would_break_are_refused_naming_both_modules():
    model = nn.ModuleDict({"emb": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    model["head"].weight = model["emb"].weight
    with shard_ties(model) as ties:  # cut two ways
        local_param(model["emb"].weight, 0, 0, 4)
        local_param(model["emb"].weight, 1, 0, 2)
    with pytest.raises(SplitError, match=r"emb\.weight and head\.weight are one tied parameter, but split cuts it "
                                         r"2 ways"):
        ties.check(nn.Module())
    with shard_ties(model) as ties:  # the head keeps the full weight outside the split
        model["emb"] = shard_module(model["emb"])
    with pytest.raises(SplitError, match=r"emb\.weight and head\.weight .* head\.weight is not under split"):
        ties.check(model)


class _CrossStageTie(nn.Module):
    """Stage 0 splits the embedding, stage 1 holds the head tied to it."""

    def __init__(self, vocab=16, d=8):
        super().__init__()
        with wh.replicate(2):
            with wh.split(2):
                self.emb = nn.Embedding(vocab, d)
            self.b0 = nn.Linear(d, d)
        with wh.replicate(2):
            self.b1 = nn.Linear(d, d)
            self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.b1(self.b0(self.emb(idx))))


def test_a_weight_tied_across_stages_cannot_be_split():
    plan = wh.plan_model(_CrossStageTie(), 4, wh.Config(num_micro_batch=2))
    with pytest.raises(SplitError, match=r"emb\.weight and head\.weight are one parameter tied across pipeline "
                                         r"stages \(0, 1\), but emb\.weight lies in 'emb', which is under split in "
                                         r"stage 0"):
        check_cross_stage_ties(plan)


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w


def test_a_split_rule_must_declare_its_parameters_layout():
    register_split_rule(_Scale, lambda module, group, sizes, **ctx: module)
    with pytest.raises(SplitError, match=r"rule for _Scale returned a module whose parameter\(s\) \['w'\] "
                                         r"declare no shard layout.*shard_layout\(\)"):
        shard_module(_Scale())


def test_byte_counts_in_messages_read_in_binary_units():
    from whale.planner.balance import InfeasiblePlanError, balance_batch
    from whale.units import format_bytes

    assert [format_bytes(v) for v in (0, 512, 1024, 183566000, 134218000, 5.4e9, -2048)] == [
        "0 B", "512 B", "1.0 KiB", "175.1 MiB", "128.0 MiB", "5.0 GiB", "-2.0 KiB"]
    with pytest.raises(InfeasiblePlanError, match=r"needs 175\.1 MiB \(171\.7 MiB fixed \+ 1 sample\(s\) x "
                                                  r"3\.4 MiB\) but has 128\.0 MiB; it lacks 47\.1 MiB"):
        balance_batch(8, [1.0, 1.0], [1e12, 134218000], [180e6, 180e6], 3566000)
