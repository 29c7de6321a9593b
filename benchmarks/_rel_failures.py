"""Reliability: is the first failure always named? (issue 24; wired into benchmarks/reliability.py)

``run(tmp)`` launches benchmarks/_raise_job.py under ``whale launch`` (2 ranks: a 2-stage pipeline; 3 ranks:
data parallel) with one injected failure per run, on a random rank at a random step (seeded):

* ``raise``: a ``RuntimeError`` whose text looks like a peer failure ("timed out", "Broken pipe", "Connection
  closed by peer", ...). Named ok when the launcher says that rank failed first with RuntimeError and the message
  is printed exactly once (its traceback);
* ``kill``: the rank SIGKILLs itself. Named ok when the launcher says that rank failed first, killed by signal 9;
* ``hang``: the rank hangs in its forward under ``--timeout HANG_TIMEOUT_S``. Named ok when the launcher says
  that rank stopped making progress at that step's ``forward micro-batch 0``; ``hang_detect_seconds`` is the
  worst time from the hang to the launcher's exit (goal: <= timeout + 5 s).

Returns ``{"first_error_named_ok", "first_error_named_tried", "hang_detect_seconds", "hang_timeout_s",
"first_error_failures": [what was printed where naming failed]}``.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANG_TIMEOUT_S = 5.0
MESSAGES = ("DataLoader worker (pid 4242) timed out after 5 seconds", "[Errno 32] Broken pipe writing the metrics",
            "Connection closed by peer while fetching shard 3 from the data server",
            "CUDA error: the launch timed out and was terminated", "Timed out waiting for the tokenizer service",
            "injected failure")
CASES = (("raise", 2), ("raise", 3), ("raise", 2), ("raise", 3), ("raise", 2), ("raise", 2), ("kill", 2),
         ("kill", 3), ("kill", 2), ("hang", 2), ("hang", 3), ("hang", 2))
"""(failure, world size) of each run: 12 injected failures."""


def _one(tmp: Path, mode: str, world: int, rng: random.Random, i: int) -> tuple[bool, float | None, str]:
    """Launch one failing job; ``(named ok, seconds from hang to exit or None, launcher's output tail)``."""
    rank, step = rng.randrange(world), rng.randrange(1, 4)
    message = MESSAGES[i % len(MESSAGES)]
    cmd = [sys.executable, "-m", "whale.cli", "launch", "-n", str(world), str(ROOT / "benchmarks/_raise_job.py"),
           "--raise-rank", str(rank), "--raise-step", str(step), "--mode", mode, "--steps", "6", "--message", message,
           "--timeout", str(HANG_TIMEOUT_S if mode == "hang" else 30.0)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    end, out = time.time(), proc.stdout + proc.stderr
    summary = next((ln for ln in out.splitlines() if "_raise_job.py FAILED:" in ln), "")
    if mode == "raise":
        ok = (f"FAILED: rank {rank} failed first (exit code 1) with RuntimeError; its error is printed above" in summary
              and out.count(f"error: [rank {rank}] RuntimeError: {message}") == 1
              and out.count("Traceback (most recent call last)") == 1)
    elif mode == "kill":
        ok = f"FAILED: rank {rank} failed first (killed by signal 9: SIGKILL)" in summary
    else:
        ok = bool(re.search(rf"FAILED: rank {rank} stopped making progress at step {step + 1}, forward micro-batch 0 ",
                            summary))
    started = re.search(r"RAISE_AT ([\d.]+)", out)
    hang_s = end - float(started.group(1)) if mode == "hang" and started else None
    return ok, hang_s, f"{mode} world {world} rank {rank} step {step}: {summary or out[-1500:]}"


def run(tmp: Path) -> dict:
    """Run :data:`CASES` (seeded); see the module docstring for what is returned."""
    rng = random.Random(24)
    ok, hangs, bad = 0, [], []
    for i, (mode, world) in enumerate(CASES):
        named, hang_s, said = _one(Path(tmp), mode, world, rng, i)
        ok += named
        if hang_s is not None:
            hangs.append(hang_s)
        if not named:
            bad.append(said)
    return {"first_error_named_ok": ok, "first_error_named_tried": len(CASES),
            "hang_detect_seconds": round(max(hangs), 2) if hangs else None, "hang_timeout_s": HANG_TIMEOUT_S,
            "first_error_failures": bad}


if __name__ == "__main__":
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run(Path(d)), indent=1))
