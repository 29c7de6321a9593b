"""Interleaved pipelines whose stages hold different chunk counts run and train like one process: on an emulated
H100 + T4 cluster the planner gives the H100's stage 3 of the 4 chunks (two hand-offs stay on that rank, no send
or receive) and the T4's stage 1; losses and parameters after 3 AdamW steps equal a one-process ``deepcopy``
(fp32, rtol 1e-5 / atol 1e-6; gloo ranks of :mod:`tests.distributed`, CPU ranks imitating the declared speeds).
At world 4 (2 H100 + 2 T4) the same map runs on 2 data-parallel lanes. A given map (0, 1, 0, 0), whose
activations go to stage 1 and back before a local hand-off and whose loss is computed on stage 0, runs from a
plan as well (SGD with momentum), and its step trace carries the simulator's prediction of that schedule; on that
map the knobs users turn match one process too: a token-weighted loss with ignored targets (one micro-batch has
none), the user's own optimizer with two param groups (weight decay on matrices only, a larger LR on the rest)
and a ``LambdaLR`` warm-up stepped after each step."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches, lm_loss, lm_side_by_side
from whale.cluster import ClusterSpec

_NODES = {2: [{"devices": ["H100-80GB", "T4"]}],
          4: [{"devices": ["H100-80GB", "H100-80GB"]}, {"devices": ["T4", "T4"]}]}


def _config(world: int) -> wh.Config:
    cluster = ClusterSpec.from_dict({"emulate": True, "nodes": _NODES[world]})
    return wh.Config(num_micro_batch=4, schedule="Interleaved1F1B", virtual_stages=2, seed=0, cluster=cluster)


def _model() -> TinyLM:
    return TinyLM(stage_layers=(2, 2, 2, 2), d=32, tied=True)  # 4 chunk scopes: p = 2, v = 2; 8 blocks


def _given_plan() -> wh.Plan:
    """Round-robin plan of an untied TinyLM (no cluster), its chunks moved to stages (0, 1, 0, 0)."""
    config = wh.Config(num_micro_batch=4, schedule="Interleaved1F1B", virtual_stages=2, seed=0)
    plan = wh.plan_model(TinyLM(stage_layers=(1, 1, 1, 1), d=32, tied=False), 2, config)
    return dataclasses.replace(plan, chunk_positions=(0, 1, 0, 0))


def _train(rank, world, given=False):
    """Whale on the emulated cluster (AdamW) or the given plan (SGD with momentum) against a one-process deepcopy,
    3 steps. (SGD for the given plan: AdamW divides each update by the root of the squared gradients, so a
    gradient near zero summed in another order can move one parameter by a few 1e-6; SGD compares the gradients
    themselves at fp32 tolerance.)"""
    ctx = wh.init(_config(world) if not given else wh.Config(num_micro_batch=4, schedule="Interleaved1F1B",
                                                             virtual_stages=2, seed=0))
    model = _model() if not given else TinyLM(stage_layers=(1, 1, 1, 1), d=32, tied=False)
    ref = copy.deepcopy(model)
    x0, y0 = next(iter(lm_batches(1, 8)))
    opt = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if given else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    engine = wh.parallelize(model, lm_loss, opt, ctx=ctx, sample_batch=(x0, y0),
                            plan=_given_plan() if given else None)
    ref_opt = opt(ref.parameters())
    losses, ref_losses = lm_side_by_side(engine, ref, ref_opt, 3, 8)
    full = engine.full_state_dict()
    trace = wh.write_step_trace(engine, os.path.join(tempfile.mkdtemp(), "trace.json")) if given else None
    predicted = sum(e.get("pid", 0) >= 1000 and e.get("ph") == "X" for e in json.load(open(trace))["traceEvents"]) \
        if trace else 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    diff = 0.0
    for name, value in (ref.state_dict().items() if rank == 0 else ()):
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        diff = max(diff, (full[name] - value).abs().max().item())
    return {"plan": engine.plan.to_json(), "labels": sorted(t[0] for t in engine.last_timeline),
            "stage": engine.stage, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "param_diff": diff, "predicted": predicted}


@pytest.mark.parametrize("world", [2, 4])
def test_unequal_chunk_counts_match_one_process(world):
    results = run_ranks(_train, world, timeout=180)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.chunk_positions == (0, 1, 1, 1) and (plan.num_stages, plan.num_chunks) == (2, 4)
    assert {plan.devices[r] for r in plan.stage_ranks(1)} == {"H100-80GB"}
    for r in results:
        chunks = len(plan.chunks_of(r["stage"]))
        assert r["labels"] == sorted(f"{k}{i}" + (f"c{c}" if c else "") for k in "FB" for c in range(chunks)
                                     for i in range(4))
    print(f"world {world}: max |loss diff| {max(r['loss_diff'] for r in results):.2e}, "
          f"max |param diff| {results[0]['param_diff']:.2e}")


def test_a_given_map_with_a_round_trip_before_a_local_hand_off_matches_one_process():
    results = run_ranks(_train, 2, (True,), timeout=180)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.chunk_positions == (0, 1, 0, 0)
    assert sorted(len(r["labels"]) for r in results) == [2 * 4 * 1, 2 * 4 * 3]
    assert results[0]["predicted"] == 2 * 4 * 4  # the trace's predicted step: F and B of 4 chunks x 4 micro-batches
    print(f"map (0, 1, 0, 0): max |loss diff| {max(r['loss_diff'] for r in results):.2e}, "
          f"max |param diff| {results[0]['param_diff']:.2e}")


def _groups(model) -> list[dict]:
    """Two param groups: matrices with weight decay, the rest without and at twice the LR."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 0.2}]


def _knobs(rank, world):
    """The given map (0, 1, 0, 0): token-weighted loss, param groups and a scheduler vs one process, 3 steps."""
    from tests.test_semantics import _padded_batches

    ctx = wh.init(wh.Config(num_micro_batch=4, schedule="Interleaved1F1B", virtual_stages=2, seed=0))
    model = TinyLM(stage_layers=(1, 1, 1, 1), d=32, tied=False)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(_groups(m), lr=0.1, momentum=0.9) for m in (model, ref))
    sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3)) for o in (opt, ref_opt))
    batches = _padded_batches(3, 8, [0, 0, 3, 8, 8, 1, 8, 8])  # micro-batch 0 (rows 0-1): no valid target
    engine = wh.parallelize(model, wh.token_cross_entropy(), opt, ctx=ctx, sample_batch=batches[0],
                            plan=_given_plan())
    losses, ref_losses, lrs = [], [], []
    for x, y in batches:
        losses.append(engine.step((x, y))["loss"])
        sched.step()
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        ref_losses.append(loss.item())
        lrs.append([g["lr"] for g in opt.param_groups])
    full = engine.full_state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, value in (ref.state_dict().items() if rank == 0 else ()):
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return {"lrs": lrs, "stage": engine.stage, "groups": [len(g["params"]) for g in opt.param_groups]}


def test_a_given_map_keeps_token_weighted_loss_param_groups_and_scheduler():
    results = run_ranks(_knobs, 2, timeout=180)
    for r in results:
        assert r["lrs"][0] == pytest.approx([0.1 * 2 / 3, 0.2 * 2 / 3]) and r["lrs"][-1] == pytest.approx([0.1, 0.2])
        assert all(r["groups"])  # each rank's optimizer holds its own stage's share of both groups
