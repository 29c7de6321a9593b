"""The GPT job's learning-rate schedule (linear warmup, cosine to lr/10 at the horizon, lr/10 after it) and what a
resumed run says about it. No processes: plain functions of the step and the flags."""

from __future__ import annotations

import argparse
import math


def lr_horizon(args: argparse.Namespace, saved: dict | None = None) -> dict:
    """The learning-rate schedule's horizon ``{"steps", "warmup"}``: a resumed run keeps its checkpoint's, so
    the rate continues where it was (a longer run then stays at the final rate) instead of jumping back."""
    if saved:
        return dict(saved)
    return {"steps": args.steps, "warmup": args.warmup if args.warmup is not None else max(1, args.steps // 20)}


def lr_at(step: int, args: argparse.Namespace, horizon: dict | None = None) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine from lr to lr/10 at the
    horizon's last step, lr/10 after it."""
    h = horizon or lr_horizon(args)
    if step < h["warmup"]:
        return args.lr * (step + 1) / h["warmup"]
    progress = min(1.0, (step - h["warmup"]) / max(1, h["steps"] - h["warmup"]))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def resume_note(start: int, steps: int, horizon: int, final_lr: float, ckpt_dir: str = "the checkpoint") -> str | None:
    """What a run resumed at step ``start`` of ``--steps steps`` says about its schedule, or ``None`` (nothing
    to say: a fresh run, or the checkpoint's horizon is this run's ``steps``).

    Steps are counted as completed optimizer steps: the run trains steps ``start+1..steps`` (1-based); the cosine
    reaches ``final_lr`` at step ``horizon`` of the run that saved the checkpoint and stays there.

    Returns:
        "nothing to do" when ``start >= steps``; otherwise, for a horizon before ``steps``, which of this run's
        steps run at the final rate (all of them when the horizon is already behind); for a horizon after
        ``steps``, that this run stops before the cosine ends.
    """
    if start >= steps:
        return (f"nothing to do: {ckpt_dir} is already at step {start} and --steps is {steps}; pass --steps "
                f"larger than {start} to train further")
    if start == 0 or horizon == steps:
        return None
    keep = f"the learning-rate schedule keeps the checkpoint's horizon: cosine to {final_lr:.1e} by step {horizon}"
    if horizon <= start:
        return f"{keep}; all of this run's steps ({start + 1}-{steps}) run at that final rate"
    if horizon < steps:
        return f"{keep}; steps {horizon + 1}-{steps} run at that final rate"
    return f"{keep}; this run stops at step {steps}, before the cosine reaches it"
