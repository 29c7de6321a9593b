"""Memory benchmark: measured vs predicted per-rank memory under each technique, the largest GPT that trains under
a fixed device budget (Whale's best vs pure data parallelism), ZeRO-3 vs FSDP2 (when built), and bf16 vs fp32.

    python benchmarks/memory.py --out benchmarks/results/memory.json      # ~15 min on 2 CPU cores

Writes the JSON fresh (keys below; ``--merge`` keeps the parts skipped now from the earlier file, each part's
provenance under ``provenance.parts``), a PNG of per-rank memory by category for each configuration beside it
(``memory.png``), and prints the tables.

- ``memory_prediction_max_rel_error``: max over ranks and configurations of |predicted - measured| / measured
  peak device bytes (:mod:`benchmarks._memory_runs`; goal <= 0.10);
- ``largest_params_ratio_vs_dp``: ``largest_best_params`` / ``largest_dp_params``, the most parameters of the GPT
  family that train 3 steps on 4 ranks under one fixed per-rank budget with the best combination vs with pure
  data parallelism, each side's boundary bisected (depth, then width) and decided by the MEASURED out-of-memory
  check, with the first sizes above it that failed and how (:mod:`benchmarks._memory_largest`; goal >= 10);
- ``bf16_vs_fp32_final_loss_gap``: the GPT main job over 200 steps at peak LR ``--precision-lr``, held-out loss
  (:mod:`benchmarks._memory_precision`; goal <= 0.05 nats), with ``fp32_seed_to_seed_final_loss_gap``, the
  same difference between two fp32 seeds (the noise floor the gap must be read against);
- ``zero3_vs_fsdp2_throughput`` / ``zero3_vs_fsdp2_peak_memory``: from ``benchmarks/results/zero3.json``
  (``benchmarks/zero3.py``) when it exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._launch import launch  # noqa: E402
from benchmarks._memory_largest import bisect_worker, summarize  # noqa: E402
from benchmarks._memory_plot import plot_memory  # noqa: E402
from benchmarks._memory_precision import precision_gap  # noqa: E402
from benchmarks._memory_runs import CONFIGS, MEASURED, dispatch_overhead, rank_rows, worker  # noqa: E402
from benchmarks._provenance import PartsFile, Run  # noqa: E402


def _prediction(base: dict) -> dict:
    """Every measured configuration on 4 emulated ranks: rows, tables, the worst relative error."""
    results = launch(worker, 4, base)
    runs = {name: [r[name] for r in results] for name in CONFIGS}
    for name in MEASURED:
        print(f"== {name}\n{runs[name][0]['table']}", flush=True)
    rows = {name: rank_rows(runs[name][0]["rows"]) for name in MEASURED}
    errors = {name: max(abs(r["predicted_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
                        for r in rs if r["predicted_bytes"]) for name, rs in rows.items()}
    step_off = max(r["step_s"] for r in runs["cpu_tracker_off"])
    step_on = max(r["step_s"] for r in runs["cpu_tracker_on"])
    return {"configurations": rows, "prediction_rel_error_by_configuration": errors,
            "memory_prediction_max_rel_error": max(errors.values()),
            "plans": {name: runs[name][0]["plan"] for name in MEASURED},
            "tracker_overhead": {"median_step_s_tracker_off": step_off, "median_step_s_tracker_on": step_on,
                                 "ratio_on_over_off": step_on / step_off, "where": "plain CPU ranks, no emulation",
                                 "one_process_forward_backward": dispatch_overhead(base)}}


def _largest(args) -> dict:
    """Each side's largest GPT under the fixed budget, bisected and decided by measurement."""
    cfg = {"budget": args.budget, "host_per_node": args.host_per_node, "vocab": args.largest_vocab, "seq": 64,
           "embd": 128,
           "batch": 16, "micro_batches": 4, "dp_start": args.dp_start,
           "best_layouts": [x for x in args.best_layouts.split(",") if x], "best_start": args.best_start}
    result = launch(bisect_worker, 4, cfg, 3000.0)[0]
    summary = summarize(result)
    print(json.dumps(summary, indent=1), flush=True)
    return {"budget_bytes_per_rank": args.budget, "host_bytes_per_node": args.host_per_node, "setup": cfg,
            "search": result, **summary}


def _zero3() -> dict:
    path = os.path.join(os.path.dirname(__file__), "results", "zero3.json")
    if not os.path.exists(path):
        return {"zero3_vs_fsdp2_throughput": None, "zero3_vs_fsdp2_peak_memory": None,
                "zero3_note": "benchmarks/zero3.py has not written benchmarks/results/zero3.json"}
    with open(path) as f:
        z = json.load(f)
    return {k: z.get(k) for k in ("zero3_vs_fsdp2_throughput", "zero3_vs_fsdp2_peak_memory")} | {
        "zero3_source": "benchmarks/results/zero3.json"}


def main() -> None:
    """Run the parts, print the tables, write the JSON and the PNG."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", type=float, default=48e6, help="device bytes per rank for the largest-model ladder")
    p.add_argument("--host-per-node", type=float, default=2e9, help="host bytes per node (2 ranks) for the ladder")
    p.add_argument("--largest-vocab", type=int, default=2048, help="vocabulary of the largest-model GPTs")
    p.add_argument("--dp-start", type=int, default=8, help="depth the data-parallel bisection starts from")
    p.add_argument("--best-layouts", default="", help="comma list of layouts the best side may use (default all: "
                   "data_parallel,pp2_dp2,pp4, the one the planner alone takes deepest is searched)")
    p.add_argument("--best-start", type=int, default=0,
                   help="depth the best side's bisection starts from (default: the planner-only boundary)")
    p.add_argument("--precision-steps", type=int, default=200)
    p.add_argument("--precision-lr", type=float, default=1e-3,
                   help="peak LR of the bf16-vs-fp32 runs (the job's 3e-3 suits its 600 steps, not 200)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: prediction,largest,precision")
    p.add_argument("--merge", action="store_true",
                   help="keep the parts skipped now from the earlier --out file (each part's provenance is kept)")
    args = p.parse_args()
    run = Run()
    skip = set(args.skip.split(",")) - {""}
    base = {"layers": args.layers, "embd": args.embd, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
            "micro_batches": args.micro_batches, "steps": args.steps}
    out = PartsFile(args.out, run, merge=args.merge)  # rewritten after each part: a later failure loses nothing
    out.add("setup", {"model": {k: base[k] for k in ("layers", "embd", "vocab", "seq")}, "global_batch": args.batch,
                      "micro_batches": args.micro_batches, "world_size": 4,
                      "layout": "2 pipeline stages x 2 lanes, 1F1B",
                      "cluster": "examples/clusters/v100_p100.yaml (EMULATED: CPU ranks imitating V100/P100)"},
            time.time())
    if "prediction" not in skip:
        since = time.time()
        got = _prediction(base)
        got["png"] = os.path.splitext(args.out)[0] + ".png"
        plot_memory(got["configurations"], got["png"])
        print(f"prediction errors: {json.dumps(got['prediction_rel_error_by_configuration'], indent=1)}")
        out.add("prediction", got, since)
    if "largest" not in skip:
        since = time.time()
        got = {"largest_model": _largest(args)}
        for k in ("largest_params_ratio_vs_dp", "largest_dp_params", "largest_best_params"):
            got[k] = got["largest_model"][k]
        out.add("largest", got, since)
    if "precision" not in skip:
        since = time.time()
        got = {"precision": precision_gap(args.precision_steps, args.precision_lr)}
        for k in ("bf16_vs_fp32_final_loss_gap", "fp32_seed_to_seed_final_loss_gap"):
            got[k] = got["precision"][k]
        out.add("precision", got, since)
    out.add("zero3", _zero3(), time.time())
    keys = ("memory_prediction_max_rel_error", "largest_params_ratio_vs_dp", "bf16_vs_fp32_final_loss_gap",
            "fp32_seed_to_seed_final_loss_gap", "zero3_vs_fsdp2_throughput", "zero3_vs_fsdp2_peak_memory")
    print(json.dumps({k: out.data.get(k) for k in keys}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
