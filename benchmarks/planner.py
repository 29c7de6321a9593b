"""Planner benchmark: how well the whole-step simulator predicts measured step times (and, in later parts, the
search and its scale).

    python benchmarks/planner.py --out benchmarks/results/planner.json          # sim part: ~3-5 min, 2 cores

Parts (``--skip`` a comma list of them); the JSON is written after each part:

- ``sim``: >= 10 EMULATED runs (data parallel, pipeline, split, hybrids; V100/P100 mixes; 1-8 micro-batches;
  :mod:`benchmarks._planner_sim`), each the median step time of the slowest rank vs the prediction of
  :func:`whale.frontend.simcost.predict_model`. Keys ``sim_median_abs_rel_error`` (goal <= 0.10),
  ``sim_max_abs_rel_error`` (goal <= 0.20), ``sim_runs`` (the per-run table) and a PNG of predicted vs measured
  (``<out>_sim.png``). Under emulation compute is stretched to the declared speeds but communication is real
  gloo on localhost, so the prediction uses this machine's calibrated gloo costs, not the declared links.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._launch import launch  # noqa: E402
from benchmarks._planner_sim import RUNS, simulator_part  # noqa: E402

PARTS = ("sim",)


def plot_sim(table: list[dict], path: str) -> None:
    """Predicted vs measured step time, one point per run, with the +-10% and +-20% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    xs = [r["measured_step_s"] for r in table]
    ys = [r["predicted_step_s"] for r in table]
    top = max(xs + ys) * 1.15
    ax.plot([0, top], [0, top], "k-", lw=1, label="exact")
    for f, style in ((0.1, "--"), (0.2, ":")):
        ax.plot([0, top], [0, top * (1 + f)], "g" + style, lw=0.8, label=f"+-{f:.0%}")
        ax.plot([0, top], [0, top * (1 - f)], "g" + style, lw=0.8)
    ax.scatter(xs, ys, c="C0")
    for r, x, y in zip(table, xs, ys, strict=True):
        ax.annotate(r["run"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step time, s (median, slowest rank)")
    ax.set_ylabel("predicted step time, s (whale simulator)")
    ax.set_title("Step time: simulator vs measured (EMULATED V100/P100 on CPU)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_sim(part: dict) -> None:
    """The per-run table."""
    print(f"{'run':>18} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for r in part["sim_runs"]:
        print(f"{r['run']:>18} {r['measured_step_s']:>10.4f} {r['predicted_step_s']:>11.4f} {r['rel_error']:>+7.1%}")
    print(f"median |error| {part['sim_median_abs_rel_error']:.3f} (goal <= 0.10), "
          f"max {part['sim_max_abs_rel_error']:.3f} (goal <= 0.20)", flush=True)


def main() -> None:
    """Run the parts, print the tables, write the JSON (after each part) and the PNG."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--skip", default="", help=f"comma list of parts to skip: {','.join(PARTS)}")
    p.add_argument("--runs", default=",".join(RUNS), help="sim part: comma list of runs")
    p.add_argument("--steps", type=int, default=8, help="sim part: measured steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cores", type=float, default=0.25,
                   help="sim part: WHALE_EMULATION_CORES; below the real 2 stretches compute further, so that "
                        "other processes on a shared machine do not show through the emulated times")
    args = p.parse_args()
    skip = set(args.skip.split(",")) - {""}
    out: dict = {}
    if os.path.exists(args.out):  # parts not run this time keep their earlier results
        with open(args.out) as f:
            out = json.load(f)
    t0 = time.time()

    def write() -> None:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)

    if "sim" not in skip:
        part = simulator_part(launch, args.runs.split(","), args.warmup, args.steps, args.cores)
        png = os.path.splitext(args.out)[0] + "_sim.png"
        plot_sim(part["sim_runs"], png)
        out.update(part, sim_png=png, sim_wall_s=time.time() - t0)
        print_sim(part)
        write()
    write()
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
