"""The GPT main job, dense vs MoE at equal active compute per token: held-out and training loss vs step.

Both runs are ``examples/gpt/train.py`` with the same sizes, seed, data order, learning-rate schedule, steps and
tokens on the same Shakespeare corpus (``data/shakespeare``, ``make train``'s); they differ only in the blocks'
feed-forward:

- dense: each block's MLP, ``C -> 4C -> C`` (``8 C^2`` multiply-adds per token);
- MoE: ``--moe-experts E --moe-top-k 1`` with each expert ``C -> 4C -> C`` (Switch: top-1, the same
  ``8 C^2`` multiply-adds per token in the one expert a token visits; the router adds ``C x E``, ``E / (8 C)``
  of the MLP's, 0.8% for E = 8 at C = 128), dropless, load-balancing loss 0.01. So the active
  FLOPs per token are equal (up to the router) while the MoE holds E times the MLP parameters.

The held-out loss is the plain cross-entropy on a fixed set of ``--eval-batches`` held-out batches (the job's
``evaluate``; no aux loss); the training loss the job reports includes the MoE's aux loss (about 0.01 per layer).
Writes both curves and final losses to JSON (``--out``) and a PNG beside it (git-ignored).

    python benchmarks/moe_vs_dense.py --out benchmarks/results/moe_vs_dense.json   # ~6 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._provenance import Run  # noqa: E402


def _run(name: str, common: list[str], extra: list[str], workdir: Path, nproc: int) -> dict:
    """One training run of the main job; returns its JSON summary."""
    summary = workdir / f"{name}.json"
    job = [str(ROOT / "examples/gpt/train.py"), *common, *extra, "--summary", str(summary),
           "--ckpt-dir", str(workdir / f"ckpt_{name}"), "--overwrite"]  # a rerun starts afresh in its own workdir
    cmd = ([str(Path(sys.executable).with_name("whale")), "launch", "-n", str(nproc), *job] if nproc > 1
           else [sys.executable, *job])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(summary.read_text())
    out["bench_wall_s"] = time.time() - t0
    return out


def _plot(runs: dict, path: str) -> None:
    """Held-out loss (lines with markers) and training loss (thin, smoothed) vs step, dense and MoE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, r), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
        train, k = r["train_loss"], 10
        smooth = [sum(train[max(0, i - k + 1):i + 1]) / len(train[max(0, i - k + 1):i + 1]) for i in range(len(train))]
        ax.plot(range(1, len(train) + 1), smooth, color=color, alpha=0.4, lw=1, label=f"{name} train (10-step mean)")
        steps = [0] + [s for s, _ in r["val_curve"]]
        ax.plot(steps, [r["initial_val_loss"]] + [v for _, v in r["val_curve"]], "o-", color=color, ms=3,
                label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_title("GPT main job: dense vs MoE (top-1, equal active FLOPs per token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    """Train dense then MoE, print the final losses, write JSON (``--out``) and the PNG."""
    run = Run()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--out", default=None)
    a("--steps", type=int, default=500)
    a("--experts", type=int, default=8)
    a("--nproc", type=int, default=1, help="ranks per run (> 1: whale launch, experts split over them)")
    a("--data-dir", default=str(ROOT / "data" / "shakespeare"))
    a("--workdir", default=str(ROOT / "runs" / "moe_vs_dense"))
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(args.steps), "--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--seq-len", "64",
              "--batch-size", "16", "--stages", "1", "--micro-batches", "1", "--eval-every", "50",
              "--eval-batches", "8", "--data-dir", args.data_dir, "--sample-tokens", "0", "--tensorboard", "",
              "--no-progress", "--seed", "1337"]
    moe = ["--moe-experts", str(args.experts), "--moe-top-k", "1", "--moe-d-ff", "512", "--moe-aux-coef", "0.01"]
    runs = {"dense": _run("dense", common, [], workdir, args.nproc),
            f"MoE {args.experts}x top-1": _run("moe", common, moe, workdir, args.nproc)}
    out = {"config": {"common": common, "moe": moe, "nproc": args.nproc,
                      "active_ffn_flops_per_token": "equal: 2 x 2 x C x 4C (dense MLP) vs one expert of the same "
                                                    "width (top-1), plus the router's 2 x C x E"},
           "runs": {name: {k: r[k] for k in ("initial_val_loss", "final_val_loss", "val_curve", "train_loss",
                                             "tokens_per_s", "train_time_s", "steps", "bench_wall_s")}
                    for name, r in runs.items()}}
    names = list(runs)
    out["final_val_loss"] = {n: runs[n]["final_val_loss"] for n in names}
    out["final_train_loss_last10_mean"] = {n: sum(runs[n]["train_loss"][-10:]) / 10 for n in names}
    out["moe_minus_dense_final_val_loss"] = runs[names[1]]["final_val_loss"] - runs[names[0]]["final_val_loss"]
    print(f"{'run':<18} {'held-out start':>14} {'held-out final':>14} {'train (last 10)':>15} {'tok/s':>8}")
    for n in names:
        r = runs[n]
        print(f"{n:<18} {r['initial_val_loss']:>14.4f} {r['final_val_loss']:>14.4f} "
              f"{out['final_train_loss_last10_mean'][n]:>15.4f} {r['tokens_per_s']:>8.0f}")
    print(f"MoE - dense final held-out loss: {out['moe_minus_dense_final_val_loss']:+.4f} nats")
    if args.out:
        out = run.write(args.out, out)
        _plot(runs, os.path.splitext(args.out)[0] + ".png")
    return out


if __name__ == "__main__":
    main()
