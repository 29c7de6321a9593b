"""Measured vs predicted memory per rank of the GPT example under each memory technique, and the tracker's cost.

Four ranks (2 pipeline stages x 2 data-parallel lanes, 1F1B) on the emulated V100/P100 cluster of
``make train`` run a few AdamW steps of ``examples/gpt/model.py`` once per configuration of :data:`CONFIGS`
(nothing, activation checkpointing of every block, ZeRO-1, ZeRO-2, ZeRO-3, optimizer offload, all
together). Every rank's peak is measured by the storage tracker (:mod:`whale.memory.tracker`, live storage by
category; host memory apart), never estimated; the planner's prediction for that rank
(``Plan.predicted_memory``, :mod:`whale.planner.memory`) stands beside it. Two more runs on plain CPU ranks (no
emulation) time the steps with the tracker off and on.
"""

from __future__ import annotations

import os
import statistics
import time

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "v100_p100.yaml")
_BASE = {"checkpoint": None, "cluster": CLUSTER, "track": None, "zero": 0, "offload": "none"}
CONFIGS = {"no_checkpointing": _BASE,
           "checkpointing_all_blocks": {**_BASE, "checkpoint": "all"},
           "zero1": {**_BASE, "zero": 1},
           "zero2": {**_BASE, "zero": 2},
           "zero3": {**_BASE, "zero": 3},
           "offload_optimizer": {**_BASE, "offload": "optimizer"},
           "checkpointing_zero1_offload": {**_BASE, "checkpoint": "all", "zero": 1, "offload": "optimizer"},
           "cpu_tracker_off": {**_BASE, "cluster": None, "track": False},
           "cpu_tracker_on": {**_BASE, "cluster": None, "track": True}}
MEASURED = [k for k in CONFIGS if not k.startswith("cpu_")]


def run_config(ctx, cfg: dict, extra: dict) -> dict:
    """Train a few steps of the GPT under ``extra`` (checkpointing, cluster, tracking) in this process group."""
    import dataclasses

    import torch

    import whale as wh
    from examples.gpt.model import GPT, GPTConfig
    from whale.frontend.planning import resolve_cluster

    config = ctx.config.replace(cluster=extra["cluster"], activation_checkpoint=extra["checkpoint"],
                                track_memory=extra["track"], zero=extra["zero"], offload=extra["offload"],
                                forbid=("activation_checkpoint", "zero", "zero3", "offload"))
    run_ctx = dataclasses.replace(ctx, config=config, cluster=resolve_cluster(extra["cluster"], ctx.world_size))
    torch.manual_seed(0)
    gpt = GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4,
                    n_embd=cfg["embd"], dropout=0.1)
    model = GPT(gpt, stages=2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(cfg["steps"])]
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                            ctx=run_ctx, sample_batch=batches[0])
    times = []
    for b in batches:
        t0 = time.perf_counter()
        engine.step(b)
        times.append(time.perf_counter() - t0)
    rows, table = wh.memory_table(engine)
    return {"rows": rows, "table": table, "step_s": statistics.median(times[1:]), "plan": str(engine.plan)}


def worker(rank, world, cfg):
    """Every configuration of :data:`CONFIGS`, one after another, in one process group."""
    import whale as wh

    ctx = wh.init(wh.Config(num_micro_batch=cfg["micro_batches"], seed=0))
    return {name: run_config(ctx, cfg, extra) for name, extra in CONFIGS.items()}


def dispatch_overhead(base: dict, repeats: int = 7) -> dict:
    """One process, one thread: best-of-``repeats`` seconds of a forward + backward of the GPT plain, under a
    do-nothing dispatch mode, and under the storage tracker."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from examples.gpt.model import GPT, GPTConfig
    from whale.memory.tracker import StorageTracker

    class Noop(TorchDispatchMode):
        """Runs every op as is."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=base["vocab"], block_size=base["seq"], n_layer=base["layers"], n_head=4,
                          n_embd=base["embd"]))
    x = torch.randint(0, base["vocab"], (base["batch"] // 4, base["seq"]))
    best = {}
    for name, mode in (("plain", None), ("noop_dispatch_mode", Noop()), ("tracker", StorageTracker())) * 2:
        for _ in range(repeats):
            t0 = time.perf_counter()
            with mode if mode is not None else torch.enable_grad():
                model(x).float().pow(2).mean().backward()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return {**{f"{k}_s": v for k, v in best.items()}, "noop_over_plain": best["noop_dispatch_mode"] / best["plain"],
            "tracker_over_plain": best["tracker"] / best["plain"]}


def rank_rows(rows: list[dict]) -> list[dict]:
    """The memory table's rows as the JSON reports them: measured peak, breakdown, capacity, prediction."""
    out = []
    for r in rows:
        pred, peak = r["predicted_bytes"], r["peak_bytes"]
        out.append({"rank": r["rank"], "stage": r["stage"], "lane": r["lane"], "device": r["device"],
                    "measured_peak_bytes": peak, "bytes_at_peak": r["at_peak"],
                    "activation_peak_bytes": r["category_peaks"].get("activations"),
                    "capacity_bytes": r["capacity_bytes"], "predicted_bytes": pred,
                    "host_peak_bytes": r.get("host_peak_bytes"),
                    "predicted_over_measured": pred / peak if pred and peak else None})
    return out


