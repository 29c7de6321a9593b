"""Reliability (issue 15): resharding checkpoints, kill -9 and resume, a raising rank.

    PYTHONPATH=src:. python benchmarks/reliability.py --out benchmarks/results/reliability.json

1. ``reshard_pairs_ok`` / ``reshard_pairs_total``: every ordered pair (source, target) of the layouts {DP4,
   DP2xPP2, PP4 with a tied weight, DP2 with a split head of uneven shards, 1 rank} (tests/reshard_models.py):
   train 2 steps under the source, save, load under the target; a pair is ok when every parameter, optimizer
   state tensor, the hyperparameters, the step, the RNG state and ``extra`` are bitwise equal.
2. ``kill_resume_*``: the GPT main job (examples/gpt/train.py, a small configuration, DP2xPP2 on 4 ranks,
   checkpoint every ``--ckpt-every`` steps) runs once uninterrupted; then ``--runs`` times under
   ``whale launch --max-restarts 1``, each with one random worker killed with SIGKILL at a random step. torchrun
   restarts the worker group, which resumes from the last complete checkpoint by itself. The loss of every step
   (the run's JSON summary: the steps before the kill come from the checkpoint, the rest are recomputed) is
   compared with the uninterrupted run's; steps lost = last step logged before the kill - step resumed from.
3. ``raise_to_exit_seconds_max``: benchmarks/_raise_job.py on 4 ranks under ``whale launch`` with one rank
   raising mid-training; seconds from the raise to the launcher's exit, and whether the injected error is
   printed exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
GPT = ["--batch-size", "8", "--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
       "--micro-batches", "2", "--stages", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
       "--tensorboard", "", "--no-progress", "--log-every", "1", "--timeout", "60"]


def reshard(tmp: str) -> dict:
    """Run the full layout matrix; returns the counts and the failing pairs."""
    sys.path.insert(0, str(ROOT))
    from tests.reshard_models import LAYOUTS, matrix

    start = time.perf_counter()
    results = matrix(tmp, list(LAYOUTS), {t: list(LAYOUTS) for t in LAYOUTS})
    bad = {f"{s}->{t}": p[:3] for (s, t), p in results.items() if p}
    return {"reshard_pairs_ok": len(results) - len(bad), "reshard_pairs_total": len(results),
            "reshard_failures": bad, "reshard_seconds": round(time.perf_counter() - start, 1)}


def _gpt(tmp: Path, name: str, args) -> list[str]:
    return [PY, "-m", "whale.cli", "launch", "-n", "4", "--max-restarts", "1", str(ROOT / "examples/gpt/train.py"),
            *GPT, "--data-dir", args.data_dir, "--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every),
            "--ckpt-dir", str(tmp / name / "ckpt"), "--summary", str(tmp / name / "summary.json"), "--resume"]


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _killed_run(tmp: Path, name: str, kill_at: int, args, rng: random.Random) -> dict:
    """One run with a worker killed after step ``kill_at`` is logged; returns the run's numbers."""
    proc = subprocess.Popen(_gpt(tmp, name, args), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log, killed, last, resumed = [], None, 0, None
    for line in proc.stdout:
        log.append(line)
        m = re.match(r"step (\d+)/", line)
        if m:
            last = int(m.group(1))
        r = re.search(r"resumed after a restart from .* at step (\d+)|restarted with no complete checkpoint", line)
        if r:
            resumed = int(r.group(1) or 0)
        if killed is None and last >= kill_at:
            victims = _workers(proc.pid)
            if victims:
                victim = rng.choice(victims)
                os.kill(victim, signal.SIGKILL)
                killed = {"step": last, "pid": victim}
    code = proc.wait()
    text = "".join(log)
    if code != 0 or killed is None or resumed is None:
        raise RuntimeError(f"run {name}: exit {code}, killed {killed}, resumed {resumed}:\n{text[-4000:]}")
    summary = json.loads((tmp / name / "summary.json").read_text())
    return {"kill_after_step": killed["step"], "resumed_from": resumed, "steps_lost": killed["step"] - resumed,
            "train_loss": summary["train_loss"]}


def kill_resume(tmp: Path, args) -> dict:
    """The uninterrupted run, then ``args.runs`` killed and restarted runs."""
    base = subprocess.run(_gpt(tmp, "base", args), cwd=ROOT, env=ENV, capture_output=True, text=True)
    if base.returncode:
        raise RuntimeError(base.stdout[-3000:] + base.stderr[-3000:])
    reference = json.loads((tmp / "base" / "summary.json").read_text())["train_loss"]
    rng = random.Random(args.seed)
    runs = []
    for i in range(args.runs):
        at = rng.randint(args.ckpt_every // 2 + 1, args.steps - 2)
        run = _killed_run(tmp, f"run{i}", at, args, rng)
        diff = max(abs(a - b) for a, b in zip(run.pop("train_loss"), reference, strict=True))
        runs.append({**run, "max_loss_diff": diff})
        print(f"kill/resume run {i}: {runs[-1]}", flush=True)
    return {"kill_resume_runs": len(runs), "kill_resume_max_loss_diff": max(r["max_loss_diff"] for r in runs),
            "kill_resume_steps_lost_max": max(r["steps_lost"] for r in runs), "kill_resume_details": runs,
            "checkpoint_interval": args.ckpt_every, "gpt_steps": args.steps}


def raise_to_exit(runs: int, timeout: float) -> dict:
    """Seconds from an injected raise to the launcher's exit, over ``runs`` runs; the error printed once?"""
    times, once = [], True
    for i in range(runs):
        cmd = [PY, "-m", "whale.cli", "launch", "-n", "4", str(ROOT / "benchmarks/_raise_job.py"),
               "--raise-rank", str(1 + i % 3), "--raise-step", "3", "--timeout", str(timeout)]
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
        end = time.time()
        out = proc.stdout + proc.stderr
        at = float(re.search(r"RAISE_AT ([\d.]+)", out).group(1))
        times.append(end - at)
        once &= proc.returncode != 0 and out.count("RuntimeError: injected failure") == 1
    return {"raise_to_exit_seconds_max": max(times), "raise_to_exit_seconds": times,
            "raise_error_printed_once": once, "collective_timeout_s": timeout}


def main() -> None:
    """Run the three parts and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/reliability.json")
    p.add_argument("--runs", type=int, default=5, help="killed GPT runs")
    p.add_argument("--steps", type=int, default=24, help="GPT steps per run")
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=str(ROOT / "data/shakespeare"))
    p.add_argument("--skip", nargs="*", default=[], choices=["reshard", "kill", "raise"])
    args = p.parse_args()
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "reshard" not in args.skip:
            result.update(reshard(os.path.join(tmp, "reshard")))
            print({k: v for k, v in result.items() if k.startswith("reshard")}, flush=True)
        if "raise" not in args.skip:
            result.update(raise_to_exit(3, timeout=10.0))
            print({k: v for k, v in result.items() if k.startswith("raise")}, flush=True)
        if "kill" not in args.skip:
            result.update(kill_resume(Path(tmp), args))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("details")}, indent=2))


if __name__ == "__main__":
    main()
