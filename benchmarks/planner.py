"""Planner benchmark (issue 13): search time at scale, the paper's configurations, and the auto plan against
every enumerated plan measured on 4 emulated ranks.

    python benchmarks/planner.py --out benchmarks/results/planner.json     # ~5 min on 2 CPU cores

Parts (``--skip scale,auto``), the JSON written after each: ``scale`` (:mod:`benchmarks._planner_scale`:
``plan_seconds_512_gpus``, ``plan_seconds_1024_mixed``, ``search_time_table``, ``paper_configs``) and ``auto``
(:mod:`benchmarks._planner_auto`: ``auto_vs_best_enumerated``, EMULATED). The simulator-error part
(``sim_*`` keys) is added by the simulator's own module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import _planner_auto, _planner_scale  # noqa: E402

PARTS = {"scale": _planner_scale.run, "auto": _planner_auto.run}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/planner.json")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: " + ", ".join(PARTS))
    ap.add_argument("--auto-rounds", type=int, default=5, help="measured rounds per plan in the auto part")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    out: dict = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)  # keep the keys of parts skipped this time
    for name, part in PARTS.items():
        if name in skip:
            continue
        out.update(part(args))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"== {name}: written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
