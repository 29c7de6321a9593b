"""Straggler re-balancing (issue 29): one emulated device slows down mid-run, the job re-balances without restarting.

    PYTHONPATH=src:. python benchmarks/straggler.py --out benchmarks/results/straggler.json

Each run: the GPT example (tiny, ``--stages 1``, 2 ranks of the EMULATED examples/clusters/v100_p100_2.yaml: one
V100, one P100) through ``whale launch``, with ``--stragglers`` (the controller in whale.elastic.straggler checks
the median step times every 5 steps and switches at a predicted gain of 10% or more) and ``--slowdown-at
S:0:FACTOR``: after step S, drawn at random from 10, 15 and 20 (a check step, so that every check after it sees
only slow steps and every switch before it is the measured correction of the datasheet shares), the V100's
emulated device becomes ``FACTOR`` (4) times slower, so it is the straggler. Every step's seconds come from the
run's summary (rank 0). ``WHALE_EMULATION_CORES=0.5`` (``--emulation-cores``) stretches every rank's compute
4x more, so that on the shared host emulated device time rather than contention for its cores sets the step.

* ``straggler_speedup``: throughput after the re-balance over throughput before it (after the slowdown), per run
  the median step seconds of the steps between the slowdown and the first switch after it (its first slow step
  left out) over the median of the steps after that switch up to the next one or the end (its first step left
  out): two windows adjacent in time, so the ratio is paired within a run; the median over the runs with its IQR
  (benchmarks/_paired.py). Later switches (corrections from the re-measured speeds) are listed in ``details``.
* ``predicted_speedup``: the planner's prediction for that first switch (from the medians of the slow steps),
  per run and its median; ``measured_over_predicted`` the median of the per-run ratios.
* ``ckpt_interval``: each run's ``--ckpt-every auto`` choice (measured step and save seconds, the bound that won).

Timings are on a shared 2-core host (load average in the provenance) and are emulation, not real hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _paired import describe, quartiles, summary  # noqa: E402
from _provenance import Run  # noqa: E402

GPT = ["--batch-size", "16", "--seq-len", "64", "--n-layer", "2", "--n-head", "2", "--n-embd", "64",
       "--micro-batches", "1", "--stages", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
       "--tensorboard", "", "--no-progress", "--stragglers", "--straggler-every", "5", "--straggler-threshold", "0.1",
       "--ckpt-every", "auto",
       "--max-lost-seconds", "5"]


def one_run(tmp: Path, steps: int, slow_at: int, factor: float, data_dir: str, cores: str) -> dict:
    """One job; returns its step times, switches and the before/after windows (seconds per step)."""
    whale = Path(sys.executable).with_name("whale")
    cmd = [str(whale), "launch", "-n", "2", "--cluster", str(ROOT / "examples/clusters/v100_p100_2.yaml"),
           str(ROOT / "examples/gpt/train.py"), *GPT, "--data-dir", data_dir, "--steps", str(steps),
           "--slowdown-at", f"{slow_at}:0:{factor:g}", "--ckpt-dir", str(tmp / "ck"), "--summary",
           str(tmp / "s.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WHALE_EMULATION_CORES": cores}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"run failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    adaptive = json.loads((tmp / "s.json").read_text())["adaptive"]
    times = adaptive["step_times"]  # times[i]: step i + 1
    after_slow = [e for e in adaptive.get("straggler_events", []) if e["step"] > slow_at]
    out = {"slowdown_after_step": slow_at, "factor": factor, "switches": adaptive.get("straggler_events", []),
           "ckpt_interval": adaptive.get("ckpt_interval")}
    if not after_slow:
        return out | {"detected": False}
    first = after_slow[0]["step"]
    end = after_slow[1]["step"] if len(after_slow) > 1 else len(times)
    before = times[slow_at + 1:first]  # steps slow_at+2 .. first
    after = times[first + 1:end]  # steps first+2 .. the next switch (or the end)
    predicted = after_slow[0]["predicted_speedup"]
    b, a = statistics.median(before), statistics.median(after)
    return out | {"step_times": times, "detected": True, "detected_after_steps": first - slow_at, "before_s": b,
                  "after_s": a, "measured_speedup": b / a, "predicted_speedup": predicted}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--steps", type=int, default=45)
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--emulation-cores", default="0.5", help="WHALE_EMULATION_CORES for the jobs: fewer than the "
                   "host has stretches every rank's compute (here 4x at 2 ranks), so that emulated device time, not "
                   "the shared host's contention, sets the step")
    p.add_argument("--data-dir", default=str(ROOT / "data/shakespeare"))
    args = p.parse_args()
    run = Run()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            d = Path(tmp) / f"run{i}"
            d.mkdir()
            rows.append(one_run(d, args.steps, rng.choice([10, 15, 20]), args.factor, args.data_dir,
                                args.emulation_cores))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("switches", "step_times")}), flush=True)
    ok = [r for r in rows if r["detected"]]
    paired = summary([r["after_s"] for r in ok], [r["before_s"] for r in ok], goal=1.0,
                     names=("after re-balance", "before re-balance")) if ok else None
    predicted = [r["predicted_speedup"] for r in ok]
    result = {"runs": len(rows), "runs_detected": len(ok), "steps": args.steps, "slowdown_factor": args.factor,
              "emulation_cores": float(args.emulation_cores),
              "straggler_speedup": paired["median"] if paired else None, "straggler_speedup_paired": paired,
              "predicted_speedup": statistics.median(predicted) if ok else None,
              "predicted_speedup_iqr": list(quartiles(predicted)[::2]) if ok else None,
              "measured_over_predicted": statistics.median(r["measured_speedup"] / r["predicted_speedup"]
                                                           for r in ok) if ok else None,
              "emulated": True, "details": rows}
    run.write(args.out, result)
    if paired:
        print(f"straggler_speedup {describe(paired)}; predicted {result['predicted_speedup']:.3f}; "
              f"measured/predicted {result['measured_over_predicted']:.3f}")


if __name__ == "__main__":
    main()
