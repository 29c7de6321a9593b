"""Expert parallelism (an MoE layer under ``split``): all-to-all bytes measured vs analytic, and step time.

Per case, one launch of n gloo ranks trains a residual MoE model (``tests/moe_models.MoENet`` shape, wider) for a
few steps with the MoE under a split nested in the replicate (expert parallelism over all n ranks). MEASURED:
``split_ops.comm_bytes["alltoall"]``, the bytes each rank's token all-to-alls send to OTHER ranks (dispatch and
combine, forward and backward; :mod:`whale.parallel.moe`). ANALYTIC, from the step's routing alone:
:func:`whale.parallel.moe.expected_alltoall_bytes` (``2 x (P_out + P_in) x d x 4`` per rank); the key result is
measured / analytic, goal exactly 1.0 on every rank. Also reported: the cost model's uniform-routing bytes, the
planner's view (:func:`whale.plan.cost.all_to_all_time` with bandwidth 1: (n-1)/n of the dispatched bytes,
both directions, forward and backward), and its ratio to the measured bytes (how far the real routing is
from uniform), and the median step time (absolute CPU times mean little).

    python benchmarks/moe.py --out benchmarks/results/moe.json      # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import whale as wh  # noqa: E402
from benchmarks._launch import launch  # noqa: E402
from tests.moe_models import MoENet  # noqa: E402
from whale.parallel.moe import expected_alltoall_bytes  # noqa: E402
from whale.parallel.split_ops import comm_bytes  # noqa: E402
from whale.plan.cost import all_to_all_time  # noqa: E402

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


def main(argv=None) -> dict:
    """Run every case, print a table, write JSON with ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'n':>2} {'E':>3} {'k':>2} {'cf':>5} {'experts/device':<16} {'meas/analytic':>15} {'meas/uniform':>12} "
          f"{'step ms':>8}")
    for world, experts, top_k, cf, weights in CASES:
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
