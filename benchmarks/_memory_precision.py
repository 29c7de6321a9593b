"""bf16 vs fp32 on the GPT main job: the same run (data, seed, plan) twice, compared by held-out loss.

Runs ``examples/gpt/train.py`` under ``whale launch`` (4 ranks, the emulated V100/P100 cluster of
``make train``) for ``steps`` optimizer steps in ``--precision fp32`` and ``--precision bf16``; the gap is
``|final held-out loss (bf16) - final held-out loss (fp32)|`` in nats (the fixed held-out set of the job's
``--eval-batches``), with the last 20 steps' mean training loss beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(__file__), "..")
CLUSTER = os.path.join(ROOT, "examples", "clusters", "v100_p100.yaml")


def _run(precision: str, steps: int, out_dir: str, timeout: float = 1500) -> dict:
    """One GPT run (at most ``timeout`` seconds); returns its JSON summary."""
    summary = os.path.join(out_dir, f"{precision}.json")
    cmd = [sys.executable, "-m", "whale.cli", "launch", "-n", "4", "--cluster", CLUSTER, "examples/gpt/train.py",
           "--steps", str(steps), "--precision", precision, "--summary", summary, "--no-progress",
           "--eval-every", "0", "--sample-tokens", "0", "--tensorboard", "",
           "--ckpt-dir", os.path.join(out_dir, f"ckpt-{precision}")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(summary) as f:
        return json.load(f)


def precision_gap(steps: int = 200, timeout: float = 1500) -> dict:
    """Run fp32 and bf16 (each at most ``timeout`` seconds); return the gap and both runs' numbers (nats,
    tokens/s)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: _run(p, steps, tmp, timeout) for p in ("fp32", "bf16")}

    def tail(r: dict) -> float:
        """Mean training loss over the last 20 steps."""
        losses = [x[1] if isinstance(x, list | tuple) else x for x in r["train_loss"]][-20:]
        return sum(losses) / len(losses)

    out = {p: {"final_val_loss": r["final_val_loss"], "initial_val_loss": r["initial_val_loss"],
               "train_loss_last20_mean": tail(r), "tokens_per_s": r["tokens_per_s"], "steps": r["steps"]}
           for p, r in runs.items()}
    out["bf16_vs_fp32_final_loss_gap"] = abs(runs["bf16"]["final_val_loss"] - runs["fp32"]["final_val_loss"])
    out["train_loss_last20_gap"] = abs(out["bf16"]["train_loss_last20_mean"] - out["fp32"]["train_loss_last20_mean"])
    return out


if __name__ == "__main__":
    print(json.dumps(precision_gap(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
                                   float(sys.argv[2]) if len(sys.argv) > 2 else 1500), indent=1))
