"""Offload of the optimizer state (and parameters) to host memory with the optimizer step on the host (issue 12,
item 4; :mod:`whale.runtime.offload`), each distributed case against a one-process ``deepcopy`` reference:
data parallel at world 2 (also ``"optimizer+params"``), ZeRO-2 with uneven slices at world 2, ZeRO-1 with uneven
slices in a 2 x 2 pipeline (a tied embedding/head across stages); AdamW with two param groups and an LR
scheduler, a frozen parameter, gradient clipping. The device holds no optimizer state, the host holds what is
expected (masters, gradients, Adam's moments of this rank's slice); an emulated node short of host memory stops
every rank with a host out-of-memory error. Plus: Config / Plan / cluster spec fields and the memory table.

Tolerance as in test_zero (fp32, rtol 1e-5, atol 1e-6). Only the CPU path runs here: the CUDA branches (pinned
host memory, non-blocking copies) need a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM
from tests.test_zero import ATOL, CLIP, RTOL, _batches, _reference, zero_engine
from whale.cluster import ClusterError, ClusterSpec
from whale.config import ConfigError
from whale.memory.host import EmulatedHostOutOfMemoryError, host_memory_capacity
from whale.memory.monitor import format_memory_table
from whale.memory.tracker import StorageTracker
from whale.parallel.zero import state_bytes
from whale.plan.plan import Plan, PlanError, TaskGraph
from whale.runtime.context import Context
from whale.runtime.parallelize import check_plan_fits

STEPS = 3


# --- fields: Config, Plan, cluster spec; the tracker's host categories; the table -----------------------------
def test_config_and_plan_carry_offload():
    assert wh.Config().offload == "none" and wh.Config(offload="optimizer", zero=2).offload == "optimizer"
    for bad in ("cpu", True, None, "params"):
        with pytest.raises(ConfigError, match="offload"):
            wh.Config(offload=bad)
    for zero in (1, 2):
        with pytest.raises(ConfigError, match="zero=3"):
            wh.Config(offload="optimizer+params", zero=zero)
    assert wh.Config(offload="optimizer+params", zero=3).zero == 3  # the shards stay on the host
    assert Plan(2, (TaskGraph(0, "replicate", 2, num_params=10),), 1, zero=3, offload="optimizer+params").zero == 3
    tg = TaskGraph(0, "replicate", 2, num_params=10)
    plan = Plan(2, (tg,), 1, offload="optimizer+params")
    assert Plan.from_json(plan.to_json()) == plan and "offload optimizer+params to host memory" in str(plan)
    with pytest.raises(PlanError, match="offload"):
        Plan(2, (tg,), 1, offload="disk")
    with pytest.raises(PlanError, match="offload"):
        Plan(2, (tg,), 1, zero=1, offload="optimizer+params")
    model = TinyLM()
    made = wh.plan_model(model, 2, wh.Config(offload="optimizer"))
    assert made.offload == "optimizer"
    with pytest.raises(PlanError, match="offload 'optimizer' but this job has 'none'"):  # the plan is the contract
        check_plan_fits(made, Context(wh.Config(), 0, 2, torch.device("cpu")))


def test_predicted_device_memory_leaves_out_the_offloaded_optimizer_state():
    model, sample = TinyLM(), _batches(1)[0]
    none, host = (wh.plan_model(model, 2, wh.Config(offload=o, cluster="examples/clusters/v100_p100_2.yaml"),
                                sample_batch=sample).predicted_memory for o in ("none", "optimizer"))
    adam = 8 * sum(p.numel() for p in model.parameters())  # the profile's 8 bytes of state per element
    assert [a - b for a, b in zip(none, host, strict=True)] == [adam, adam]


def test_cluster_spec_host_memory_round_trips_and_defaults(tmp_path):
    data = {"emulate": True, "memory_scale": 0.5, "nodes": [
        {"devices": ["V100-32GB"] * 8},  # a DGX-1: 8 x 64 GB = 512 GB by default
        {"devices": ["P100-16GB", "T4"], "host_memory_bytes": "1.0e11"},
        {"devices": [{"name": "MyGPU", "fp32_flops": 5e12, "bf16_flops": 2e13, "memory_bytes": 8e9,
                      "mem_bandwidth": 3e11}]}]}
    spec = ClusterSpec.from_dict(data)
    (tmp_path / "c.yaml").write_text(spec.to_yaml())
    again = ClusterSpec.from_yaml(tmp_path / "c.yaml")
    assert again == spec and again.nodes[1].host_memory_bytes == 1e11 and again.nodes[0].host_memory_bytes is None
    assert "host_memory_bytes" not in spec.to_dict()["nodes"][0]  # a default stays a default
    assert host_memory_capacity(spec, 0) == 512e9 * 0.5 / 8  # shared evenly, x memory_scale under emulation
    assert host_memory_capacity(spec, 9) == 1e11 * 0.5 / 2
    assert host_memory_capacity(spec, 10) == 4 * 8e9 * 0.5  # a custom device: 4 x its memory
    for path in ("examples/clusters/v100_p100.yaml", "examples/clusters/v100_p100_2.yaml"):
        ClusterSpec.from_yaml(path)  # older files load unchanged
    with pytest.raises(ClusterError, match="host_memory_bytes"):
        ClusterSpec.from_dict({"nodes": [{"devices": ["T4"], "host_memory_bytes": -1}]})


def test_tracker_counts_host_categories_apart_from_the_device():
    tr = StorageTracker()
    tr.optimizer_category = "host_optimizer_state"
    w, h = torch.zeros(256), torch.zeros(512)
    tr.label(w, "parameters")
    tr.label(h, "host_parameters")
    with tr:
        tr.in_optimizer = True
        m = torch.zeros(100)  # made in a host optimizer step
        tr.in_optimizer = False
    assert tr.total == 1024 and tr.peak == 1024 and tr.at_peak["parameters"] == 1024
    assert tr.host_total == 2048 + 400 == tr.host_peak and tr.host_at_peak["host_optimizer_state"] == 400
    assert "host_parameters" not in tr.at_peak and "parameters" not in tr.host_at_peak
    del m
    assert tr.host_total == 2048
    row = {"rank": 0, "stage": 0, "lane": 0, "device": "V100-32GB", "steps": 1, "peak_bytes": 2**20,
           "at_peak": {"parameters": 2**20}, "category_peaks": {}, "capacity_bytes": None, "predicted_bytes": None,
           "host_peak_bytes": 3 * 2**20, "host_at_peak": {"host_optimizer_state": 2 * 2**20},
           "host_capacity_bytes": 2**30}
    table = format_memory_table([row])
    assert "host peak MiB" in table and "host optimizer_state MiB" in table and "1024.00" in table
    err = EmulatedHostOutOfMemoryError([(1, 0, 5 * 2**20, 2**22)])
    assert "rank 1 (node 0) needed 5.0 MiB of host memory" in str(err) and "4.0 MiB" in str(err)


# --- equivalence and host / device bytes -----------------------------------------------------------------------
def _make(world, spec, offload):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=spec["zero"], max_grad_norm=CLIP, offload=offload,
                            track_memory=True, cluster=spec.get("cluster")))
    return zero_engine(ctx, world, spec)


def _train(engine, opt):
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    metrics = []
    for batch in _batches(STEPS):
        metrics.append(engine.step(batch))
        sched.step()
    return metrics


def _equivalence(rank, world, spec, offload):
    engine, ref, opt = _make(world, spec, offload)
    metrics = _train(engine, opt)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics]), torch.tensor(_reference(ref, STEPS)),
                               rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    with engine.zero.whole() if spec["zero"] == 3 else contextlib.nullcontext():  # ZeRO-3: gather every unit
        for name, p in engine.module.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
    updated = [h for _, h in engine.offload.pairs]  # what this rank's host optimizer steps (its ZeRO slice)
    out = {"stage": engine.stage, "lane": engine.lane, "lrs": [g["lr"] for g in opt.param_groups],
           "device_state": max(m["memory_category_peaks"]["optimizer_state"] for m in metrics),
           "device_peak": metrics[-1]["peak_memory_bytes"], "host": metrics[-1]["host_memory"],
           "elements": sum(h.numel() for h in updated),
           "trainable": sum(h.numel() for h in updated if h.requires_grad), "state": state_bytes(opt),
           "all_host": {id(q) for g in opt.param_groups for q in g["params"]} == {id(h) for h in updated},
           "table": wh.memory_table(engine)[1]}
    if spec["zero"] == 3:  # the shards count as (host) parameters and gradients, whatever touched them first
        tr = engine.memory.tracker
        out["shard_categories"] = sorted({tr.category(t) for u in engine.zero.units for t in (u.shard, u.shard_grad)})
    if offload == "optimizer+params" and spec["zero"] == 3:  # the shards are on the host and are the masters
        host = {t.untyped_storage().data_ptr() for t, _ in engine.offload.on_host}
        out["params_on_host"] = all(h.untyped_storage().data_ptr() in host for _, h in engine.offload.pairs) and \
            all(p.numel() == 0 for p in engine.module.parameters()) and not engine.offload.grads
        out["device_parameters"] = max(m["memory_category_peaks"]["parameters"] for m in metrics)
        out["largest_unit"] = 4 * max(u.flat.numel() for u in engine.zero.units)
    elif offload == "optimizer+params":  # between steps the module's parameters are the host tensors
        host = {h.untyped_storage().data_ptr() for _, h, _ in engine.offload.resident}
        out["params_on_host"] = all(p.untyped_storage().data_ptr() in host for p in engine.module.parameters())
    if spec["zero"] == 0 and offload == "optimizer":  # the same job without offload: the device holds Adam's moments
        plain, _, plain_opt = _make(world, spec, "none")
        out["plain_peak"] = _train(plain, plain_opt)[-1]["peak_memory_bytes"]
    return out


CASES = [
    (2, {"zero": 0, "layers": (2,)}, "optimizer"),
    (2, {"zero": 0, "layers": (2,)}, "optimizer+params"),
    (2, {"zero": 2, "layers": (2,), "weights": ((3.0, 1.0),)}, "optimizer"),
    (4, {"zero": 1, "layers": (1, 1), "weights": ((1.0, 3.0), (2.0, 1.0))}, "optimizer"),
    (2, {"zero": 3, "layers": (2,), "weights": ((3.0, 1.0),)}, "optimizer"),
    (4, {"zero": 3, "layers": (1, 1), "weights": ((1.0, 3.0), (2.0, 1.0))}, "optimizer"),
    (2, {"zero": 3, "layers": (2,), "weights": ((3.0, 1.0),)}, "optimizer+params"),
]


IDS = ["dp2", "dp2-params", "dp2-zero2-uneven", "pp2xdp2-zero1", "dp2-zero3-uneven", "pp2xdp2-zero3",
       "dp2-zero3-params"]


@pytest.mark.parametrize("world,spec,offload", CASES, ids=IDS)
def test_offload_matches_one_process_with_the_optimizer_state_on_the_host(world, spec, offload):
    results = run_ranks(_equivalence, world, spec, offload, timeout=180)
    for r in results:
        assert r["lrs"] == pytest.approx([1e-3 * 0.7 ** STEPS, 2e-3 * 0.7 ** STEPS])  # the scheduler drove them
        assert r["device_state"] == 0 and r["all_host"], r  # the user's optimizer steps host masters, not the device
        host = r["host"]
        grads = 4 * (r["elements"] if "device_parameters" in r else r["trainable"])  # ZeRO-3: the whole shard's
        assert host["host_parameters"] >= 4 * r["elements"] and host["host_gradients"] == grads
        assert r["state"] == 8 * r["trainable"]  # AdamW's two fp32 moments of what this rank steps, on the host
        assert host["host_optimizer_state"] >= r["state"]  # at the host peak: + step counters and temporaries
        assert "host peak MiB" in r["table"]
        if offload == "optimizer":
            assert host["host_parameters"] == 4 * r["elements"]
        else:
            assert r["params_on_host"]
        if spec["zero"] == 3:
            assert r["shard_categories"] == (["host_gradients", "host_parameters"] if offload != "optimizer" else
                                             ["gradients", "parameters"]), r["shard_categories"]
        if "device_parameters" in r:  # ZeRO-3 + parameter offload: the device holds at most two gathered units
            assert r["device_parameters"] <= 2 * r["largest_unit"], r
    if "plain_peak" in results[0]:  # the device peak dropped by about Adam's moments
        drop = results[0]["plain_peak"] - results[0]["device_peak"]
        assert drop >= 0.9 * 8 * results[0]["trainable"], (drop, results[0])
    if spec["zero"]:  # each lane offloads only its slice: the slices' elements add up to the stage's once
        for stage in {r["stage"] for r in results}:
            lanes = sorted((r for r in results if r["stage"] == stage), key=lambda r: r["lane"])
            w = spec["weights"][stage]
            assert lanes[0]["trainable"] / lanes[1]["trainable"] == pytest.approx(w[0] / w[1], rel=0.15)


# --- checkpoints resume exactly (the host masters and state come back); evaluation sees the parameters ----------
def _resume(rank, world, spec, offload, path):
    engine, _, _ = _make(world, spec, offload)
    batches = _batches(4)
    for batch in batches[:2]:
        engine.step(batch)
    engine.save_checkpoint(path)
    after = [engine.step(b)["loss"] for b in batches[2:]] + [engine.eval_step(batches[0])["loss"]]
    fresh, _, _ = _make(world, spec, offload)
    fresh.load_checkpoint(path)
    again = [fresh.step(b)["loss"] for b in batches[2:]] + [fresh.eval_step(batches[0])["loss"]]
    return after, again


@pytest.mark.parametrize("spec,offload", [({"zero": 2, "layers": (2,), "weights": ((3.0, 1.0),)}, "optimizer"),
                                          ({"zero": 0, "layers": (2,)}, "optimizer+params"),
                                          ({"zero": 3, "layers": (2,), "weights": ((3.0, 1.0),)}, "optimizer+params")],
                         ids=["zero2", "params", "zero3-params"])
def test_offload_checkpoint_resumes_exactly(spec, offload, tmp_path):
    for after, again in run_ranks(_resume, 2, spec, offload, str(tmp_path), timeout=120):
        assert after == again


# --- the emulated host out-of-memory error ----------------------------------------------------------------------
def _host_oom(rank, world):
    spec = ClusterSpec.from_dict({"emulate": True, "nodes": [
        {"devices": ["V100-32GB", "V100-32GB"], "host_memory_bytes": 2.0e5}]})  # 100 kB of host memory a rank
    ctx = wh.init(wh.Config(seed=0, offload="optimizer", cluster=spec))
    torch.manual_seed(0)
    model = TinyLM(d=32)
    engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    try:
        engine.step(_batches(1)[0])
    except EmulatedHostOutOfMemoryError as exc:
        return {"error": str(exc), "over": exc.over}
    return {"error": None}


def test_emulated_host_out_of_memory_stops_every_rank_naming_rank_node_bytes_and_capacity():
    results = run_ranks(_host_oom, 2, timeout=120)
    assert all(r["error"] is not None for r in results) and results[0]["error"] == results[1]["error"]
    over = {r: (node, need, cap) for r, node, need, cap in results[0]["over"]}
    assert set(over) == {0, 1} and all(node == 0 and cap == 1e5 < need for node, need, cap in over.values())
    assert "rank 1 (node 0) needed" in results[0]["error"] and "of host memory" in results[0]["error"]
    assert "host_memory_bytes" in results[0]["error"]
