"""The largest GPT that trains under a fixed per-rank memory budget: pure data parallelism vs Whale's best.

Four CPU ranks emulate four identical devices of ``budget`` bytes each (``emulate: true``; every rank's
measured peak is checked against it at each step's end and an over-budget rank stops every rank with
``EmulatedOutOfMemoryError``), on nodes with the host memory the spec declares. Models of the GPT family
(``examples/gpt/model.py``, depth ``n_layer`` growing at a fixed width: a deeper model's layers stay the size
of a fixed gather window) train 3 AdamW steps:

- ``data_parallel``: one TaskGraph (``GPT(stages=1)``) on 4 lanes, every memory technique forbidden;
- ``best``: each layout (data parallel x 4, 2 pipeline stages x 2 lanes, 4 stages) with the planner free
  to add activation checkpointing, ZeRO and offload until the plan fits (``whale.planner.memory``);
  the largest that trains under any layout counts.

A size "trains" when planning succeeds and 3 steps finish with no rank over budget. Sizes go up until one
fails (planning refuses it, or the emulated out-of-memory check stops it).
"""

from __future__ import annotations

import gc
import time

LAYOUTS = {"data_parallel": 1, "pp2_dp2": 2, "pp4": 4}


def _spec(budget: float, host_per_node: float | None):
    from whale.cluster import ClusterSpec

    node = {"devices": [{"name": "Budget-GPU", "fp32_flops": 15.7e12, "bf16_flops": 125e12,
                         "memory_bytes": budget, "mem_bandwidth": 9e11}] * 2}
    if host_per_node is not None:
        node["host_memory_bytes"] = host_per_node
    return ClusterSpec.from_dict({"emulate": True, "memory_scale": 1.0, "nodes": [node, dict(node)]})


def _try(ctx, spec, layers: int, stages: int, cfg: dict, forbid: tuple) -> dict:
    """Plan and train 3 steps of one GPT; returns what happened (never raises for a model that does not fit)."""
    import dataclasses

    import torch

    import whale as wh
    from examples.gpt.model import GPT, GPTConfig
    from whale.memory.monitor import EmulatedOutOfMemoryError
    from whale.planner.balance import InfeasiblePlanError

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=layers, n_head=4,
                          n_embd=cfg["embd"]), stages=stages)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    batch = (data[:, :-1], data[:, 1:])
    run_ctx = dataclasses.replace(ctx, cluster=spec, config=ctx.config.replace(cluster=spec, forbid=forbid))
    out = {"n_layer": layers, "params": params, "stages": stages}
    try:
        engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                ctx=run_ctx, sample_batch=batch)
    except InfeasiblePlanError as e:
        return {**out, "trains": False, "why": f"plan: {str(e)[:300]}"}
    plan = engine.plan
    out.update(zero=plan.zero, activation_checkpoint=bool(plan.activation_checkpoint),
               offload=getattr(plan, "offload", "none"), predicted_max=max(plan.predicted_memory or (0,)))
    try:
        t0 = time.perf_counter()
        for _ in range(3):
            engine.step(batch)
        rows, _ = wh.memory_table(engine)
        out.update(trains=True, seconds=time.perf_counter() - t0, measured_max=max(r["peak_bytes"] for r in rows))
    except EmulatedOutOfMemoryError as e:
        out.update(trains=False, why=f"emulated OOM: {str(e)[:300]}")
    del engine
    gc.collect()
    return out


def ladder_worker(rank: int, world: int, cfg: dict) -> dict:
    """Every mode's ladder of depths in one process group (all ranks agree on every outcome)."""
    import whale as wh
    from whale.config import FORBIDDEN

    ctx = wh.init(wh.Config(num_micro_batch=cfg["micro_batches"], seed=0))
    spec = _spec(cfg["budget"], cfg.get("host_per_node"))
    result: dict = {}
    modes = [("data_parallel", 1, FORBIDDEN)] + [(f"best_{name}", s, ()) for name, s in LAYOUTS.items()]
    for mode, stages, forbid in modes:
        tries = []
        for layers in [n for n in cfg["depths"] if n >= stages]:
            tries.append(_try(ctx, spec, layers, stages, cfg, forbid))
            if not tries[-1]["trains"]:
                break
        result[mode] = tries
    return result


def summarize(result: dict) -> dict:
    """Largest trained parameter count per mode, the best over layouts, and the ratio to data parallelism."""
    largest = {mode: max((t["params"] for t in tries if t["trains"]), default=0) for mode, tries in result.items()}
    best_mode = max((m for m in largest if m.startswith("best_")), key=lambda m: largest[m])
    dp = largest["data_parallel"]
    return {"largest_params": largest, "best_layout": best_mode,
            "largest_params_ratio_vs_dp": largest[best_mode] / dp if dp else None}
