"""Exit teardown (issue 23): a valid 3+1-width pipeline run again and again under ``whale launch -n 4`` must exit 0.

    PYTHONPATH=src:. python benchmarks/exit_teardown.py --runs 20 --out benchmarks/results/exit_teardown.json

Each run is benchmarks/_width_exit_job.py (trains, evaluates, gathers the state dict, ends without destroying
the process group). Before Whale's context tore the groups down at exit, a run could die after training with
``terminate called without an active exception`` (exit code 134; measured on the shared 2-core host: 1 of 7 runs
of this job under load, 1 of 15 on a quieter host, and 7 of 15 runs of a plain-torch 4-rank job that ends right
after its collectives): a gloo worker thread released the last collective's work (whose tensors' Python objects
were already gone) while the interpreter was finalizing, and taking the GIL then ends the thread inside a
``noexcept`` destructor. Reports the exit codes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "_width_exit_job.py"
sys.path.insert(0, str(ROOT))
from benchmarks._provenance import Run  # noqa: E402


def run_once(timeout: float) -> tuple[int, bool, float]:
    """One launch: (exit code, whether 'terminate called' was printed, seconds)."""
    whale = Path(sys.executable).with_name("whale")
    cmd = [str(whale)] if whale.exists() else [sys.executable, "-m", "whale.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([*cmd, "launch", "-n", "4", str(JOB)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    out = proc.stdout + proc.stderr
    ok_lines = len(set(re.findall(r"rank (\d+) stage \d+ lane \d+: loss \S+ eval", out)))  # lines may interleave
    if proc.returncode == 0 and ok_lines != 4:
        raise RuntimeError(f"exit 0 but {ok_lines} of 4 ranks finished:\n{out[-2000:]}")
    return proc.returncode, "terminate called" in out, time.perf_counter() - start


def main() -> None:
    """Run the job ``--runs`` times; print and write the exit-code counts."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args()
    run = Run()
    codes, terminated, seconds = [], 0, []
    for i in range(args.runs):
        code, term, s = run_once(args.timeout)
        codes.append(code)
        terminated += term
        seconds.append(round(s, 1))
        print(f"run {i + 1}/{args.runs}: exit {code}{' (terminate called)' if term else ''}, {s:.1f} s", flush=True)
    counts = dict(collections.Counter(codes))
    result = {"runs": args.runs, "exit_codes": counts, "exit_0": counts.get(0, 0), "terminate_called": terminated,
              "seconds": seconds, "job": "benchmarks/_width_exit_job.py (TinyLM, stage widths 3+1, 4 ranks)"}
    if args.out:
        result = run.write(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
