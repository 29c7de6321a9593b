"""bf16 vs fp32 on the GPT main job: the same run (data, seed, plan) in both precisions, compared by held-out
loss, beside the run-to-run noise floor of fp32 itself.

Runs ``examples/gpt/train.py`` under ``whale launch`` (4 ranks, the emulated V100/P100 cluster of
``make train``) for ``steps`` optimizer steps: ``--precision fp32`` and ``--precision bf16`` with the job's seed,
and ``--precision fp32`` with another seed (another initialisation and data order). The gap is ``|final held-out
loss (bf16) - final held-out loss (fp32)|`` in nats (the fixed held-out set of the job's ``--eval-batches``),
with the last 20 steps' mean training loss beside it; the noise floor is the same difference between the two
fp32 seeds. A 200-step run is short: where the loss is still falling fast, a small perturbation (bf16 rounding
or another seed) shifts when it falls, and the final loss with it. So the gap means something only when it is
compared with the noise floor at the same settings; ``lr`` sets the peak learning rate (the job's default is
tuned for its 600 steps).

The three runs go concurrently (one host): their losses do not depend on timing, only their speed does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(__file__), "..")
CLUSTER = os.path.join(ROOT, "examples", "clusters", "v100_p100.yaml")
SEED = 1337


def _start(precision: str, steps: int, lr: float, seed: int, out_dir: str) -> tuple[subprocess.Popen, str]:
    """Start one GPT run; returns the process and its JSON summary path."""
    name = f"{precision}-seed{seed}"
    summary = os.path.join(out_dir, f"{name}.json")
    cmd = [sys.executable, "-m", "whale.cli", "launch", "-n", "4", "--cluster", CLUSTER, "examples/gpt/train.py",
           "--steps", str(steps), "--precision", precision, "--lr", str(lr), "--seed", str(seed),
           "--summary", summary, "--no-progress", "--eval-every", "0", "--sample-tokens", "0",
           "--tensorboard", "", "--ckpt-dir", os.path.join(out_dir, f"ckpt-{name}")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), "HF_HUB_OFFLINE": "1"}
    log = open(os.path.join(out_dir, f"{name}.log"), "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), summary


def _finish(proc: subprocess.Popen, summary: str, timeout: float) -> dict:
    """Wait for a run (at most ``timeout`` seconds); returns its JSON summary."""
    rc = proc.wait(timeout=timeout)
    if rc != 0:
        with open(summary[:-len(".json")] + ".log") as f:
            raise RuntimeError(f"GPT run {summary} failed ({rc}):\n{f.read()[-3000:]}")
    with open(summary) as f:
        return json.load(f)


def _tail(r: dict) -> float:
    """Mean training loss over the last 20 steps."""
    losses = [x[1] if isinstance(x, list | tuple) else x for x in r["train_loss"]][-20:]
    return sum(losses) / len(losses)


def precision_gap(steps: int = 200, lr: float = 1e-3, timeout: float = 5400) -> dict:
    """Run fp32 and bf16 (seed 1337) and fp32 (seed 1338) concurrently, each at most ``timeout`` seconds; return
    the gap, the fp32 noise floor and each run's numbers (nats, tokens/s)."""
    runs = {"fp32": ("fp32", SEED), "bf16": ("bf16", SEED), "fp32_other_seed": ("fp32", SEED + 1)}
    with tempfile.TemporaryDirectory() as tmp:
        started = {k: _start(p, steps, lr, s, tmp) for k, (p, s) in runs.items()}
        done = {k: _finish(*v, timeout) for k, v in started.items()}
    out = {k: {"precision": runs[k][0], "seed": runs[k][1], "final_val_loss": r["final_val_loss"],
               "initial_val_loss": r["initial_val_loss"], "train_loss_last20_mean": _tail(r),
               "tokens_per_s": r["tokens_per_s"], "steps": r["steps"]} for k, r in done.items()}
    out["lr"] = lr
    out["bf16_vs_fp32_final_loss_gap"] = abs(done["bf16"]["final_val_loss"] - done["fp32"]["final_val_loss"])
    out["fp32_seed_to_seed_final_loss_gap"] = abs(done["fp32_other_seed"]["final_val_loss"]
                                                  - done["fp32"]["final_val_loss"])
    out["train_loss_last20_gap"] = abs(out["bf16"]["train_loss_last20_mean"] - out["fp32"]["train_loss_last20_mean"])
    return out


if __name__ == "__main__":
    print(json.dumps(precision_gap(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
                                   float(sys.argv[2]) if len(sys.argv) > 2 else 1e-3), indent=1))
