"""The largest GPT that trains under a fixed per-rank memory budget: pure data parallelism vs Whale's best, each
side's boundary found by bisection (on depth, then width) and checked by the MEASURED out-of-memory check.

Four CPU ranks emulate four identical devices of ``budget`` bytes each (``emulate: true``; every rank's measured
peak is checked against it at each step's end and an over-budget rank stops every rank with
``EmulatedOutOfMemoryError``), on nodes with the host memory the spec declares. Models of the GPT family
(``examples/gpt/model.py``; ``n_layer`` and ``n_embd`` vary, 4 heads) train 3 AdamW steps.

A size *trains* when 3 real steps finish with no rank over the budget by the measured check. The planner's
refusal alone never decides: when the plan at the real budget is refused, the size is planned again on a spec
with room (device and host memory x :data:`ROOMY`) with the side's strongest memory settings forced
(:func:`_forced`), and the engine's memory monitor is given back the real budget (device and host) before the
steps, so the size fails only if its measured peak does not fit. Sides:

- ``data_parallel``: one TaskGraph (``GPT(stages=1)``) on 4 lanes, every memory technique forbidden;
- ``best``: the planner free to add activation checkpointing, ZeRO (1-3) and offload (of the optimizer, and of
  the parameters: with ZeRO-3 the lanes' parameter and gradient shards stay on the host and one unit is gathered
  on the device at a time), on the layout (data parallel x 4, 2 pipeline stages x 2 lanes, 4 stages) whose
  planner-only depth boundary is largest (each layout's planner boundary is found first, by planning alone, and
  reported; ``--best-layouts`` narrows the layouts).

Search (:func:`boundary`): from a start known or guessed, step up (1, 2, 4, ... layers) until a size fails,
or down until one trains, then bisect between the largest that trains and the smallest that fails; then the
same on width (multiples of 4) at that depth. Reported per side: the largest trained size, its measured peak,
and the first sizes above it that failed (one layer more; 4 more width), each with how it failed.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable

LAYOUTS = {"data_parallel": 1, "pp2_dp2": 2, "pp4": 4}
ROOMY = 100.0
"""Memory factor of the spec a refused size is planned on (the real budget is then enforced by measurement)."""
WIDTH_STEP = 4


def _spec(budget: float, host_per_node: float | None):
    from whale.cluster import ClusterSpec

    node = {"devices": [{"name": "Budget-GPU", "fp32_flops": 15.7e12, "bf16_flops": 125e12,
                         "memory_bytes": budget, "mem_bandwidth": 9e11}] * 2}
    if host_per_node is not None:
        node["host_memory_bytes"] = host_per_node
    return ClusterSpec.from_dict({"emulate": True, "memory_scale": 1.0, "nodes": [node, dict(node)]})


def _forced(side: str, stages: int) -> list[dict]:
    """The memory settings a refused size is tried with on the roomy spec: none for data parallelism; for the
    best side the strongest combinations for the layout's lanes (ZeRO-3 + parameter offload + checkpointing;
    ZeRO-3 + optimizer offload + checkpointing; ZeRO-3 + checkpointing; ZeRO-2 + offload + checkpointing; with
    one lane, offload + checkpointing), tried in turn until one trains."""
    if side == "data_parallel":
        return [{}]
    if 4 // stages == 1:
        return [{"offload": "optimizer", "activation_checkpoint": "all"}]
    return [{"zero": 3, "offload": "optimizer+params", "activation_checkpoint": "all"},
            {"zero": 3, "offload": "optimizer", "activation_checkpoint": "all"},
            {"zero": 3, "activation_checkpoint": "all"},
            {"zero": 2, "offload": "optimizer", "activation_checkpoint": "all"}]


def _build(ctx, spec, cfg: dict, layers: int, embd: int, stages: int, settings: dict):
    """(engine, params, batch) for one GPT planned on ``spec`` with Config ``settings``; raises what planning
    raises."""
    import torch

    import whale as wh
    from examples.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=layers, n_head=4, n_embd=embd),
                stages=stages)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    batch = (data[:, :-1], data[:, 1:])
    run_ctx = dataclasses.replace(ctx, cluster=spec, config=ctx.config.replace(cluster=spec, **settings))
    engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                            ctx=run_ctx, sample_batch=batch)
    return engine, params, batch


def _steps(engine, batch, cfg: dict) -> dict:
    """Train 3 steps under the measured check at the real budget; what happened."""
    import whale as wh
    from whale.memory.host import EmulatedHostOutOfMemoryError
    from whale.memory.monitor import EmulatedOutOfMemoryError

    engine.memory.capacity = cfg["budget"]  # the real budget, whatever spec the plan was made on
    if engine.memory.host_capacity is not None and cfg.get("host_per_node"):
        engine.memory.host_capacity = cfg["host_per_node"] / 2
    t0 = time.perf_counter()
    try:
        for _ in range(3):
            engine.step(batch)
    except (EmulatedOutOfMemoryError, EmulatedHostOutOfMemoryError) as e:
        return {"trains": False, "how": f"measured: {str(e)[:240]}"}
    rows, _ = wh.memory_table(engine)
    return {"trains": True, "seconds": time.perf_counter() - t0, "measured_max": max(r["peak_bytes"] for r in rows)}


def _plan_info(engine) -> dict:
    plan = engine.plan
    return {"zero": plan.zero, "activation_checkpoint": bool(plan.activation_checkpoint),
            "offload": getattr(plan, "offload", "none"), "predicted_max": max(plan.predicted_memory or (0,))}


def trial(ctx, cfg: dict, side: str, stages: int, layers: int, embd: int) -> dict:
    """One size on one side, decided by measurement (see the module docstring). Never raises for a size that
    does not fit."""
    PLAN_ERRORS = _plan_errors()
    real, roomy = _spec(cfg["budget"], cfg.get("host_per_node")), _roomy(cfg)
    forbid = {"forbid": _forbidden()} if side == "data_parallel" else {"forbid": ()}
    out = {"n_layer": layers, "n_embd": embd, "stages": stages}
    try:
        engine, out["params"], batch = _build(ctx, real, cfg, layers, embd, stages, forbid)
        out.update(_plan_info(engine), planned_at_budget=True)
        out.update(_steps(engine, batch, cfg))
        return _done(out, engine)
    except PLAN_ERRORS as e:
        out["planner"] = f"refused: {str(e)[:200]}"
    tries = []
    for settings in _forced(side, stages):
        try:
            engine, out["params"], batch = _build(ctx, roomy, cfg, layers, embd, stages, {**forbid, **settings})
        except PLAN_ERRORS as e:
            tries.append({"settings": settings, "how": f"plan on the roomy spec: {str(e)[:160]}"})
            continue
        got = {"settings": settings, **_plan_info(engine), **_steps(engine, batch, cfg)}
        _done({}, engine)
        tries.append(got)
        if got["trains"]:
            break
    out["forced"] = tries
    ok = [t for t in tries if t.get("trains")]
    out.update(ok[0] if ok else {"trains": False, "how": "; ".join(t["how"] for t in tries)})
    return out


def _done(out: dict, engine) -> dict:
    del engine
    gc.collect()
    return out


def _roomy(cfg: dict):
    host = cfg.get("host_per_node")
    return _spec(cfg["budget"] * ROOMY, host * ROOMY if host else None)


def _plan_errors() -> tuple:
    """What planning raises for a size or setting that it refuses."""
    from whale.config import ConfigError
    from whale.plan.plan import PlanError

    return (PlanError, ConfigError)


def _forbidden() -> tuple:
    from whale.config import FORBIDDEN

    return FORBIDDEN


def boundary(ok: Callable[[int], bool], start: int, least: int = 1) -> tuple[int | None, int]:
    """(largest n with ``ok(n)``, smallest n above it that is not ok) for a monotone ``ok`` on integers >=
    ``least``: from ``start``, steps of 1, 2, 4, ... up until one fails (or down until one is ok), then
    bisection. ``(None, least)`` when even ``least`` fails.

    Raises:
        ValueError: ``start < least``.
    """
    if start < least:
        raise ValueError(f"boundary: start={start} < least={least}")
    if ok(start):
        good, step = start, 1
        while ok(good + step):
            good, step = good + step, step * 2
        bad = good + step
    else:
        bad, step = start, 1
        while True:
            cand = max(least, bad - step)
            if ok(cand):
                good = cand
                break
            if cand == least:
                return None, least
            bad, step = cand, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good, bad


def _planner_depth(ctx, cfg: dict, stages: int) -> int | None:
    """The largest depth the planner alone accepts on the real budget for the best side on this layout."""
    PLAN_ERRORS = _plan_errors()
    real = _spec(cfg["budget"], cfg.get("host_per_node"))

    def ok(n: int) -> bool:
        try:
            _done({}, _build(ctx, real, cfg, n, cfg["embd"], stages, {"forbid": ()})[0])
            return True
        except PLAN_ERRORS:
            return False

    depth = boundary(ok, max(stages, 8), least=stages)[0]
    if ctx.rank == 0:
        print(f"planner alone, {stages} stage(s): largest depth it accepts {depth}", flush=True)
    return depth


def side_search(ctx, cfg: dict, side: str, stages: int, start: int) -> dict:
    """Bisect depth (at ``cfg["embd"]``), then width (at that depth), by :func:`trial`; every trial kept."""
    tried: dict[tuple[int, int], dict] = {}

    def run(layers: int, embd: int) -> bool:
        if (layers, embd) not in tried:
            tried[layers, embd] = trial(ctx, cfg, side, stages, layers, embd)
            t = tried[layers, embd]
            if ctx.rank == 0:
                print(f"{side:>14} pp{stages} n_layer={layers:>3} n_embd={embd:>3} "
                      f"params={t.get('params', 0) / 1e6:6.2f}M: "
                      f"{'trains' if t['trains'] else 'fails: ' + t['how'][:100]}", flush=True)
        return tried[layers, embd]["trains"]

    depth, depth_fail = boundary(lambda n: run(n, cfg["embd"]), start, least=stages)
    if depth is None:
        return {"side": side, "stages": stages, "largest": None, "tries": list(tried.values())}
    w, w_fail = boundary(lambda k: run(depth, k * WIDTH_STEP), cfg["embd"] // WIDTH_STEP, least=1)
    best = tried[depth, w * WIDTH_STEP]
    return {"side": side, "stages": stages, "largest": best,
            "first_failed_deeper": tried[depth_fail, cfg["embd"]],
            "first_failed_wider": tried[depth, w_fail * WIDTH_STEP], "tries": list(tried.values())}


def bisect_worker(rank: int, world: int, cfg: dict) -> dict:
    """Both sides in one process group (every outcome is agreed by all ranks: planning is deterministic and the
    measured check all-reduces the peaks)."""
    import whale as wh

    ctx = wh.init(wh.Config(num_micro_batch=cfg["micro_batches"], seed=0))
    layouts = cfg.get("best_layouts") or list(LAYOUTS)
    if len(layouts) > 1 or not cfg.get("best_start"):
        planner = {name: _planner_depth(ctx, cfg, LAYOUTS[name]) for name in layouts}
    else:  # one layout and a start given: no planner-only scan (each plan of a deep model costs minutes here)
        planner = {layouts[0]: None}
    best_layout = max(planner, key=lambda n: planner[n] or 0)
    dp = side_search(ctx, cfg, "data_parallel", 1, cfg.get("dp_start", 8))
    start = cfg.get("best_start") or planner[best_layout] or LAYOUTS[best_layout]
    best = side_search(ctx, cfg, "best", LAYOUTS[best_layout], start)
    return {"planner_depth_by_layout": planner, "best_layout": best_layout, "data_parallel": dp, "best": best}


def summarize(result: dict) -> dict:
    """The headline keys: each side's largest trained parameter count and the ratio."""
    def size(s):
        return s["largest"]["params"] if s.get("largest") else 0

    def failed(s, key):
        t = s.get(key) or {}
        return {k: t.get(k) for k in ("n_layer", "n_embd", "params", "planner", "how")}

    dp, best = size(result["data_parallel"]), size(result["best"])
    out = {"largest_dp_params": dp, "largest_best_params": best,
           "largest_params_ratio_vs_dp": best / dp if dp else None, "best_layout": result["best_layout"]}
    for side in ("data_parallel", "best"):
        s = result[side]
        big = s.get("largest") or {}
        out[f"{side}_largest"] = {k: big.get(k) for k in ("n_layer", "n_embd", "params", "measured_max", "zero",
                                                         "activation_checkpoint", "offload", "settings")}
        out[f"{side}_first_failed"] = {"deeper": failed(s, "first_failed_deeper"),
                                       "wider": failed(s, "first_failed_wider")}
    return out
