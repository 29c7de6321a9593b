"""Per-rank data loading: PlanSampler / local_rows give each rank only its rows, and engine.step_local on them is
the same step as engine.step on the global batch, and as one process training on the whole batch.

Each distributed case trains three models from one initialisation side by side: an engine fed local rows (from
a DataLoader over PlanSampler), an engine fed the global batch, and a one-process deepcopy reference. Losses
and parameters of the two engines must agree exactly up to fp32 summation order (rtol 1e-5 / atol 1e-6, as
tests/test_equivalence.py), and both must match the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_loss
from whale.cluster import ClusterSpec

RTOL, ATOL = 1e-5, 1e-6
V100_P100 = {"nodes": [{"devices": ["V100-32GB", "V100-32GB"]}, {"devices": ["P100-16GB", "P100-16GB"]}]}


def _dataset(n: int, seq: int = 8, vocab: int = 32, ignore: bool = True) -> TensorDataset:
    """n token rows (x, y) [n, seq]; with ``ignore`` about a quarter of the targets are ignore_index (-100),
    unevenly per row (a per-sample mean loss then differs from the token mean: only token-weighted tests)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    y = x[:, 1:].clone()
    if ignore:
        y[torch.rand(y.shape, generator=g) < torch.linspace(0.0, 0.5, n)[:, None]] = -100
    return TensorDataset(x[:, :-1].contiguous(), y)


def _token_ce_ref(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def _local_vs_global(rank, world, spec):
    cluster = ClusterSpec.from_dict(spec["cluster"]) if spec.get("cluster") else None
    ctx = wh.init(wh.Config(num_micro_batch=spec.get("mb", 1), load_shares=spec.get("shares"), seed=0,
                            cluster=cluster))
    token = spec.get("token", False)
    loss_fn, ref_loss = (wh.token_cross_entropy(), _token_ce_ref) if token else (lm_loss, lm_loss)
    ds, b = _dataset(spec.get("n", 40), ignore=token), spec["batch"]
    model = TinyLM(stage_layers=spec["layers"], tied=False, stage_widths=spec.get("widths"))
    ref, glob_model = copy.deepcopy(model), copy.deepcopy(model)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731 - linear in the gradient
    sample = ds[:b] if cluster else None
    local = wh.parallelize(model, loss_fn, opt, ctx=ctx, sample_batch=sample)
    glob = wh.parallelize(glob_model, loss_fn, opt, ctx=ctx, sample_batch=sample)
    assert local.plan == glob.plan
    ref_opt = opt(ref.parameters())
    sampler = wh.PlanSampler(len(ds), local.plan, rank, b, shuffle=True, seed=7)
    loader = sampler.loader(ds)
    out = {"losses": [], "glob": [], "ref": [], "eval": [], "loads": sampler.loads, "stage": local.stage,
           "plan": local.plan.to_json(), "indices": []}
    for epoch in range(spec.get("epochs", 1)):
        sampler.set_epoch(epoch)
        order = sampler.order()
        out["indices"].append(list(sampler))
        for s, batch in enumerate(loader):
            gx, gy = ds[order[s * b:(s + 1) * b]]
            out["losses"].append(local.step_local(batch, b)["loss"])
            out["glob"].append(glob.step((gx, gy))["loss"])
            ref_opt.zero_grad()
            loss = ref_loss(ref(gx), gy)
            loss.backward()
            ref_opt.step()
            out["ref"].append(loss.item())
        out["eval"].append((local.eval_step_local(batch, b)["loss"], glob.eval_step((gx, gy))["loss"]))
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["glob"]), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["ref"]), rtol=RTOL, atol=ATOL)
    for e_local, e_glob in out["eval"]:
        assert e_local == pytest.approx(e_glob, rel=RTOL)
    ref_params = dict(ref.named_parameters())
    glob_params = dict(glob.module.named_parameters())
    for name, p in local.module.named_parameters():
        torch.testing.assert_close(p.detach(), glob_params[name].detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL)
    return out


def _check(world, spec):
    results = run_ranks(_local_vs_global, world, spec, timeout=120)
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks disagree on the global loss"
    plan = wh.Plan.from_json(results[0]["plan"])
    for epoch in range(spec.get("epochs", 1)):  # each stage's ranks load disjoint rows covering each batch
        for stage in range(plan.num_stages):
            got = [r["indices"][epoch] for r in results if r["stage"] == stage]
            for s in range(len(got[0])):
                rows = sorted(i for lane in got for i in lane[s])
                assert len(rows) == spec["batch"] and len(set(rows)) == spec["batch"]
    return results, plan


@pytest.mark.parametrize("token", [False, True])
def test_data_parallel_uneven_shares_local_rows_match(token):
    _, plan = _check(2, {"layers": (2,), "batch": 8, "shares": (5, 3), "token": token, "epochs": 2, "n": 20})
    assert [b - a for lane in plan.micro_batch_rows(8) for a, b in lane] == [5, 3]


def test_hardware_aware_shares_with_micro_batches_local_rows_match():
    _, plan = _check(4, {"layers": (2,), "batch": 40, "mb": 2, "cluster": V100_P100, "token": True, "n": 80})
    assert len(set(plan.lane_weights)) > 1  # V100 lanes take more rows than P100 lanes


def test_data_parallel_times_pipeline_local_rows_match():
    results, plan = _check(4, {"layers": (1, 2), "batch": 8, "mb": 2, "shares": (3, 1), "token": True})
    assert plan.num_stages == 2 and plan.num_replicas == 2
    assert all(r["loads"] for r in results)  # first and last stage both load (inputs / targets)


def test_stages_of_different_widths_load_their_own_rows():
    """World 3: a 2-wide stage 0 (inputs of its two lanes' rows) and a 1-wide last stage (all targets)."""
    results, plan = _check(3, {"layers": (1, 1), "widths": (2, 1), "batch": 8, "mb": 2, "token": True})
    assert [len(r["indices"][0][0]) for r in results] == [4, 4, 8]


def test_four_stage_pipeline_middle_stages_load_nothing():
    results, _ = _check(4, {"layers": (1, 1, 1, 1), "batch": 8, "mb": 4, "token": True, "n": 24})
    assert [r["loads"] for r in sorted(results, key=lambda r: r["stage"])] == [True, False, False, True]


def _wrong_local(rank, world, case):
    ctx = wh.init(wh.Config(load_shares=(3, 1), seed=0))
    engine = wh.parallelize(TinyLM(stage_layers=(1,)), lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    ds = _dataset(8)
    rows = wh.local_rows(engine.plan, rank, 8)
    if case == "equal_shares" and rank == 0:  # a DistributedSampler's equal share: 2 rows instead of 6
        rows = rows[:2]
    x, y = ds[rows]
    global_batch = 9 if case == "global_batch" and rank == 1 else 8
    try:
        engine.step_local((x, y), global_batch)
    except wh.BatchError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("case", ["equal_shares", "global_batch"])
def test_wrong_local_batch_raises_on_every_rank(case):
    errors = run_ranks(_wrong_local, 2, case)
    assert all(errors), errors
    if case == "equal_shares":
        assert "needs its local inputs with 6 rows" in errors[0] and "another rank" in errors[1]
    else:
        assert "different global_batch" in errors[0] or "divide" in errors[1]


def _plan(world, layers=(2,), mb=1, shares=None):
    return wh.plan_model(TinyLM(stage_layers=layers), world, wh.Config(num_micro_batch=mb, load_shares=shares))


@pytest.mark.parametrize("world,layers,mb,shares,batch", [
    (2, (2,), 1, (5, 3), 8), (4, (2,), 3, (1, 2, 3, 2), 24), (4, (1, 2), 2, (3, 1), 8), (4, (1, 1, 1, 1), 4, None, 8),
])
def test_sampler_partitions_every_global_batch_by_the_plans_shares(world, layers, mb, shares, batch):
    plan = _plan(world, layers, mb, shares)
    rows = plan.micro_batch_rows(batch)
    samplers = [wh.PlanSampler(50, plan, r, batch, seed=1) for r in range(world)]
    order = samplers[0].order()
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == 50 // batch == len(s) for p, s in zip(per_rank, samplers, strict=True))
    for r in range(world):
        stage, lane = plan.coords(r)
        want = [[order[k * batch + i] for a, b in rows[lane] for i in range(a, b)] for k in range(50 // batch)]
        assert per_rank[r] == want  # this lane's rows, micro-batch by micro-batch, in the engine's order
        assert [len(ix) for ix in per_rank[r]] == [sum(b - a for a, b in rows[lane])] * len(want)
    for stage in range(plan.num_stages):
        ranks = plan.stage_ranks(stage)
        for k in range(len(per_rank[0])):  # the stage's lanes partition the global batch exactly
            assert sorted(i for r in ranks for i in per_rank[r][k]) == sorted(order[k * batch:(k + 1) * batch])


def test_sampler_epochs_shuffle_and_drop_last():
    plan = _plan(2, shares=(3, 1))
    s = wh.PlanSampler(10, plan, 0, 4, shuffle=True, seed=0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first and len(s) == 2
    s.set_epoch(0)
    assert list(s) == first
    keep = wh.PlanSampler(10, plan, 1, 4, shuffle=False, drop_last=False)
    assert len(keep) == 3 and list(keep) == [[3], [7], [1]]  # the last batch is completed from the start
    with pytest.raises(ValueError, match="fewer than one global batch"):
        wh.PlanSampler(3, plan, 0, 4)
    with pytest.raises(wh.PlanError):
        wh.PlanSampler(10, plan, 0, 1)  # a lane would get no row


def test_middle_stage_loader_yields_nones():
    plan = _plan(4, layers=(1, 1, 1, 1), mb=2)
    middle = wh.PlanSampler(16, plan, plan.rank_of(1, 0), 4)
    assert not middle.loads and list(middle.loader(_dataset(16))) == [None] * 4
    first = wh.PlanSampler(16, plan, plan.rank_of(0, 0), 4)
    x, y = next(iter(first.loader(_dataset(16))))
    assert first.loads and x.shape == y.shape == (4, 8)


def test_loader_batches_are_the_sampled_rows():
    ds = _dataset(12)
    plan = _plan(2, shares=(1, 2))
    sampler = wh.PlanSampler(12, plan, 1, 6, seed=2)
    for idx, (x, y) in zip(sampler, DataLoader(ds, batch_sampler=sampler), strict=True):
        torch.testing.assert_close(x, ds.tensors[0][idx])
        torch.testing.assert_close(y, ds.tensors[1][idx])
