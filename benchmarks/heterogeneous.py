"""Hardware-aware load balancing on EMULATED mixed V100/P100 clusters (issue 4, item 7; DESIGN.md §5, §6, §9).

Everything here runs on CPU ranks that imitate declared GPUs (``emulate: true`` cluster specs): after each
forward/backward compute segment a rank waits so that it runs at its device's fp32 speed relative to the
fastest device of the spec, and when ranks outnumber cores every rank is slowed by a further ``world / cores``
(:func:`whale.runtime.emulation.emulation_slowdown`). Only ratios measured side by side mean anything; every
number printed or written is EMULATED, not a measurement of real GPUs.

Cases, each in one launch of gloo ranks (``spawn``, one thread per rank), steps interleaved round by round
(alternating order) so that machine noise hits the compared variants alike; medians over the measured rounds
after warm-up (a data-parallel round times ``k`` back-to-back steps between barriers, as training runs):

1. Data parallel on {V100, P100} (2 ranks, global batch 62) and {2 V100, 2 P100} (4 ranks, 124): equal
   shares (``hardware_aware=False``) vs hardware-aware shares (37:25 per V100:P100 pair, 15.7:10.6 almost
   exactly), and the ideal: the sum of each device's standalone throughput. Standalone throughput of a device
   type is measured in the same launch and rounds: the first rank of that type also holds a world-of-one engine
   (1-device emulated spec, a Context of world size 1: no communication) that trains the per-rank batch
   ``batch / world`` alone while every other rank waits at a barrier. Its emulation slowdown is set to the one
   the rank has in the multi-rank run (``engine.slowdown``, which includes the ``world / cores`` base factor):
   a 1-device spec alone would give 0, since emulation is relative to the fastest device of the spec. Ideal
   speedup of hardware-aware over equal shares: sum(X_i) / (N x min X_i) from the datasheet speeds (1.241).
   The printout also checks the emulation: the measured standalone speed ratio V100/P100 vs the declared 1.481.
2. Pipelines of 2 stages {V100, P100} and 4 stages {V100, V100, P100, P100} over L equal blocks: uniform
   (annotated) cuts vs hardware-aware cuts. From the per-layer profile (fake tensors) and the speeds:
   ``pp_ideal_speedup`` = slowest-stage time of the uniform cut / slowest-stage time of the best contiguous cut
   (brute force over all cuts, independent of the library's partitioner); ``pp_fluid_speedup`` uses a perfectly
   divisible cut (total work / sum of speeds) instead; ``pp_bound_speedup`` replays both cuts through a 1F1B
   event simulator (forward and backward per stage, the bubble included), the best a schedule of these cuts
   can show on real steps.
3. Memory-bound data parallel on {V100-32GB, P100-16GB}: ``memory_scale`` is set (from the profile) so that
   the whole cluster has only ~5 % more memory than the job needs; the P100's memory share (1/3) is below its
   FLOPS share (40 %), so FLOPS-proportional shares overflow it and the balancer (Algorithm 1) moves samples
   to the V100. Shows both share vectors, their memory need per device, and that the plan runs.

    python benchmarks/heterogeneous.py --out benchmarks/results/heterogeneous.json   # ~3 min on 2 cores
    python benchmarks/heterogeneous.py --quick --out /tmp/het.json                   # ~30 s, smoke test

Writes JSON (``--out``) and a PNG with the same stem next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from benchmarks._hetero_model import (  # noqa: E402
    TokenMLP,
    _sgd,
    layer_profile,
    loss_fn,
    make_batch,
    mem_analysis,
    memory_scale_for,
    pp_analysis,
)
from benchmarks._hetero_report import BANNER, plot, report  # noqa: E402
from benchmarks._launch import launch as shared_launch  # noqa: E402

CLUSTERS = os.path.join(HERE, "clusters")
FULL = {"dim": 64, "tokens": 256, "dp_layers": 4, "dp_batch": 62, "dp4_batch": 124, "dp_warmup": 2,
        "dp_rounds": 15, "dp_k": 3, "pp_layers": 20, "pp_micro": 16, "pp_micro_rows": 4, "pp_warmup": 1,
        "pp_rounds": 8, "mem_rounds": 4, "mem_slack": 0.05}
"""Full run: compute-heavy token MLP (132k parameters, ~1.7 GFLOP per sample per step)."""
QUICK = {"dim": 32, "tokens": 64, "dp_layers": 2, "dp_batch": 62, "dp4_batch": 124, "dp_warmup": 1,
         "dp_rounds": 3, "dp_k": 2, "pp_layers": 12, "pp_micro": 8, "pp_micro_rows": 2, "pp_warmup": 1,
         "pp_rounds": 2, "mem_rounds": 2, "mem_slack": 0.05}
"""Quick run: a smoke test of every case (numbers are dominated by per-step overhead)."""


# --- helpers -------------------------------------------------------------------------------------------------
def load_spec(name_or_path: str, **changes):
    """A cluster spec from ``benchmarks/clusters/<name>`` (or a path), with dataclass fields replaced."""
    from whale.cluster import ClusterSpec

    path = name_or_path if os.path.exists(name_or_path) else os.path.join(CLUSTERS, name_or_path)
    spec = ClusterSpec.from_yaml(path)
    return dataclasses.replace(spec, **changes) if changes else spec


def _timed_steps(engine, batch, k: int = 1) -> float:
    """Wall seconds per step of ``k`` back-to-back steps, between barriers (every rank has finished the
    previous work before and this work after)."""
    if dist.get_world_size() > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(k):
        engine.step(batch)
    if dist.get_world_size() > 1:
        dist.barrier()
    return (time.perf_counter() - start) / k


def _interleave(engines: dict, batch, warmup: int, rounds: int, k: int = 1) -> dict:
    """``k`` steps of every engine round by round (order reversed every other round); per engine the measured
    seconds per step of each round after ``warmup`` rounds."""
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            t = _timed_steps(engines[name], batch, k)
            if i >= warmup:
                times[name].append(t)
    return times


def _gather(obj) -> list:
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rows(plan, batch: int) -> list[int]:
    """Samples per rank in one step."""
    rows = plan.micro_batch_rows(batch)
    return [sum(b - a for a, b in rows[plan.coords(r)[1]]) for r in range(plan.world_size)]


def ideal_dp_speedup(speeds: list[float]) -> float:
    """sum(X_i) / (N x min X_i): throughput of speed-proportional shares over equal shares."""
    return sum(speeds) / (len(speeds) * min(speeds))


# --- rank workers (module level: pickled by reference) -------------------------------------------------------
def dp_compare(rank: int, world: int, cfg: dict) -> dict | None:
    """Equal vs hardware-aware shares on ``cfg["spec"]``, and each device type's standalone throughput, all in
    one launch, round by round. Rank 0 returns the result.

    Standalone: the first rank of each device type also holds a world-of-one engine (a 1-device emulated spec
    of its type, its own :class:`whale.runtime.context.Context` of world size 1: no process group is used) and
    trains the job's per-rank batch ``batch // world`` alone while every other rank waits at a barrier. Its
    emulation slowdown is set to the one the rank has in the multi-rank engines (a 1-device spec alone would
    give 0: emulation is relative to the fastest device of the spec, and the ``world / cores`` base would be
    1); so the standalone rank runs at the emulated speed its device has in the multi-rank run.
    """
    spec = load_spec(cfg["spec"])
    x, y = make_batch(cfg["batch"], cfg["tokens"], cfg["dim"])
    engines = _dp_engines(spec, cfg, (x, y))
    devices = [d.name for d in spec.devices()]
    leaders = [devices.index(n) for n in dict.fromkeys(devices)]  # first rank of each device type
    alone = _standalone_engine(spec, cfg, rank, engines["aware"].slowdown) if rank in leaders else None
    alone_rows = cfg["batch"] // world
    times, alone_times = _dp_rounds(engines, alone, (x, y), alone_rows, leaders, rank, cfg)
    info = _gather({"slowdown": engines["aware"].slowdown, "alone": alone_times})
    if rank != 0:
        return None
    out = {"spec": cfg["spec"], "world": world, "batch": cfg["batch"], "devices": devices,
           "slowdown": [d["slowdown"] for d in info], "speeds_tflops": [d.fp32_flops / 1e12 for d in spec.devices()]}
    out["standalone"] = {}
    for r in leaders:
        med = statistics.median(info[r]["alone"])
        out["standalone"][devices[r]] = {"rank": r, "rows": alone_rows, "step_s": med,
                                         "throughput": alone_rows / med, "slowdown": info[r]["slowdown"],
                                         "times": info[r]["alone"]}
    for name, engine in engines.items():
        med = statistics.median(times[name])
        out[name] = {"step_s": med, "throughput": cfg["batch"] / med, "rows": _rows(engine.plan, cfg["batch"]),
                     "times": times[name], "plan": str(engine.plan)}
    return out


def _dp_engines(spec, cfg: dict, batch) -> dict:
    """The equal-shares and the hardware-aware engine of the same model on this rank."""
    import whale as wh

    engines = {}
    for name, aware in (("equal", False), ("aware", True)):
        ctx = wh.init(wh.Config(cluster=spec, hardware_aware=aware, seed=0))
        engines[name] = wh.parallelize(TokenMLP(cfg["dim"], cfg["layers"]), loss_fn, _sgd, ctx=ctx,
                                       sample_batch=batch)
    return engines


def _standalone_engine(spec, cfg: dict, rank: int, slowdown: float):
    """A world-of-one engine on this rank's device type, slowed like the rank is in the multi-rank run."""
    import whale as wh
    from whale.cluster import NodeSpec
    from whale.runtime.context import Context

    one = dataclasses.replace(spec, nodes=(NodeSpec((spec.devices()[rank],)),))
    ctx1 = Context(wh.Config(cluster=one, seed=0), 0, 1, torch.device("cpu"), one)
    alone = wh.parallelize(TokenMLP(cfg["dim"], cfg["layers"]), loss_fn, _sgd, ctx=ctx1)
    alone.slowdown = slowdown
    return alone


def _dp_rounds(engines: dict, alone, batch, alone_rows: int, leaders: list[int], rank: int, cfg: dict):
    """Warm-up then measured rounds: every engine (alternating order) and then each standalone leader in turn
    while the other ranks wait. Returns per-engine and standalone seconds per step."""
    xa, ya = batch[0][:alone_rows].contiguous(), batch[1][:alone_rows].contiguous()
    names, k = list(engines), cfg["k"]
    times: dict[str, list[float]] = {n: [] for n in names}
    alone_times: list[float] = []
    for i in range(cfg["warmup"] + cfg["rounds"]):
        for name in names if i % 2 == 0 else names[::-1]:
            t = _timed_steps(engines[name], batch, k)
            if i >= cfg["warmup"]:
                times[name].append(t)
        for leader in leaders:
            dist.barrier()
            if rank == leader:
                start = time.perf_counter()
                for _ in range(k):
                    alone.step((xa, ya))
                if i >= cfg["warmup"]:
                    alone_times.append((time.perf_counter() - start) / k)
            dist.barrier()
    return times, alone_times


def pp_compare(rank: int, world: int, cfg: dict) -> dict | None:
    """Uniform (annotated) vs hardware-aware pipeline cuts on ``cfg["spec"]`` with ``world`` stages."""
    import whale as wh

    spec = load_spec(cfg["spec"])
    m = cfg["micro"]
    batch = m * cfg["micro_rows"]
    x, y = make_batch(batch, cfg["tokens"], cfg["dim"])
    engines = {}
    for name, aware in (("uniform", False), ("aware", True)):
        ctx = wh.init(wh.Config(cluster=spec, hardware_aware=aware, num_micro_batch=m, seed=0))
        model = TokenMLP(cfg["dim"], cfg["layers"], stages=world)
        engines[name] = wh.parallelize(model, loss_fn, _sgd, ctx=ctx, sample_batch=(x, y))
    busy: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(cfg["warmup"] + cfg["rounds"]):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            metrics = engines[name].step((x, y))
            dist.barrier()
            if i >= cfg["warmup"]:
                times[name].append(time.perf_counter() - start)
                busy[name].append(metrics["busy_time"])
    stage_busy = _gather({k: (engines[k].stage, statistics.median(v)) for k, v in busy.items()})
    if rank != 0:
        return None
    out = {"spec": cfg["spec"], "stages": world, "layers": cfg["layers"], "num_micro_batch": m, "batch": batch,
           "devices": [d.name for d in spec.devices()]}
    for name, eng in engines.items():
        med = statistics.median(times[name])
        plan = eng.plan
        counts = [len(v) for v in plan.stage_layers] if plan.stage_layers else _uniform(cfg["layers"], world)
        per_stage = [0.0] * world
        for d in stage_busy:
            s, b = d[name]
            per_stage[s] = b
        out[name] = {"step_s": med, "throughput": batch / med, "counts": counts, "times": times[name],
                     "stage_ranks": [plan.rank_of(s, 0) for s in range(world)], "stage_busy_s": per_stage,
                     "plan": str(plan)}
    return out


def mem_compare(rank: int, world: int, cfg: dict) -> dict | None:
    """Memory-bound case: the hardware-aware plan (memory-constrained shares) vs FLOPS-proportional shares
    forced with ``load_shares`` (which would overflow the P100 on real devices; emulation does not enforce
    memory, so it runs here only to compare speed)."""
    import whale as wh
    from whale.plan.plan import PlanError

    spec = load_spec(cfg["spec"], memory_scale=cfg["memory_scale"])
    x, y = make_batch(cfg["batch"], cfg["tokens"], cfg["dim"])
    speeds = [d.fp32_flops for d in spec.devices()]
    engines = {}
    for name, conf in (("aware", {"hardware_aware": True}),
                       ("flops_shares", {"hardware_aware": False, "load_shares": tuple(speeds)})):
        ctx = wh.init(wh.Config(cluster=spec, seed=0, **conf))
        try:  # planning is deterministic and precedes every collective: all ranks fail alike
            engines[name] = wh.parallelize(TokenMLP(cfg["dim"], cfg["layers"]), loss_fn, _sgd, ctx=ctx,
                                           sample_batch=(x, y))
        except PlanError as e:
            return {"error": f"{name}: {type(e).__name__}: {e}"} if rank == 0 else None
    times = _interleave(engines, (x, y), 1, cfg["rounds"], cfg["k"])
    if rank != 0:
        return None
    out = {"spec": cfg["spec"], "memory_scale": cfg["memory_scale"], "batch": cfg["batch"],
           "devices": [d.name for d in spec.devices()]}
    for name, eng in engines.items():
        med = statistics.median(times[name])
        out[name] = {"step_s": med, "throughput": cfg["batch"] / med, "rows": _rows(eng.plan, cfg["batch"]),
                     "plan": str(eng.plan)}
    return out


def _uniform(layers: int, stages: int) -> list[int]:
    q, r = divmod(layers, stages)
    return [q + (1 if s < r else 0) for s in range(stages)]


# --- launching -----------------------------------------------------------------------------------------------
def launch(fn, world: int, cfg: dict, timeout: float = 900.0):
    """Run ``fn(rank, world, cfg)`` on ``world`` fresh gloo ranks; rank 0's return value."""
    return shared_launch(fn, world, cfg, timeout)[0]


# --- main ----------------------------------------------------------------------------------------------------
def run(p: dict, log=print) -> dict:
    """All cases with parameters ``p`` (:data:`FULL` or :data:`QUICK`); returns the JSON-ready result."""
    log(BANNER)
    t0 = time.perf_counter()
    common = {"tokens": p["tokens"], "dim": p["dim"], "layers": p["dp_layers"], "warmup": p["dp_warmup"],
              "rounds": p["dp_rounds"], "k": p["dp_k"]}
    dp = {}
    for key, spec, world, batch in (("dp2", "v100_p100_2.yaml", 2, p["dp_batch"]),
                                    ("dp4", "v100_p100_4.yaml", 4, p["dp4_batch"])):
        log(f"[{time.perf_counter() - t0:5.0f}s] data parallel, {world} ranks ({spec}) ...")
        dp[key] = launch(dp_compare, world, {**common, "spec": spec, "batch": batch})
    for r in dp.values():
        _dp_summary(r)

    pp = {}
    fwd, bwd, rest_f, rest_b, _ = layer_profile(p["dim"], p["pp_layers"], p["tokens"])
    for key, spec, world in (("pp2", "v100_p100_2.yaml", 2), ("pp4", "v100_p100_4.yaml", 4)):
        log(f"[{time.perf_counter() - t0:5.0f}s] pipeline, {world} stages ({spec}) ...")
        cfg = {"spec": spec, "tokens": p["tokens"], "dim": p["dim"], "layers": p["pp_layers"],
               "micro": p["pp_micro"], "micro_rows": p["pp_micro_rows"], "warmup": p["pp_warmup"],
               "rounds": p["pp_rounds"]}
        pp[key] = launch(pp_compare, world, cfg)
        pp[key]["analysis"] = pp_analysis(pp[key], fwd, bwd, rest_f, rest_b)

    log(f"[{time.perf_counter() - t0:5.0f}s] memory-bound data parallel ...")
    mspec = load_spec("memory_v100_p100.yaml")
    *_, prof = layer_profile(p["dim"], p["dp_layers"], p["tokens"])
    scale = memory_scale_for(prof, mspec.devices(), p["dp_batch"], p["mem_slack"])
    mem = launch(mem_compare, 2, {**common, "spec": "memory_v100_p100.yaml", "batch": p["dp_batch"],
                                  "memory_scale": scale, "rounds": p["mem_rounds"]})
    mem.update(spec="memory_v100_p100.yaml", memory_scale=scale, batch=p["dp_batch"],
               devices=[d.name for d in mspec.devices()])
    mem["analysis"] = mem_analysis(mem, prof)

    return _result(p, dp, pp, mem, time.perf_counter() - t0)


def _dp_summary(r: dict) -> None:
    """Add the ideal throughput, ratios and speedups to one data-parallel case's result."""
    from whale.cluster import CATALOG

    ideal = sum(r["standalone"][n]["throughput"] for n in r["devices"])
    r["ideal_throughput"] = ideal
    r["ratio_to_ideal"] = r["aware"]["throughput"] / ideal
    r["equal_ratio_to_ideal"] = r["equal"]["throughput"] / ideal
    r["speedup_over_equal"] = r["equal"]["step_s"] / r["aware"]["step_s"]
    r["ideal_speedup"] = ideal_dp_speedup([CATALOG[n].fp32_flops for n in r["devices"]])
    r["fraction_of_ideal_speedup"] = r["speedup_over_equal"] / r["ideal_speedup"]
    sa = r["standalone"]  # emulation accuracy: measured standalone speed ratio vs the declared one
    fast, slow = max(sa, key=lambda n: CATALOG[n].fp32_flops), min(sa, key=lambda n: CATALOG[n].fp32_flops)
    r["speed_ratio_measured"] = sa[fast]["throughput"] / sa[slow]["throughput"]
    r["speed_ratio_declared"] = CATALOG[fast].fp32_flops / CATALOG[slow].fp32_flops


def _result(p: dict, dp: dict, pp: dict, mem: dict, wall_s: float) -> dict:
    """The JSON-ready result with the headline keys and the goals."""
    result = {
        "emulated": True, "note": BANNER, "config": p, "cores": os.cpu_count(),
        "dp_ratio_to_ideal": {k: dp[k]["ratio_to_ideal"] for k in dp},
        "dp_speedup_over_equal": {k: dp[k]["speedup_over_equal"] for k in dp},
        "dp_ideal_speedup": {k: dp[k]["ideal_speedup"] for k in dp},
        "dp_fraction_of_ideal_speedup": {k: dp[k]["fraction_of_ideal_speedup"] for k in dp},
        "pp_speedup_over_uniform": {k: pp[k]["analysis"]["measured_speedup"] for k in pp},
        "pp_ideal_speedup": {k: pp[k]["analysis"]["ideal_speedup"] for k in pp},
        "pp_bound_speedup": {k: pp[k]["analysis"]["bound_speedup"] for k in pp},
        "pp_fraction_of_ideal": {k: pp[k]["analysis"]["fraction_of_ideal"] for k in pp},
        "pp_fraction_of_bound": {k: pp[k]["analysis"]["fraction_of_bound"] for k in pp},
        "memory_flops_shares_overflow": mem["analysis"]["flops_overflow"],
        "memory_plan_fits": mem["analysis"]["plan_fits"],
        "dp": dp, "pp": pp, "memory": mem, "wall_s": wall_s,
    }
    result["goals"] = {  # DESIGN.md §9 / issue 4, on the EMULATED clusters
        "dp_ratio_to_ideal >= 0.95 (dp2, dp4)": min(result["dp_ratio_to_ideal"].values()) >= 0.95,
        "dp_speedup_over_equal >= 0.9 x dp_ideal_speedup (dp2, dp4)":
            min(result["dp_fraction_of_ideal_speedup"].values()) >= 0.9,
        "pp4 speedup_over_uniform >= 0.9 x pp_ideal_speedup": result["pp_fraction_of_ideal"]["pp4"] >= 0.9,
        "memory: FLOPS shares overflow and the plan fits": result["memory_flops_shares_overflow"]
        and result["memory_plan_fits"],
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, few steps (~30 s): a smoke test")
    ap.add_argument("--out", default=None, help="write the results as JSON here (and a PNG next to it)")
    args = ap.parse_args()
    res = run(QUICK if args.quick else FULL)
    res["quick"] = args.quick
    print(report(res))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        png = os.path.splitext(args.out)[0] + ".png"
        plot(res, png)
        print(f"wrote {args.out} and {png} (EMULATED)")


if __name__ == "__main__":
    main()
