"""Data-parallel case of :mod:`benchmarks.heterogeneous` (EMULATED): equal vs hardware-aware shares vs the
ideal, the sum of each device's standalone throughput.

Every rank holds two jobs' engines of the same model: equal shares (``hardware_aware=False``) and
hardware-aware shares (``aware``: the planner's Algorithm 1 from the declared FLOPS). Each step has
``cfg["micro"]`` micro-batches (gradient accumulation: one gradient all-reduce per step, as large-batch
training runs). A world-of-one engine (a 1-device emulated spec of the rank's type, its own
:class:`whale.runtime.context.Context` of world size 1, the same micro-batches: no communication) has the
emulation slowdown the rank has in the job (a 1-device spec alone would give 0: emulation is relative to the
fastest device of the spec). Round by round, after the jobs, the world-of-one engines measure each device's
standalone throughput:

* ``job_rows`` (the ideal): on the rows the device trains in the hardware-aware job, all devices at once for a
  fixed window (they share this host's cores, caches and memory bandwidth as in the job; a real GPU's speed
  does not depend on its neighbours). Its sum is what the devices would do working alone on their shares with
  no synchronization or communication; the job loses to it only by imbalance, gradient sync and stragglers.
* ``equal_rows``: the same on ``batch / world`` rows (a per-device batch fixed for every plan). On this CPU the
  time per row moves by a few % with the rows (caches), which this ideal charges to the balancer.
* ``idle_host``: ``batch / world`` rows, one rank at a time while the others wait: each device alone on the
  host, faster than any device of the job.
* ``idle_host_job_rows``: the job's rows, one rank at a time: the control that separates the effect of the
  rows (compare with ``idle_host``) from that of devices computing side by side (compare with ``job_rows``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._hetero_common import emulation_setup, gather, load_spec, rows_per_rank, timed_steps
from benchmarks._hetero_model import TokenMLP, _sgd, loss_fn, make_batch
from benchmarks._paired import summary

MODES = ("job_rows", "equal_rows", "idle_host", "idle_host_job_rows")
"""Standalone measurements, see the module docstring."""


def ideal_dp_speedup(speeds: list[float]) -> float:
    """sum(X_i) / (N x min X_i): throughput of speed-proportional shares over equal shares."""
    return sum(speeds) / (len(speeds) * min(speeds))


def dp_compare(rank: int, world: int, cfg: dict) -> dict | None:
    """Equal vs hardware-aware shares on ``cfg["spec"]`` and every rank's standalone throughput (:data:`MODES`),
    all in one launch, round by round. Rank 0 returns the result."""
    emulation_setup(cfg, rank)
    spec = load_spec(cfg["spec"])
    x, y = make_batch(cfg["batch"], cfg["tokens"], cfg["dim"])
    engines = _dp_engines(spec, cfg, (x, y))
    # world-of-one engines: one for the all-at-once modes, one for the idle-host modes (each emulated device's
    # wait follows the median of its own recent segments, so the two kinds of run must not share a history)
    alone = {kind: _standalone_engine(spec, cfg, rank, engines["aware"].slowdown) for kind in ("together", "idle")}
    job, equal = rows_per_rank(engines["aware"].plan, cfg["batch"])[rank], cfg["batch"] // world
    rows = {"job_rows": job, "equal_rows": equal, "idle_host": equal, "idle_host_job_rows": job}
    times, alone_times = _dp_rounds(engines, alone, (x, y), rows, rank, cfg)
    info = gather({"slowdown": engines["aware"].slowdown, "rows": rows, **alone_times})
    if rank != 0:
        return None
    devices = [d.name for d in spec.devices()]
    out = {"spec": cfg["spec"], "world": world, "batch": cfg["batch"], "devices": devices,
           "emulation_cores": cfg.get("emulation_cores"), "slowdown": [d["slowdown"] for d in info],
           "speeds_tflops": [d.fp32_flops / 1e12 for d in spec.devices()], "standalone": [],
           "window_s": info[0]["window_s"]}
    for r, d in enumerate(info):
        row = {"rank": r, "device": devices[r], "slowdown": d["slowdown"]}
        for mode in MODES:
            med = statistics.median(d[mode])
            row[mode] = {"rows": d["rows"][mode], "step_s": med, "throughput": d["rows"][mode] / med,
                         "times": d[mode]}
        out["standalone"].append(row)
    for name, engine in engines.items():
        med = statistics.median(times[name])
        out[name] = {"step_s": med, "throughput": cfg["batch"] / med,
                     "rows": rows_per_rank(engine.plan, cfg["batch"]), "times": times[name], "plan": str(engine.plan)}
    return out


def _dp_engines(spec, cfg: dict, batch) -> dict:
    """The equal-shares and the hardware-aware engine of the same model on this rank (``cfg["micro"]``:
    micro-batches per step, i.e. gradient accumulation, default 1; ``cfg["bucket_cap_mb"]``: gradient bucket
    size, Whale's default when absent)."""
    import whale as wh

    engines = {}
    extra = {"bucket_cap_mb": cfg["bucket_cap_mb"]} if cfg.get("bucket_cap_mb") else {}
    for name, aware in (("equal", False), ("aware", True)):
        ctx = wh.init(wh.Config(cluster=spec, hardware_aware=aware, num_micro_batch=cfg.get("micro", 1), seed=0,
                                **extra))
        engines[name] = wh.parallelize(TokenMLP(cfg["dim"], cfg["layers"]), loss_fn, _sgd, ctx=ctx,
                                       sample_batch=batch)
    engines["equal"].slowdown = engines["aware"].slowdown  # one emulated device per rank, one calibration
    return engines


def _standalone_engine(spec, cfg: dict, rank: int, slowdown: float | None):
    """A world-of-one engine on this rank's device type, slowed like the rank is in the multi-rank run, with
    the job's micro-batches per step (so its micro-batches have the rows this rank's have in the job)."""
    import whale as wh
    from whale.cluster import NodeSpec
    from whale.runtime.context import Context

    one = dataclasses.replace(spec, nodes=(NodeSpec((spec.devices()[rank],)),))
    ctx1 = Context(wh.Config(cluster=one, num_micro_batch=cfg.get("micro", 1), seed=0), 0, 1, torch.device("cpu"),
                   one)
    alone = wh.parallelize(TokenMLP(cfg["dim"], cfg["layers"]), loss_fn, _sgd, ctx=ctx1)
    alone.slowdown = slowdown
    return alone


def _own_steps(engine, batch, k: int) -> float:
    """Seconds per step of ``k`` steps of this rank's world-of-one ``engine`` (no collective inside)."""
    start = time.perf_counter()
    for _ in range(k):
        engine.step(batch)
    return (time.perf_counter() - start) / k


WINDOW_STEPS = 5
"""The all-at-once window is at least this many of the slowest rank's standalone steps (sized in the run)."""


def sized_window(engine, batches, window_s: float) -> float:
    """``max(window_s, WINDOW_STEPS x the slowest rank's seconds per standalone step)``: one step of this rank's
    world-of-one ``engine`` is timed on each of ``batches`` (all ranks at once), the slowest over ranks and
    batches is agreed with an all-reduce. A fixed window too short for a slow emulated device (a P100 at 4 ranks
    on a loaded host) fitted no step; the benchmark sizes its own window instead."""
    worst = 0.0
    for batch in batches:
        worst = max(worst, _own_steps(engine, batch, 1))
    t = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(window_s, WINDOW_STEPS * float(t))


def _steps_until(engine, batch, window_s: float) -> float:
    """Steps of this rank's world-of-one ``engine`` for ``window_s`` seconds from a deadline agreed by all
    ranks; seconds per step over the steps that ended before it (every rank runs until the same deadline, so
    the counted steps all ran under the full host load: no rank measures a tail with the others idle). When the
    host slows down so much that no step ends before the deadline, the one step that crossed it is counted
    (the window is sized again every round, :func:`_dp_rounds`, so this stays rare)."""
    start_wall = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(start_wall, 0)  # one deadline on the host clock for every rank
    start = end = time.perf_counter()
    deadline = start + float(start_wall) + window_s - time.time()
    done = 0
    while True:
        engine.step(batch)
        now = time.perf_counter()
        if now > deadline:
            if done == 0:
                end, done = now, 1
            break
        end, done = now, done + 1
    return (end - start) / done


def _resized(measured: dict, floor: float) -> float:
    """The next round's window: ``WINDOW_STEPS`` x the slowest rank's standalone seconds per step this round
    (all-reduced), at least ``floor``."""
    t = torch.tensor([max(measured[m] for m in ("job_rows", "equal_rows"))], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(floor, WINDOW_STEPS * float(t))


def _dp_rounds(engines: dict, alone: dict, batch, rows: dict, rank: int, cfg: dict):
    """Warm-up then measured rounds: ``k`` steps of every engine (alternating order), then the standalone
    measurements of :data:`MODES` (``alone["together"]`` all ranks at once for ``window_s``, then
    ``alone["idle"]`` one rank at a time for ``idle_k`` steps, default ``k``). Returns per-engine seconds per
    step and this rank's standalone seconds per step by mode."""
    part = {m: (batch[0][:rows[m]].contiguous(), batch[1][:rows[m]].contiguous()) for m in MODES}
    names, k = list(engines), cfg["k"]
    times: dict[str, list[float]] = {n: [] for n in names}
    alone_times: dict[str, list[float]] = {m: [] for m in MODES}
    window_s = sized_window(alone["together"], [part["job_rows"], part["equal_rows"]], cfg["window_s"])
    alone_times["window_s"] = window_s
    for i in range(cfg["warmup"] + cfg["rounds"]):
        measured = {}
        for name in names if i % 2 == 0 else names[::-1]:
            measured[name] = timed_steps(engines[name], batch, k)
        for mode in ("job_rows", "equal_rows"):
            measured[mode] = _steps_until(alone["together"], part[mode], window_s)
        window_s = _resized(measured, cfg["window_s"])
        for r in range(dist.get_world_size()):
            dist.barrier()
            if r == rank:
                for mode in ("idle_host", "idle_host_job_rows"):
                    measured[mode] = _own_steps(alone["idle"], part[mode], cfg.get("idle_k", k))
        dist.barrier()
        if i >= cfg["warmup"]:
            for key, t in measured.items():
                (times if key in times else alone_times)[key].append(t)
    return times, alone_times


def dp_summary(r: dict) -> None:
    """Add the ideal throughputs (one per standalone mode), ratios and speedups to one case's result."""
    from whale.cluster import CATALOG

    for mode in MODES:
        ideal = sum(s[mode]["throughput"] for s in r["standalone"])
        suffix = "" if mode == "job_rows" else f"_{mode}"
        r["ideal_throughput" + suffix] = ideal
        r["ratio_to_ideal" + suffix] = r["aware"]["throughput"] / ideal
    r["equal_ratio_to_ideal"] = r["equal"]["throughput"] / r["ideal_throughput"]
    r["ideal_speedup"] = ideal_dp_speedup([CATALOG[n].fp32_flops for n in r["devices"]])
    paired = summary(r["aware"]["times"], r["equal"]["times"], goal=0.9 * r["ideal_speedup"],
                     names=("aware", "equal"))  # rounds alternate equal/aware (ABBA): adjacent pairs
    r["speedup_over_equal_paired"] = paired
    r["speedup_over_equal"] = paired["median"]
    r["fraction_of_ideal_speedup"] = r["speedup_over_equal"] / r["ideal_speedup"]
    # emulation accuracy: measured standalone speed ratio of the fastest vs the slowest device type
    by_type: dict[str, list[float]] = {}
    for s in r["standalone"]:
        by_type.setdefault(s["device"], []).append(s["equal_rows"]["throughput"])
    fast = max(by_type, key=lambda n: CATALOG[n].fp32_flops)
    slow = min(by_type, key=lambda n: CATALOG[n].fp32_flops)
    r["speed_ratio_measured"] = statistics.mean(by_type[fast]) / statistics.mean(by_type[slow])
    r["speed_ratio_declared"] = CATALOG[fast].fp32_flops / CATALOG[slow].fp32_flops
