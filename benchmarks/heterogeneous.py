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
import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from benchmarks._launch import launch as shared_launch  # noqa: E402
from benchmarks._models import Block  # noqa: E402

CLUSTERS = os.path.join(HERE, "clusters")
BANNER = ("EMULATED heterogeneous cluster: CPU ranks imitate V100/P100 speed ratios (and scaled memory); "
          "numbers are emulation, not real GPUs")

FULL = {"dim": 64, "tokens": 256, "dp_layers": 4, "dp_batch": 62, "dp4_batch": 124, "dp_warmup": 2,
        "dp_rounds": 15, "dp_k": 3, "pp_layers": 20, "pp_micro": 16, "pp_micro_rows": 4, "pp_warmup": 1,
        "pp_rounds": 8, "mem_rounds": 4, "mem_slack": 0.05}
"""Full run: compute-heavy token MLP (132k parameters, ~1.7 GFLOP per sample per step)."""
QUICK = {"dim": 32, "tokens": 64, "dp_layers": 2, "dp_batch": 62, "dp4_batch": 124, "dp_warmup": 1,
         "dp_rounds": 3, "dp_k": 2, "pp_layers": 12, "pp_micro": 8, "pp_micro_rows": 2, "pp_warmup": 1,
         "pp_rounds": 2, "mem_rounds": 2, "mem_slack": 0.05}
"""Quick run: a smoke test of every case (numbers are dominated by per-step overhead)."""


# --- model ---------------------------------------------------------------------------------------------------
class TokenMLP(nn.Module):
    """``layers`` equal blocks; with ``stages > 1`` they are built in ``stages`` contiguous, as-even-as-possible
    groups, each inside ``wh.replicate(1)`` (one pipeline stage each; earlier stages get the remainder)."""

    def __init__(self, dim: int, layers: int, stages: int = 1) -> None:
        super().__init__()
        import whale as wh

        q, r = divmod(layers, stages)
        blocks: list[nn.Module] = []
        for s in range(stages):
            with wh.replicate(1) if stages > 1 else contextlib.nullcontext():
                blocks.extend(Block(dim) for _ in range(q + (1 if s < r else 0)))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def loss_fn(out, y):
    """Mean squared error over the rows given (a mean, as Whale requires)."""
    return F.mse_loss(out, y)


def make_batch(rows: int, tokens: int, dim: int, seed: int = 1):
    """A fixed global batch ``(x, y)`` of shape [rows, tokens, dim]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, tokens, dim, generator=g), torch.randn(rows, tokens, dim, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


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
    import whale as wh
    from whale.cluster import NodeSpec
    from whale.runtime.context import Context

    spec = load_spec(cfg["spec"])
    x, y = make_batch(cfg["batch"], cfg["tokens"], cfg["dim"])
    engines, plans = {}, {}
    for name, aware in (("equal", False), ("aware", True)):
        ctx = wh.init(wh.Config(cluster=spec, hardware_aware=aware, seed=0))
        model = TokenMLP(cfg["dim"], cfg["layers"])
        engines[name] = wh.parallelize(model, loss_fn, _sgd, ctx=ctx, sample_batch=(x, y))
        plans[name] = engines[name].plan
    devices = [d.name for d in spec.devices()]
    leaders = [devices.index(n) for n in dict.fromkeys(devices)]  # first rank of each device type
    alone = None
    alone_rows = cfg["batch"] // world
    if rank in leaders:
        one = dataclasses.replace(spec, nodes=(NodeSpec((spec.devices()[rank],)),))
        ctx1 = Context(wh.Config(cluster=one, seed=0), 0, 1, torch.device("cpu"), one)
        alone = wh.parallelize(TokenMLP(cfg["dim"], cfg["layers"]), loss_fn, _sgd, ctx=ctx1)
        alone.slowdown = engines["aware"].slowdown  # this rank's multi-rank emulation factor (see above)
    xa, ya = x[:alone_rows].contiguous(), y[:alone_rows].contiguous()
    names = list(engines)
    times: dict[str, list[float]] = {k: [] for k in names}
    alone_times: list[float] = []
    k = cfg["k"]
    for i in range(cfg["warmup"] + cfg["rounds"]):
        for name in names if i % 2 == 0 else names[::-1]:
            t = _timed_steps(engines[name], (x, y), k)
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
    for name in engines:
        med = statistics.median(times[name])
        out[name] = {"step_s": med, "throughput": cfg["batch"] / med, "rows": _rows(plans[name], cfg["batch"]),
                     "times": times[name], "plan": str(plans[name])}
    return out


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


# --- analysis (no processes) ---------------------------------------------------------------------------------
def layer_profile(dim: int, layers: int, tokens: int):
    """Per-block forward/backward FLOPs per sample and the rest (loss), from Whale's fake-tensor profiler."""
    from whale.runtime import hwplan

    model = TokenMLP(dim, layers)
    prof = hwplan.profile(model, make_batch(2, tokens, dim))
    fwd = [u.forward_flops for u in prof.units]
    bwd = [u.backward_flops for u in prof.units]
    return fwd, bwd, prof.rest.forward_flops, prof.rest.backward_flops, prof


def stage_work(counts, fwd, bwd, rest_f, rest_b):
    """(forward, backward) FLOPs per sample of each stage of a cut; the rest (loss) on the last stage."""
    out, a = [], 0
    for s, c in enumerate(counts):
        f, b = sum(fwd[a:a + c]), sum(bwd[a:a + c])
        if s == len(counts) - 1:
            f, b = f + rest_f, b + rest_b
        out.append((f, b))
        a += c
    return out


def bottleneck(counts, fwd, bwd, rest_f, rest_b, speeds) -> float:
    """Slowest stage's (forward + backward) time per sample at the stage devices' speeds."""
    return max((f + b) / v for (f, b), v in zip(stage_work(counts, fwd, bwd, rest_f, rest_b), speeds, strict=True))


def best_cut(fwd, bwd, rest_f, rest_b, speeds) -> list[int]:
    """Contiguous cut minimizing the slowest stage, by brute force over every composition (few layers)."""
    n, s = len(fwd), len(speeds)
    best, arg = float("inf"), None
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        counts = [bounds[i + 1] - bounds[i] for i in range(s)]
        t = bottleneck(counts, fwd, bwd, rest_f, rest_b, speeds)
        if t < best - 1e-15:
            best, arg = t, counts
    return arg


def simulate_1f1b(fwd_t: list[float], bwd_t: list[float], m: int) -> float:
    """Makespan of a 1F1B step (Whale's schedule) with per-stage forward/backward times per micro-batch;
    communication free. F(s, i) needs F(s-1, i); B(s, i) needs B(s+1, i); each stage runs its actions in order."""
    from whale.parallel.schedule import make_schedule

    sched = make_schedule("1F1B", len(fwd_t), m)
    S = len(fwd_t)
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * S, [0.0] * S
    while any(pos[s] < len(sched[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(sched[s]):
                a = sched[s][pos[s]]
                dep = ("F", s - 1, a.mb) if a.kind == "F" and s > 0 else \
                      ("B", s + 1, a.mb) if a.kind == "B" and s < S - 1 else None
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep else 0.0)
                clock[s] = start + (fwd_t[s] if a.kind == "F" else bwd_t[s])
                done[(a.kind, s, a.mb)] = clock[s]
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked")
    return max(clock)


def pp_analysis(res: dict, fwd, bwd, rest_f, rest_b) -> dict:
    """Ideal, fluid and simulated speedups of the hardware-aware cut over the uniform cut (see top)."""
    from whale.cluster import CATALOG

    speeds = {name: CATALOG[name].fp32_flops for name in res["devices"]}

    def stage_speeds(variant):
        return [speeds[res["devices"][r]] for r in res[variant]["stage_ranks"]]

    sp_u, sp_a = stage_speeds("uniform"), stage_speeds("aware")
    t_uni = bottleneck(res["uniform"]["counts"], fwd, bwd, rest_f, rest_b, sp_u)
    best = best_cut(fwd, bwd, rest_f, rest_b, sp_a)
    t_best = bottleneck(best, fwd, bwd, rest_f, rest_b, sp_a)
    t_aware = bottleneck(res["aware"]["counts"], fwd, bwd, rest_f, rest_b, sp_a)
    t_fluid = (sum(fwd) + sum(bwd) + rest_f + rest_b) / sum(sp_a)
    m = res["num_micro_batch"]

    def sim(counts, sp):
        work = stage_work(counts, fwd, bwd, rest_f, rest_b)
        return simulate_1f1b([f / v for (f, _), v in zip(work, sp, strict=True)],
                             [b / v for (_, b), v in zip(work, sp, strict=True)], m)

    sim_u, sim_best, sim_a = sim(res["uniform"]["counts"], sp_u), sim(best, sp_a), sim(res["aware"]["counts"], sp_a)
    measured = res["uniform"]["step_s"] / res["aware"]["step_s"]
    return {"best_counts": best, "uniform_bottleneck": t_uni, "best_bottleneck": t_best,
            "aware_bottleneck": t_aware, "fluid_bottleneck": t_fluid,
            "ideal_speedup": t_uni / t_best, "fluid_speedup": t_uni / t_fluid,
            "aware_cut_speedup": t_uni / t_aware, "bound_speedup": sim_u / sim_best,
            "sim_aware_speedup": sim_u / sim_a, "measured_speedup": measured,
            "fraction_of_ideal": measured / (t_uni / t_best), "fraction_of_bound": measured / (sim_u / sim_best)}


def memory_scale_for(prof, devices, batch: int, slack: float) -> float:
    """``memory_scale`` at which the whole cluster holds the job's static bytes on every device plus the
    activations of ``(1 + slack) x batch`` samples."""
    cap = sum(d.memory_bytes for d in devices)
    return (len(devices) * prof.static_bytes + (1 + slack) * batch * prof.activation_bytes) / cap


def mem_analysis(res: dict, prof) -> dict:
    """Bytes each device would need under FLOPS-proportional shares and under the plan's shares."""
    from whale.cluster import CATALOG
    from whale.plan.balance import proportional_shares

    devs = [CATALOG[n] for n in res["devices"]]
    caps = [d.memory_bytes * res["memory_scale"] for d in devs]
    flops_rows = proportional_shares(res["batch"], [d.fp32_flops for d in devs])

    def need(rows):
        return [prof.static_bytes + r * prof.activation_bytes for r in rows]

    out = {"capacity_bytes": caps, "flops_rows": flops_rows, "flops_need_bytes": need(flops_rows),
           "flops_overflow": any(n > c for n, c in zip(need(flops_rows), caps, strict=True)),
           "static_bytes": prof.static_bytes, "activation_bytes_per_sample": prof.activation_bytes,
           "plan_rows": None, "plan_need_bytes": None, "plan_fits": False}
    if "aware" in res:
        rows = res["aware"]["rows"]
        out.update(plan_rows=rows, plan_need_bytes=need(rows),
                   plan_fits=all(n <= c for n, c in zip(need(rows), caps, strict=True)))
    return out


# --- launching -----------------------------------------------------------------------------------------------
def launch(fn, world: int, cfg: dict, timeout: float = 900.0):
    """Run ``fn(rank, world, cfg)`` on ``world`` fresh gloo ranks; rank 0's return value."""
    return shared_launch(fn, world, cfg, timeout)[0]


# --- main ----------------------------------------------------------------------------------------------------
def run(p: dict, log=print) -> dict:
    """All cases with parameters ``p`` (:data:`FULL` or :data:`QUICK`); returns the JSON-ready result."""
    from whale.cluster import CATALOG

    log(BANNER)
    t0 = time.perf_counter()
    common = {"tokens": p["tokens"], "dim": p["dim"], "layers": p["dp_layers"], "warmup": p["dp_warmup"],
              "rounds": p["dp_rounds"], "k": p["dp_k"]}
    dp = {}
    for key, spec, world, batch in (("dp2", "v100_p100_2.yaml", 2, p["dp_batch"]),
                                    ("dp4", "v100_p100_4.yaml", 4, p["dp4_batch"])):
        log(f"[{time.perf_counter() - t0:5.0f}s] data parallel, {world} ranks ({spec}) ...")
        dp[key] = launch(dp_compare, world, {**common, "spec": spec, "batch": batch})
    for key in dp:
        r = dp[key]
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
        "dp": dp, "pp": pp, "memory": mem, "wall_s": time.perf_counter() - t0,
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


def report(res: dict) -> str:
    """The printed table (every line block says EMULATED)."""
    lines = ["", "=" * 100, BANNER, "=" * 100, "",
             "Data parallel (EMULATED): throughput in samples/s; ideal = sum of each device's standalone throughput",
             f"{'case':<6} {'devices':<34} {'equal':>8} {'aware':>8} {'ideal':>8} {'aware/ideal':>11} "
             f"{'speedup':>8} {'ideal sp.':>9} {'sp./ideal':>9}  rows equal -> aware"]
    for k, r in res["dp"].items():
        devs = ",".join(n.split("-")[0] for n in r["devices"])
        lines.append(f"{k:<6} {devs:<34} {r['equal']['throughput']:>8.1f} {r['aware']['throughput']:>8.1f} "
                     f"{r['ideal_throughput']:>8.1f} {r['ratio_to_ideal']:>11.3f} {r['speedup_over_equal']:>8.3f} "
                     f"{r['ideal_speedup']:>9.3f} {r['fraction_of_ideal_speedup']:>9.3f}  "
                     f"{r['equal']['rows']} -> {r['aware']['rows']}")
    lines.append("emulation check: standalone speed ratio fast/slow device measured "
                 + ", ".join(f"{k} {r['speed_ratio_measured']:.3f}" for k, r in res["dp"].items())
                 + f" vs declared {next(iter(res['dp'].values()))['speed_ratio_declared']:.3f}")
    lines += ["", "Pipelines (EMULATED): 1F1B; speedup = uniform step time / hardware-aware step time",
              f"{'case':<5} {'stage devices':<22} {'uniform cut':<14} {'aware cut':<14} {'best cut':<14} "
              f"{'measured':>8} {'ideal':>7} {'fluid':>7} {'1F1B bound':>10} {'meas/ideal':>10} {'meas/bound':>10}"]
    for k, r in res["pp"].items():
        a = r["analysis"]
        devs = ",".join(r["devices"][i].split("-")[0] for i in r["aware"]["stage_ranks"])
        lines.append(f"{k:<5} {devs:<22} {str(r['uniform']['counts']):<14} {str(r['aware']['counts']):<14} "
                     f"{str(a['best_counts']):<14} {a['measured_speedup']:>8.3f} {a['ideal_speedup']:>7.3f} "
                     f"{a['fluid_speedup']:>7.3f} {a['bound_speedup']:>10.3f} {a['fraction_of_ideal']:>10.3f} "
                     f"{a['fraction_of_bound']:>10.3f}")
    m, ma = res["memory"], res["memory"]["analysis"]
    gb = 1e9
    lines += ["", f"Memory-bound data parallel (EMULATED, memory x {m['memory_scale']:.3g}): "
              f"{' + '.join(m['devices'])}, batch {m['batch']}",
              f"  capacity (GB, scaled):        {[round(c / gb, 4) for c in ma['capacity_bytes']]}",
              f"  FLOPS-proportional rows {ma['flops_rows']} need {[round(c / gb, 4) for c in ma['flops_need_bytes']]}"
              f" GB -> {'OVERFLOWS' if ma['flops_overflow'] else 'fits'}"]
    if "error" in m:
        lines.append(f"  hardware-aware plan FAILED: {m['error']}")
    else:
        lines.append(
            f"  hardware-aware plan rows {ma['plan_rows']} need {[round(c / gb, 4) for c in ma['plan_need_bytes']]}"
            f" GB -> {'fits' if ma['plan_fits'] else 'OVERFLOWS'}; ran at {m['aware']['throughput']:.1f} samples/s "
            f"(FLOPS shares, memory not enforced by emulation: {m['flops_shares']['throughput']:.1f})")
    lines += ["", "Summary (EMULATED):"]
    for key in ("dp_ratio_to_ideal", "dp_speedup_over_equal", "dp_ideal_speedup", "dp_fraction_of_ideal_speedup",
                "pp_speedup_over_uniform", "pp_ideal_speedup", "pp_bound_speedup", "pp_fraction_of_ideal",
                "pp_fraction_of_bound"):
        v = res[key]
        text = ", ".join(f"{k} {x:.3f}" for k, x in v.items()) if isinstance(v, dict) else f"{v:.3f}"
        lines.append(f"  {key:<30} {text}")
    for goal, ok in res["goals"].items():
        lines.append(f"  goal {goal:<62} {'met' if ok else 'NOT MET'}")
    lines.append(f"  wall time {res['wall_s']:.0f} s on {res['cores']} cores")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    """Bar charts: DP throughput (equal / aware / ideal) and PP speedups (measured / ideal / bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = list(res["dp"])
    w = 0.25
    for i, (name, label) in enumerate((("equal", "equal shares"), ("aware", "hardware-aware"), ("ideal", "ideal"))):
        vals = [res["dp"][k]["ideal_throughput"] if name == "ideal" else res["dp"][k][name]["throughput"]
                for k in keys]
        ax1.bar([j + (i - 1) * w for j in range(len(keys))], vals, w, label=label)
    ax1.set_xticks(range(len(keys)), [f"{k}: " + ",".join(n.split("-")[0] for n in res["dp"][k]["devices"])
                                      for k in keys], fontsize=8)
    ax1.set_ylabel("samples/s (EMULATED)")
    ax1.set_title("Data parallel, EMULATED V100/P100")
    ax1.legend(loc="lower center", fontsize=8)
    keys = list(res["pp"])
    for i, (name, label) in enumerate((("measured_speedup", "measured"), ("ideal_speedup", "ideal (best cut)"),
                                       ("bound_speedup", "1F1B bound"))):
        ax2.bar([j + (i - 1) * w for j in range(len(keys))], [res["pp"][k]["analysis"][name] for k in keys], w,
                label=label)
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xticks(range(len(keys)), [f"{k}: {res['pp'][k]['stages']} stages" for k in keys])
    ax2.set_ylabel("speedup over uniform cuts")
    ax2.set_title("Pipeline, EMULATED V100/P100")
    ax2.legend(loc="lower center", fontsize=8)
    fig.suptitle("EMULATED heterogeneous cluster (CPU ranks imitate GPU speed ratios) - not real GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
