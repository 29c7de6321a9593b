"""Memory under Whale itself (issue 12): activation checkpointing in a data-parallel x pipeline setup at world 4
(fx and torch.export captures) equals training without it (dropout on, same seed: identical masks on
recompute) and equals one process (dropout off); the activation bytes measured by the storage tracker drop
with it; a rank over its emulated device memory stops every rank with an emulated out-of-memory error."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import whale as wh
from examples.gpt.model import GPT, GPTConfig
from tests.distributed import run_ranks

RTOL, ATOL = 1e-5, 1e-6
VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 3


def model(dropout: float, stages: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32, dropout=dropout),
               stages=stages)


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.roll(-1, dims=1)
        labels[: BATCH // 2, : SEQ // 2] = -100  # rows with fewer valid tokens: token weighting matters
        yield ids, labels


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _train(ctx, net, checkpoint, sample):
    config = ctx.config.replace(activation_checkpoint=checkpoint)
    plan = wh.plan_model(net, ctx.world_size, config, sample_batch=sample)
    engine = wh.parallelize(net, wh.token_cross_entropy(), adamw, ctx=ctx, plan=plan)
    metrics = [engine.step(b) for b in batches(STEPS)]
    return {"losses": [m["loss"] for m in metrics], "state": engine.full_state_dict(), "plan": plan.to_json(),
            "act_peak": max(m["memory_category_peaks"]["activations"] for m in metrics),
            "table": wh.memory_table(engine)[1]}


def _with_and_without(rank, world, capture, dropout, without: bool = True):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, capture=capture, track_memory=True))
    sample = next(batches(1)) if capture == "export" else None
    off = _train(ctx, model(dropout), (), sample) if without else None
    on = _train(ctx, model(dropout), ("Block",), sample)
    ref = None
    if dropout == 0.0:  # one process on the whole batch, plain PyTorch
        net = model(0.0, stages=1)
        opt, ref = adamw(net.parameters()), []
        for ids, labels in batches(STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(net(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss.backward()
            opt.step()
            ref.append(float(loss.detach()))
        ref = {"losses": ref, "state": copy.deepcopy(net.state_dict())}
    return {"off": off, "on": on, "ref": ref}


def _compare(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=RTOL, atol=ATOL)
    for name, value in b["state"].items():
        torch.testing.assert_close(a["state"][name], value, rtol=RTOL, atol=ATOL, msg=name)


def _check_memory(results) -> None:
    for r in results:  # every rank measured fewer activation bytes with its blocks checkpointed
        assert r["on"]["act_peak"] < 0.8 * r["off"]["act_peak"], (r["on"]["act_peak"], r["off"]["act_peak"])
    assert "act peak MiB" in results[0]["on"]["table"]


def test_checkpointing_with_dropout_equals_no_checkpointing_dp_x_pp_fx():
    results = run_ranks(_with_and_without, 4, "fx", 0.1, timeout=240)
    plan = wh.Plan.from_json(results[0]["on"]["plan"])
    assert plan.activation_checkpoint == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert plan.num_stages == 2 and plan.num_replicas == 2
    _compare(results[0]["on"], results[0]["off"])
    _check_memory(results)


def test_checkpointing_equals_one_process_dp_x_pp_export():
    """With export capture, checkpointed training equals one process (without checkpointing, export capture
    equals one process in tests/test_hf_models.py)."""
    results = run_ranks(_with_and_without, 4, "export", 0.0, False, timeout=240)
    assert wh.Plan.from_json(results[0]["on"]["plan"]).capture == "export"
    _compare(results[0]["on"], results[0]["ref"])
    assert "act peak MiB" in results[0]["on"]["table"]


def _oom(rank, world):
    from whale.cluster import ClusterSpec
    from whale.memory.monitor import EmulatedOutOfMemoryError

    nodes = [{"devices": ["V100-32GB"]}, {"devices": ["P100-16GB"]}]
    roomy = ClusterSpec.from_dict({"emulate": True, "nodes": nodes})
    tight = ClusterSpec.from_dict({"emulate": True, "memory_scale": 1.5e-5, "nodes": nodes})  # 480 KB / 240 KB
    ctx = wh.init(wh.Config(seed=0, cluster=tight))
    net = model(0.0, stages=1)
    plan = wh.plan_model(net, world, wh.Config(seed=0, cluster=roomy), sample_batch=next(batches(1)))
    engine = wh.parallelize(net, wh.token_cross_entropy(), adamw, ctx=ctx, plan=plan)
    try:
        engine.step(next(batches(1)))
    except EmulatedOutOfMemoryError as exc:
        return {"error": str(exc), "over": exc.over, "predicted": list(plan.predicted_memory)}
    return {"error": None}


def test_emulated_out_of_memory_stops_every_rank_naming_rank_device_bytes_and_prediction():
    results = run_ranks(_oom, 2, timeout=120)
    assert all(r["error"] is not None for r in results)
    assert results[0]["error"] == results[1]["error"]  # the same error everywhere
    over = {r: (dev, need, cap, pred) for r, dev, need, cap, pred in results[0]["over"]}
    assert over[0][0] == "V100-32GB" and over[0][2] == 32e9 * 1.5e-5
    assert over[1][0] == "P100-16GB" and over[1][2] == 16e9 * 1.5e-5
    assert all(need > cap and pred == results[0]["predicted"][r] for r, (_, need, cap, pred) in over.items())
    assert "rank 1 (P100-16GB) needed" in results[0]["error"] and "planner predicted" in results[0]["error"]
