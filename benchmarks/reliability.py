"""Reliability (issues 15, 24): resharding checkpoints, kill -9 and resume, a raising rank, damaged checkpoints,
failure attribution and hangs, checkpoint I/O.

    PYTHONPATH=src:. python benchmarks/reliability.py --out benchmarks/results/reliability.json

1. ``reshard_pairs_ok`` / ``reshard_pairs_total``: every ordered pair (source, target) of the layouts {DP4,
   DP2xPP2, PP4 with a tied weight, DP2 with a split head of uneven shards, 1 rank} (tests/reshard_models.py):
   train 2 steps under the source, save, load under the target; a pair is ok when every parameter, optimizer
   state tensor, the hyperparameters, the step, the RNG state and ``extra`` are bitwise equal.
2. ``kill_resume_*``: the GPT main job (examples/gpt/train.py, a small configuration, DP2xPP2 on 4 ranks,
   checkpoint every ``--ckpt-every`` steps) runs once uninterrupted; then ``--runs`` times under
   ``whale launch --max-restarts 1``, each with one random worker killed with SIGKILL, cycling over three kill
   times: after a random step is logged, during a save (as soon as a ``.tmp-step-*`` directory exists after a
   random step), and after the final checkpoint is published (the restart must end the finished job with exit 0
   and its summary). torchrun restarts the worker group, which resumes from the last complete checkpoint by itself.
   The loss of every step (the run's JSON summary: the steps before the kill come from the checkpoint, the rest
   are recomputed) is compared with the uninterrupted run's; steps lost = last step logged before the kill - step
   resumed from; ``kill_resume_failures`` counts runs that did not exit 0 or whose losses differ by more than 1e-6.
3. ``raise_to_exit_seconds_max``: benchmarks/_raise_job.py on 4 ranks under ``whale launch`` with one rank
   raising mid-training; seconds from the raise to the launcher's exit, and whether the injected error is
   printed exactly once.
4. ``corrupt_latest_fallbacks_*`` (benchmarks/_rel_fallback.py): each kind of damage to the newest checkpoint;
   a load must fall back to the newest intact one, bitwise, naming what it skipped once.
5. ``first_error_named_*``, ``hang_detect_seconds`` (benchmarks/_rel_failures.py): injected raises (messages
   with "timed out" / "Broken pipe" texts), kill -9 of a rank and hangs; the launcher must name the rank that
   failed first (or hung, with its phase), and a hang must end within the timeout + 5 s.
6. ``save_gb_per_s``, ``load_gb_per_s``, ``busiest_rank_bytes_share`` (benchmarks/_rel_io.py): checkpoint I/O at
   2 and 4 ranks (goal for the share: <= 1.5 / ranks).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(1, str(ROOT))
import _rel_failures  # noqa: E402 - the parts beside this file
import _rel_fallback  # noqa: E402
import _rel_io  # noqa: E402

from benchmarks._provenance import PartsFile, Run  # noqa: E402

PARTS = ["reshard", "kill", "raise", "fallback", "failures", "io"]
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


def _watch_and_kill(proc, ckpt: Path, mode: str, rng: random.Random, steps: int, killed: dict) -> None:
    """Thread: in ``mode`` "save", SIGKILL a random worker as soon as a save is in progress (a ``.tmp-step-*``
    directory exists under ``ckpt``) once ``killed["armed"]`` is set; in "final", once ``latest`` names the final
    step's checkpoint (published, the job still finishing)."""
    final = f"step-{steps:08d}"
    while proc.poll() is None and "step" not in killed:
        hit = False
        if killed.get("armed") and ckpt.is_dir():
            if mode == "save":
                hit = any(d.name.startswith(".tmp-step-") for d in ckpt.iterdir())
            else:
                hit = (ckpt / "latest").is_file() and (ckpt / "latest").read_text().strip() == final
        victims = _workers(proc.pid) if hit else []
        if victims:
            victim = rng.choice(victims)
            os.kill(victim, signal.SIGKILL)
            killed.update(step=killed["last"], pid=victim)
            return
        time.sleep(0.002)


def _killed_run(tmp: Path, name: str, kill_at: int, mode: str, args, rng: random.Random) -> dict:
    """One run with a worker killed (``mode``: "step": after step ``kill_at`` is logged; "save": during the first
    save after it; "final": after the final checkpoint is published); returns the run's numbers."""
    proc = subprocess.Popen(_gpt(tmp, name, args), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log, killed, resumed = [], {"last": 0}, None
    if mode != "step":
        watcher = threading.Thread(target=_watch_and_kill, daemon=True,
                                   args=(proc, tmp / name / "ckpt", mode, rng, args.steps, killed))
        watcher.start()
    for line in proc.stdout:
        log.append(line)
        m = re.match(r"step (\d+)/", line)
        if m:
            killed["last"] = int(m.group(1))
        r = re.search(r"resumed after a restart from .* at step (\d+)|restarted with no complete checkpoint", line)
        if r:
            resumed = int(r.group(1) or 0)
        if killed["last"] >= kill_at and "armed" not in killed:
            killed["armed"] = True
            victims = _workers(proc.pid) if mode == "step" else []
            if victims:
                victim = rng.choice(victims)
                os.kill(victim, signal.SIGKILL)
                killed.update(step=killed["last"], pid=victim)
    code = proc.wait()
    text = "".join(log)
    out = {"mode": mode, "exit_code": code, "kill_after_step": killed.get("step"), "resumed_from": resumed}
    if code != 0 or "step" not in killed or resumed is None:  # every attempt's error lines, then the tail
        errors = [line for line in log if line.startswith(("error:", "Traceback")) or "Error:" in line]
        return {**out, "failure": "".join(errors[:40]) + "...\n" + text[-3000:]}
    summary = json.loads((tmp / name / "summary.json").read_text())
    return {**out, "steps_lost": killed["step"] - resumed, "train_loss": summary["train_loss"]}


def kill_resume(tmp: Path, args) -> dict:
    """The uninterrupted run, then ``args.runs`` killed and restarted runs, cycling over the kill modes (after a
    random step, during a save, after the final checkpoint)."""
    base = subprocess.run(_gpt(tmp, "base", args), cwd=ROOT, env=ENV, capture_output=True, text=True)
    if base.returncode:
        raise RuntimeError(base.stdout[-3000:] + base.stderr[-3000:])
    reference = json.loads((tmp / "base" / "summary.json").read_text())["train_loss"]
    rng = random.Random(args.seed)
    runs = []
    for i in range(args.runs):
        mode = ("step", "save", "final")[i % 3]
        at = rng.randint(args.ckpt_every // 2 + 1, args.steps - 2) if mode != "final" else args.steps
        run = _killed_run(tmp, f"run{i}", at, mode, args, rng)
        if "train_loss" in run:
            losses = run.pop("train_loss")
            run["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, reference, strict=True)) \
                if len(losses) == len(reference) else float("inf")
        runs.append(run)
        print(f"kill/resume run {i}: { {k: v for k, v in run.items() if k != 'failure'} }", flush=True)
    ok = [r for r in runs if "failure" not in r and r["max_loss_diff"] <= 1e-6]
    done = [r for r in runs if "failure" not in r]
    return {"kill_resume_runs": len(runs), "kill_resume_failures": len(runs) - len(ok),
            "kill_resume_max_loss_diff": max((r["max_loss_diff"] for r in done), default=None),
            "kill_resume_steps_lost_max": max((r["steps_lost"] for r in done), default=None),
            "kill_resume_modes": {m: sum(r["mode"] == m for r in runs) for m in ("step", "save", "final")},
            "kill_resume_details": runs, "checkpoint_interval": args.ckpt_every, "gpt_steps": args.steps}


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
    """Run the parts (``--skip`` some) and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/reliability.json")
    p.add_argument("--runs", type=int, default=21, help="killed GPT runs (cycling: after a step, during a save, "
                   "after the final checkpoint)")
    p.add_argument("--steps", type=int, default=24, help="GPT steps per run")
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=str(ROOT / "data/shakespeare"))
    p.add_argument("--skip", nargs="*", default=[], choices=PARTS)
    p.add_argument("--merge", action="store_true", help="keep the parts an earlier run wrote to --out (each with "
                   "its own provenance) unless rerun now")
    args = p.parse_args()
    run = Run()
    out = PartsFile(args.out, run, merge=args.merge)
    with tempfile.TemporaryDirectory() as tmp:
        for part, fn in (("fallback", _rel_fallback.run), ("failures", _rel_failures.run), ("io", _rel_io.run)):
            if part not in args.skip:
                os.makedirs(os.path.join(tmp, part))
                since = time.time()
                keys = fn(Path(tmp) / part)
                out.add(part, keys, since)
                print({k: v for k, v in keys.items() if not k.endswith("details")}, flush=True)
        for part, fn in (("reshard", lambda: reshard(os.path.join(tmp, "reshard"))),
                         ("raise", lambda: raise_to_exit(3, timeout=10.0)),
                         ("kill", lambda: kill_resume(Path(tmp), args))):
            if part not in args.skip:
                since = time.time()
                keys = fn()
                out.add(part, keys, since)
                print({k: v for k, v in keys.items() if not k.endswith("details")}, flush=True)
    run.stop()
    print(json.dumps({k: v for k, v in out.data.items() if not k.endswith("details")}, indent=2))


if __name__ == "__main__":
    main()
