"""Expert parallelism (an MoE layer under ``split``): all-to-all bytes measured vs analytic, and step time.

Per case, one launch of n gloo ranks trains a residual MoE model (``tests/moe_models.MoENet`` shape, wider) for a
few steps with the MoE under a split nested in the replicate (expert parallelism over all n ranks). MEASURED:
``split_ops.comm_bytes["alltoall"]``, the bytes each rank's token all-to-alls send to OTHER ranks (dispatch and
combine, forward and backward; :mod:`whale.parallel.moe`). ANALYTIC, from the step's routing alone:
:func:`whale.parallel.moe.expected_alltoall_bytes` (``2 x (P_out + P_in) x d x 4`` per rank); the key result is
measured / analytic, goal exactly 1.0 on every rank. Also reported: the cost model's uniform-routing bytes, the
planner's view (:func:`whale.planner.steptime.cost.all_to_all_time` with bandwidth 1: (n-1)/n of the dispatched bytes,
both directions, forward and backward), and its ratio to the measured bytes (how far the real routing is
from uniform), and the median step time (absolute CPU times mean little).

Beyond the bytes of the token all-to-alls (:mod:`benchmarks._moe_ep` has the models and rank workers):

- ``grad_sync_bytes_reduction_vs_dp``: the gradient bytes one step hands to all-reduce on each rank
  (``engine.step()["sync_bytes"]``, counted by :class:`whale.parallel.data.GradSync`), expert parallel (each
  MoE under a split nested in the replicate: experts are never all-reduced, the router and the dense layers
  are) vs plain data parallelism of the same model (every expert replicated and all-reduced), 4 ranks:
  ``1 - EP / DP`` beside the analytic fraction of the model's parameters that are experts (equal by design).
- ``expert_memory_per_rank_scaling``: the parameter bytes each of 4 ranks holds (its engine module's
  parameters) at E = 8, 16, 32 experts, the experts' part over ``E/N x bytes per expert`` (goal 1.0) and the
  rest (router, dense) separately.
- ``hetero_moe_speedup_over_uniform`` / ``hetero_moe_ideal_speedup``: EMULATED V100 + P100 (2 ranks,
  ``benchmarks/clusters/v100_p100_2.yaml``; each CPU rank's compute stretched to its device's speed,
  :mod:`whale.runtime.emulation`), one launch, the two engines stepped round by round in alternating order:
  uniform expert counts (the plan with equal split weights) vs the plan's hardware-aware counts. The model is 4
  residual MoE layers (8 experts of ``256 -> 1024 -> 256``, top-1, dropless) and one output ``Linear`` (the
  dense part is 0.4% of the parameters); the routers are set so that token t goes to expert ``t mod 8`` in
  every layer (a balanced router: an even load per expert, :func:`benchmarks._moe_ep.tag_router`) and the
  learning rate is 0 so it stays so. The emulated slowdowns are the declared speeds' (``emulation_slowdown``,
  with ``WHALE_EMULATION_CORES=0.25``: every rank slowed 8x more, so that a busy host's preemptions stay
  inside the emulated waits; ranks not pinned to cores). Under heavy host load the fastest device, which has
  the least slack (its compute stretched the least), is the first whose real compute outlasts its emulated
  time, and that biases the comparison against the hardware-aware counts, which make it the bottleneck.
  Measured: per round (11, after 3 warm-up, ABBA order) the slowest rank's step, and the median paired ratio
  uniform / hardware-aware with its IQR (:mod:`benchmarks._paired`; ``ratio_of_medians`` beside it).
  Ideal: ``max_i(u_i / s_i) / max_i(h_i / s_i)`` with u, h the experts per device (uniform, hardware-aware)
  and s the devices' fp32 FLOP/s: the ratio of the slowest device's expert time. Goal: measured >= 0.9 x ideal.

    python benchmarks/moe.py --out benchmarks/results/moe.json      # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import whale as wh  # noqa: E402
from benchmarks._launch import launch  # noqa: E402
from benchmarks._paired import describe, summary  # noqa: E402
from benchmarks._provenance import Run  # noqa: E402
from tests.moe_models import MoENet  # noqa: E402
from whale.parallel.moe import expected_alltoall_bytes  # noqa: E402
from whale.parallel.split_ops import comm_bytes  # noqa: E402
from whale.planner.steptime.cost import all_to_all_time  # noqa: E402

CASES = [  # (world, experts, top_k, capacity_factor, shard weights)
    (2, 8, 1, None, None), (2, 8, 2, None, None), (2, 8, 2, 1.0, None),
    (4, 8, 2, None, None), (4, 8, 1, 1.25, None), (4, 9, 2, None, (3, 1, 2, 1)),
]


def _run(rank: int, world: int, case: dict) -> dict:
    from tests.moe_models import with_shard_weights

    ctx = wh.init(wh.Config(seed=0))
    model = MoENet(case["experts"], case["top_k"], case["cf"], d=case["d"], d_ff=case["d_ff"])
    plan = with_shard_weights(wh.plan_model(model, world, ctx.config), case["weights"])
    engine = wh.parallelize(model, lambda out, y: F.mse_loss(out, y) + wh.moe_aux_loss(model),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx, plan=plan)
    moe = engine.module.moe.sharded
    g = torch.Generator().manual_seed(0)
    steps, times = [], []
    for _ in range(case["steps"]):
        x, y = torch.randn(case["batch"], case["tokens"], 6, generator=g), torch.randn(case["batch"],
                                                                                       case["tokens"], 3, generator=g)
        comm_bytes.clear()
        t0 = time.perf_counter()
        engine.step((x, y))
        times.append(time.perf_counter() - t0)
        r = moe.last_routing
        steps.append({"measured": comm_bytes["alltoall"], "experts": r.experts.tolist(), "keep": r.keep.tolist(),
                      "tokens": int(r.experts.shape[0] * r.experts.shape[1])})
    return {"steps": steps, "sizes": moe.sizes, "step_s": statistics.median(times)}


def _report(case: dict, results: list[dict]) -> dict:
    n, d, k = case["world"], case["d"], case["top_k"]
    sizes = results[0]["sizes"]
    ratios, uniform = [], []
    for i in range(case["steps"]):
        routings = [(torch.tensor(r["steps"][i]["experts"]), torch.tensor(r["steps"][i]["keep"])) for r in results]
        analytic = expected_alltoall_bytes(routings, sizes, d)
        measured = [r["steps"][i]["measured"] for r in results]
        ratios += [m / a if a else float(m == 0) for m, a in zip(measured, analytic, strict=True)]
        dispatched = sum(r["steps"][i]["tokens"] for r in results) * k * d * 4  # all choices, before drops
        model = 4 * all_to_all_time(dispatched / n, n, 1.0) * n  # per rank (n-1)/n x S, 4 passes, all ranks
        uniform.append(sum(measured) / model)
    return {**{key: case[key] for key in ("world", "experts", "top_k", "cf", "weights")}, "expert_counts": sizes,
            "measured_over_analytic_min": min(ratios), "measured_over_analytic_max": max(ratios),
            "measured_over_uniform_model": statistics.mean(uniform),
            "step_ms_median": 1e3 * statistics.median(r["step_s"] for r in results)}


SYNC = dict(world=4, d=64, d_ff=256, experts=8, layers=2, batch=8, tokens=16, sync_steps=2,
            memory_experts=(8, 16, 32))
HETERO = dict(world=2, cluster="v100_p100_2.yaml", d=256, d_ff=1024, experts=8, layers=4, batch=8, tokens=64,
              warmup=3, rounds=11, emulation_cores=0.25, pin=False)


def sync_report(res: list[dict]) -> dict:
    """Gradient-sync bytes per step per rank, expert parallel over data parallel (each rank alike), and the
    analytic fraction of the model's parameters that are experts (what expert parallelism leaves out)."""
    ep, dp = (statistics.median(res[0]["sync"][k]["bytes_per_step"]) for k in ("expert_parallel", "data_parallel"))
    info = res[0]["sync"]["data_parallel"]
    per_rank = {k: [r["sync"][k]["bytes_per_step"][-1] for r in res] for k in ("expert_parallel", "data_parallel")}
    return {"measured": 1 - ep / dp, "analytic_expert_fraction": info["expert_numel"] / info["model_numel"],
            "bytes_per_step_per_rank": per_rank, "model_numel": info["model_numel"],
            "expert_numel": info["expert_numel"]}


def memory_report(res: list[dict], world: int) -> dict:
    """Per rank and expert count E: the experts' parameter bytes held (measured from the engine's module) vs
    ``counts[r] x bytes per expert`` (= E/N experts per rank), and the rest (router, dense layers) separately."""
    out = {}
    for e in SYNC["memory_experts"]:
        m = [r["memory"][e] for r in res]
        expert, dense = [x["bytes"][0] for x in m], [x["bytes"][1] for x in m]
        per = m[0]["per_expert_bytes"]
        out[str(e)] = {"experts_per_rank": m[0]["counts"], "expert_bytes_per_rank": expert,
                       "expected_expert_bytes_E_over_N": [e / world * per] * world,
                       "measured_over_E_over_N": [b / (e / world * per) for b in expert],
                       "dense_bytes_per_rank": dense}
    return out


def hetero_report(res: list[dict], speeds: list[float]) -> dict:
    """Median over rounds of the slowest rank's step, uniform vs hardware-aware expert counts, and the ideal
    speedup ``max_i(u_i / s_i) / max_i(h_i / s_i)`` (u, h: experts per device, uniform and hardware-aware; s:
    the devices' fp32 FLOP/s; tokens spread evenly over experts, so a device's expert time is ~ experts/speed)."""
    out = {"devices": [r["device"] for r in res], "speeds_tflops": speeds, "slowdown": [r["slowdown"] for r in res]}
    for name in ("uniform", "hardware-aware"):
        slowest = [max(r[name]["times"][i] for r in res) for i in range(len(res[0][name]["times"]))]
        hist = [sum(col) for col in zip(*(r[name]["expert_hist"] for r in res), strict=True)]
        sizes = res[0][name]["sizes"]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        out[name] = {"experts_per_rank": sizes, "step_s_slowest_median": statistics.median(slowest),
                     "step_s_per_rank_median": [r[name]["median_s"] for r in res], "step_s_slowest": slowest,
                     "tokens_per_rank_layer0": [sum(hist[a:a + c]) for a, c in zip(starts, sizes, strict=True)],
                     "tokens_per_expert_layer0": hist}
    load = {n: max(c / s for c, s in zip(out[n]["experts_per_rank"], speeds, strict=True))
            for n in ("uniform", "hardware-aware")}
    out["ideal_speedup"] = load["uniform"] / load["hardware-aware"]
    out["ratio_of_medians"] = out["uniform"]["step_s_slowest_median"] / out["hardware-aware"]["step_s_slowest_median"]
    # rounds alternate uniform / hardware-aware (ABBA, hetero_compare): adjacent pairs, drift cancels
    paired = summary(out["hardware-aware"]["step_s_slowest"], out["uniform"]["step_s_slowest"],
                     goal=0.9 * out["ideal_speedup"], names=("hardware-aware", "uniform"))
    out["measured_speedup_paired"] = paired
    out["measured_speedup"] = paired["median"]
    return out


def extra_cases(log=print) -> dict:
    """Gradient-sync bytes, memory scaling and the emulated heterogeneous case (see :mod:`benchmarks._moe_ep`)."""
    from benchmarks._hetero_common import load_spec
    from benchmarks._moe_ep import grad_sync_and_memory, hetero_compare

    res = launch(grad_sync_and_memory, SYNC["world"], SYNC)
    sync, memory = sync_report(res), memory_report(res, SYNC["world"])
    log(f"grad-sync bytes per step and rank: expert parallel {sync['bytes_per_step_per_rank']['expert_parallel'][0]:,}"
        f" vs data parallel {sync['bytes_per_step_per_rank']['data_parallel'][0]:,}: reduction "
        f"{sync['measured']:.4f} (expert fraction of the parameters {sync['analytic_expert_fraction']:.4f})")
    log(f"{'E':>3} {'experts/rank':<14} {'expert MiB/rank':>15} {'meas/(E/N)':>10} {'dense MiB/rank':>14}")
    for e, m in memory.items():
        log(f"{e:>3} {str(m['experts_per_rank']):<14} {m['expert_bytes_per_rank'][0] / 2**20:>15.3f} "
            f"{min(m['measured_over_E_over_N']):>10.4f} {m['dense_bytes_per_rank'][0] / 2**20:>14.4f}")
    speeds = [d.fp32_flops / 1e12 for d in load_spec(HETERO["cluster"]).devices()]
    hetero = hetero_report(launch(hetero_compare, HETERO["world"], HETERO), speeds)
    log(f"EMULATED {' + '.join(hetero['devices'])}: {'counts':<8} {'slowest step ms':>15}  per-rank step ms")
    for n in ("uniform", "hardware-aware"):
        h = hetero[n]
        log(f"  {n:<15} {str(h['experts_per_rank']):<8} {1e3 * h['step_s_slowest_median']:>15.1f}  "
            + ", ".join(f"{1e3 * t:.1f}" for t in h["step_s_per_rank_median"]))
    log(f"  speedup measured, median paired ratio {describe(hetero['measured_speedup_paired'])} (ratio of medians "
        f"{hetero['ratio_of_medians']:.3f}) vs ideal {hetero['ideal_speedup']:.3f} "
        f"(ratio {hetero['measured_speedup'] / hetero['ideal_speedup']:.3f}; goal >= 0.9)")
    return {"grad_sync": sync, "memory": memory, "hetero": hetero, "sync_config": SYNC, "hetero_config": HETERO}


def main(argv=None) -> dict:
    """Run every case, print a table, write JSON with ``--out``."""
    run = Run()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only-extra", action="store_true", help="skip the all-to-all byte cases (development)")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'n':>2} {'E':>3} {'k':>2} {'cf':>5} {'experts/device':<16} {'meas/analytic':>15} {'meas/uniform':>12} "
          f"{'step ms':>8}")
    for world, experts, top_k, cf, weights in [] if args.only_extra else CASES:
        case = dict(world=world, experts=experts, top_k=top_k, cf=cf, weights=weights, d=64, d_ff=128, batch=8,
                    tokens=32, steps=args.steps)
        row = _report(case, launch(_run, world, case))
        rows.append(row)
        span = f"{row['measured_over_analytic_min']:.4f}-{row['measured_over_analytic_max']:.4f}"
        print(f"{world:>2} {experts:>3} {top_k:>2} {str(cf):>5} {str(row['expert_counts']):<16} {span:>15} "
              f"{row['measured_over_uniform_model']:>12.3f} {row['step_ms_median']:>8.1f}")
    out = {"cases": rows, "all_exact": all(r["measured_over_analytic_min"] == r["measured_over_analytic_max"] == 1.0
                                          for r in rows)}
    print(f"measured all-to-all bytes == analytic on every rank and step: {out['all_exact']}")
    if rows:
        out["alltoall_bytes_measured_over_analytic"] = min(r["measured_over_analytic_min"] for r in rows)
        out["alltoall_bytes_measured_over_analytic_max"] = max(r["measured_over_analytic_max"] for r in rows)
    extra = extra_cases()
    out.update(extra, grad_sync_bytes_reduction_vs_dp={
        "measured": extra["grad_sync"]["measured"], "analytic_expert_fraction":
        extra["grad_sync"]["analytic_expert_fraction"]},
        expert_memory_per_rank_scaling={e: {"expert_bytes_per_rank": m["expert_bytes_per_rank"][0],
                                            "measured_over_E_over_N": min(m["measured_over_E_over_N"]),
                                            "dense_bytes_per_rank": m["dense_bytes_per_rank"][0]}
                                        for e, m in extra["memory"].items()},
        hetero_moe_speedup_over_uniform=extra["hetero"]["measured_speedup"],
        hetero_moe_speedup_over_uniform_paired={k: extra["hetero"]["measured_speedup_paired"][k] for k in (
            "median", "q1", "q3", "min", "max", "n", "goal", "goal_met")},
        hetero_moe_ideal_speedup=extra["hetero"]["ideal_speedup"])
    if args.out:
        from benchmarks._moe_ep import plot

        plot(out, os.path.splitext(args.out)[0] + ".png")
        out = run.write(args.out, out)
    return out


if __name__ == "__main__":
    main()
