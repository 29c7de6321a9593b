"""Planner benchmark (issue 13): the simulator against measured step times, search time at scale, the paper's
configurations, and the auto plan against every enumerated plan measured on 4 emulated ranks.

    python benchmarks/planner.py --out benchmarks/results/planner.json     # ~10 min on 2 CPU cores

Parts (``--skip sim,scale,auto``); the JSON is written fresh after each part (with provenance: commit, command,
dates, host load, wall time, per part under ``provenance.parts``). With ``--merge`` the parts skipped keep the
keys an earlier run wrote to ``--out`` (each with its own commit and command); a missing or empty file is read
as no earlier parts:

- ``sim`` (:mod:`benchmarks._planner_sim`): >= 10 EMULATED runs (data parallel, pipeline, split, hybrids;
  V100/P100 mixes; 1-8 micro-batches), each the median step time of the slowest rank vs the prediction of
  :func:`whale.calibration.predict.predict_model`: ``sim_median_abs_rel_error`` (goal <= 0.10),
  ``sim_max_abs_rel_error`` (goal <= 0.20), ``sim_runs`` and a PNG (``<out>_sim.png``). Under emulation compute
  is stretched to the declared speeds but communication is real gloo on localhost, so the prediction uses this
  machine's calibrated gloo costs, not the declared links.
- ``scale`` (:mod:`benchmarks._planner_scale`): ``plan_seconds_512_gpus``, ``plan_seconds_1024_mixed``,
  ``search_time_table``, ``paper_configs``.
- ``auto`` (:mod:`benchmarks._planner_auto`): ``auto_vs_best_enumerated`` (EMULATED).
- ``heldout`` (:mod:`benchmarks._planner_heldout`): the simulator on 22 held-out EMULATED runs (ZeRO, checkpointing,
  offload, MoE, bf16/fp16, T4s and an A100, 3 ranks, ZB-H1 and interleaved 1F1B, an MLP and a Hugging Face Llama)
  predicted with the declared device speeds only, fixed before the model was tuned and never tuned on:
  ``sim_heldout_median_abs_rel_error`` (goal <= 0.10), ``sim_heldout_max_abs_rel_error`` (goal <= 0.20),
  ``sim_heldout_runs``.
- ``tuning`` (the same module): the first held-out set, seen and tuned on since, scored the same way:
  ``sim_tuning_*``. The ``sim`` part's ``sim_median_abs_rel_error`` uses factors measured in the very runs it
  predicts and is not a prediction; its ``sim_nominal_*`` keys are the declared-speed errors on those
  development runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import _planner_auto, _planner_heldout, _planner_scale, _planner_sim  # noqa: E402
from benchmarks._provenance import PartsFile, Run  # noqa: E402

PARTS = {"sim": _planner_sim.run, "scale": _planner_scale.run, "auto": _planner_auto.run,
         "heldout": _planner_heldout.run, "tuning": _planner_heldout.run_tuning}


def main() -> None:
    """Run the parts not skipped; write the JSON after each."""
    run = Run()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/planner.json")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: " + ", ".join(PARTS))
    ap.add_argument("--runs", default=",".join(_planner_sim.RUNS), help="sim part: comma list of runs")
    ap.add_argument("--steps", type=int, default=8, help="sim part: measured steps per run (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cores", type=float, default=0.25,
                    help="sim part: WHALE_EMULATION_CORES; below the real 2 stretches compute further, so that "
                         "other processes on a shared machine do not show through the emulated times")
    ap.add_argument("--auto-rounds", type=int, default=5, help="auto part: measured rounds per plan")
    ap.add_argument("--auto-paired-rounds", type=int, default=10,
                    help="auto part: paired rounds of the auto plan vs the best enumerated one")
    ap.add_argument("--heldout-runs", default="", help="heldout part: comma list of runs (default: all of "
                    "benchmarks/_planner_heldout.HELDOUT)")
    ap.add_argument("--tuning-runs", default="", help="tuning part: comma list of runs (default: all of "
                    "benchmarks/_planner_heldout.TUNING)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the parts skipped now from the earlier --out file (their provenance kept per part)")
    ap.add_argument("--merge-from", default="", help="also merge every part of this parts file (e.g. one written "
                    "by a concurrent run with another --out), each with its own provenance")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    out = PartsFile(args.out, run, merge=args.merge or bool(args.merge_from))
    if args.merge_from:
        out.absorb(args.merge_from)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # parts write PNGs beside it
    for name, part in PARTS.items():
        if name in skip:
            continue
        since = time.time()
        out.add(name, part(args), since)
        print(f"== {name}: written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
