"""Interleaved 1F1B and zero-bubble ZB-H1 train to the same losses, gradients and parameters as one process.

Multi-process gloo runs (:mod:`tests.distributed`, each with its timeout) through the one-process comparison of
:mod:`tests.test_equivalence` (a ``deepcopy`` trained by plain PyTorch on the whole batch; fp32, rtol 1e-5 /
atol 1e-6 on losses, every step's gradients and the parameters after the run).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches, lm_loss
from tests.test_equivalence import _check


@pytest.mark.parametrize("world,layers,shares", [(2, (3, 1), None), (4, (2, 1, 1, 3), None), (4, (1, 2), (3, 1))])
def test_zero_bubble_matches_one_process(world, layers, shares):
    """ZB-H1 at world 2 and 4: uneven stages, the tied embedding / head across the first and last stage, and
    (4 ranks, 2 stages) nested data parallelism with uneven lane shares."""
    results = _check(world, {"layers": layers, "batch": 8, "mb": 4, "schedule": "ZB-H1", "shares": shares,
                             "tied": True, "steps": 3})
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.schedule == "ZB-H1" and plan.num_stages == len(layers)
    assert [sp.names for sp in plan.shared_params] == [("emb.weight", "head.weight")]


def _compare_full(rank, world, spec):
    """Train ``spec`` under Whale and a one-process deepcopy with AdamW; compare losses every step and the whole
    model (``full_state_dict``, gathered on rank 0) after the run. Returns the losses, the plan and this rank's
    last timeline labels."""
    ctx = wh.init(wh.Config(num_micro_batch=spec["mb"], schedule=spec["schedule"], seed=0, zero=spec.get("zero", 0),
                            activation_checkpoint=spec.get("ckpt"), track_memory=spec.get("track"),
                            virtual_stages=spec.get("v", 1), load_shares=spec.get("shares")))
    model = TinyLM(stage_layers=spec["layers"], tied=True, stage_widths=spec.get("widths"))
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses, out = [], [], {}
    for x, y in lm_batches(3, spec["batch"]):
        out = engine.step((x, y))
        losses.append(out["loss"])
        ref_opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = engine.full_state_dict()
    for name, value in (ref.state_dict().items() if rank == 0 else ()):
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return {"losses": losses, "labels": [t[0] for t in engine.last_timeline], "peak": out.get("peak_memory_bytes"),
            "plan": engine.plan.to_json()}


@pytest.mark.parametrize("extra", [{"zero": 1}, {"zero": 2}, {"zero": 3}, {"ckpt": "all", "track": True}],
                         ids=["zero1", "zero2", "zero3", "checkpointing+memory"])
def test_zero_bubble_composes_with_zero_and_checkpointing(extra):
    """ZB-H1 with nested DP (2 stages x 2 lanes) under ZeRO-1/2/3, or recomputing every block in both the B and
    the W pass with the memory tracker on; W actions really run."""
    results = run_ranks(_compare_full, 4, {"layers": (1, 2), "mb": 4, "batch": 8, "schedule": "ZB-H1", **extra},
                        timeout=180)
    assert all(sum(lab.startswith("W") for lab in r["labels"]) == 4 for r in results)
    if extra.get("track"):
        assert all(r["peak"] for r in results)


def test_zero_bubble_across_stages_of_different_widths():
    """ZB-H1 over a batch bridge (stage 0 on two lanes, stage 1 on one) matches one process."""
    run_ranks(_compare_full, 3, {"layers": (2, 1), "widths": (2, 1), "mb": 2, "batch": 8, "schedule": "ZB-H1"},
              timeout=180)


def _traced(rank, world, path, schedule):
    ctx = wh.init(wh.Config(num_micro_batch=4, schedule=schedule, seed=0))
    engine = wh.parallelize(TinyLM(stage_layers=(1, 1)), lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    for x, y in lm_batches(2, 8):
        engine.step((x, y))
    return wh.write_step_trace(engine, path)


@pytest.mark.parametrize("schedule", ["1F1B", "ZB-H1"])
def test_step_trace_is_a_chrome_trace_with_every_action_and_the_prediction(tmp_path, schedule):
    path = str(tmp_path / "trace.json")
    assert run_ranks(_traced, 2, path, schedule, timeout=120) == [path, None]
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0 for e in spans)
    for pid in (0, 1, 1000, 1001):  # both ranks, executed and predicted
        names = {e["name"] for e in spans if e["pid"] == pid}
        assert {f"F{i}" for i in range(4)} <= names and {f"B{i}" for i in range(4)} <= names
        assert ({f"W{i}" for i in range(4)} <= names) == (schedule == "ZB-H1")
    cats = {e["cat"] for e in spans if e["pid"] < 1000}
    assert {"forward", "backward", "all-reduce", "optimizer"} <= cats
    assert "idle" in {e["cat"] for e in spans if e["pid"] == 0}  # stage 0 waits for output gradients


@pytest.mark.parametrize("world,layers,v,mb,shares", [
    (2, (1, 1, 1, 1), 2, 4, None),  # p=2, v=2, equal chunks
    (2, (2, 1, 1, 3, 1, 2), 3, 2, None),  # p=2, v=3, uneven chunks, m = p
    (4, (1, 2, 1, 1, 2, 1, 1, 1), 2, 4, None),  # p=4, v=2
    (4, (2, 1, 1, 3), 2, 4, (3, 1)),  # p=2 x 2 lanes of uneven shares (nested DP), uneven chunks
])
def test_interleaved_matches_one_process(world, layers, v, mb, shares):
    """Interleaved 1F1B: the embedding (chunk 0, stage 0) stays tied to the head (last chunk, last stage)."""
    results = run_ranks(_compare_full, world, {"layers": layers, "mb": mb, "batch": 8, "schedule": "Interleaved1F1B",
                                               "v": v, "shares": shares}, timeout=240)
    plan = wh.Plan.from_json(results[0]["plan"])
    p = len(layers) // v
    assert (plan.num_stages, plan.virtual_stages, plan.num_chunks) == (p, v, len(layers))
    assert [sp.stages for sp in plan.shared_params] == [(0, p - 1)]
    for r in results:  # every rank ran F and B of each of its v chunks for every micro-batch
        assert sorted(r["labels"]) == sorted(f"{k}{i}" + (f"c{c}" if c else "") for k in "FB" for c in range(v)
                                             for i in range(mb))


@pytest.mark.parametrize("extra", [{"zero": 1}, {"zero": 2}, {"ckpt": "all", "track": True}],
                         ids=["zero1", "zero2", "checkpointing+memory"])
def test_interleaved_composes_with_zero_and_checkpointing(extra):
    """Interleaved (p=2, v=2) with 2 lanes per stage under ZeRO-1/2, or recomputing every block of every
    chunk with the memory tracker on."""
    results = run_ranks(_compare_full, 4, {"layers": (1, 2, 1, 1), "mb": 4, "batch": 8, "v": 2,
                                           "schedule": "Interleaved1F1B", **extra}, timeout=240)
    if extra.get("track"):
        assert all(r["peak"] for r in results)


@pytest.mark.parametrize("config,match", [
    ({"schedule": "Interleaved1F1B"}, "needs virtual_stages >= 2"),
    ({"schedule": "1F1B", "virtual_stages": 2}, "needs schedule='Interleaved1F1B'"),
    ({"schedule": "Interleaved1F1B", "virtual_stages": 0}, "must be an int >= 1"),
])
def test_bad_schedule_combinations_are_one_line_config_errors(config, match):
    with pytest.raises(wh.ConfigError, match=match) as info:
        wh.Config(**config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("layers,config,match", [
    ((1, 1, 1), {}, "model has 3 stage scope"),  # not whole chunks per stage
    ((1, 1, 1, 1), {"num_micro_batch": 3}, "multiple of the 2 pipeline stages, got 3; use 2 or 4"),
    ((1, 1, 1, 1), {"zero": 3}, "zero = 3 gathers parameters around whole-stage calls"),
])
def test_interleaved_plans_refuse_what_they_cannot_run(layers, config, match):
    cfg = wh.Config(schedule="Interleaved1F1B", virtual_stages=2, **{"num_micro_batch": 4, **config})
    with pytest.raises((wh.PlanError, wh.ScheduleError), match=match) as info:
        wh.plan_model(TinyLM(stage_layers=layers), 2, cfg)
    assert "\n" not in str(info.value)


def _zb_against_1f1b(rank, world, spec):
    """The same job under 1F1B and under ZB-H1: per schedule the step losses and this rank's parameters after
    3 SGD steps."""
    from tests.models import PipeWithSplit

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 16, (8, 5), generator=g)
    batches = [(x, torch.roll(x, 1, dims=1))] * 3 if spec["model"] == "split" else lm_batches(3, 8)
    out = {}
    for schedule in ("1F1B", "ZB-H1"):
        ctx = wh.init(wh.Config(num_micro_batch=2, schedule=schedule, seed=0, precision=spec["precision"]))
        torch.manual_seed(0)
        model = PipeWithSplit(tied=True) if spec["model"] == "split" else TinyLM(stage_layers=(1, 2), tied=True)
        engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
        losses = [engine.step(b)["loss"] for b in batches]
        out[schedule] = (losses, [p.detach().clone() for p in engine.module.parameters()])
    return out


@pytest.mark.parametrize("world,spec", [(4, {"model": "split", "precision": "fp32"}),
                                        (2, {"model": "lm", "precision": "bf16"}),
                                        (2, {"model": "lm", "precision": "fp16"})],
                         ids=["split-stage-fp32", "bf16", "fp16"])
def test_zero_bubble_equals_1f1b_with_split_stages_and_mixed_precision(world, spec):
    """ZB-H1's B/W split (weight gradients from the gradients B keeps: whale.parallel.weight_grad) trains as
    1F1B's whole backward: a split (tensor-parallel) MLP inside a pipeline stage with a tied head, and bf16 /
    fp16 (loss scaling) autocast."""
    tol = {"fp32": (1e-5, 1e-6), "bf16": (1e-3, 1e-4), "fp16": (1e-3, 1e-4)}[spec["precision"]]
    for r in run_ranks(_zb_against_1f1b, world, spec, timeout=180):
        (l1, p1), (lz, pz) = r["1F1B"], r["ZB-H1"]
        torch.testing.assert_close(torch.tensor(lz), torch.tensor(l1), rtol=tol[0], atol=tol[1])
        for a, b in zip(pz, p1, strict=True):
            torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
