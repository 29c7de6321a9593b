"""The GPT job's pipeline-schedule flags: ``--schedule {gpipe,1f1b,interleaved,zb}``, ``--virtual-stages V`` and
``--trace FILE``. No processes: argument parsing and checks of the flags alone."""

from __future__ import annotations

import argparse

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb": "ZB-H1",
                  "zb-h1": "ZB-H1", "interleaved1f1b": "Interleaved1F1B"}
"""Flag value (any case) -> Whale's schedule name (:data:`whale.plan.schedule.RUNNABLE_SCHEDULES`)."""


def _schedule(text: str) -> str:
    name = SCHEDULE_NAMES.get(text.lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown schedule {text!r}; choose gpipe, 1f1b, interleaved or zb")
    return name


def add_schedule_args(a) -> None:
    """The schedule flags; ``a`` is ``add_argument``."""
    a("--schedule", type=_schedule, default="1F1B", metavar="{gpipe,1f1b,interleaved,zb}",
      help="pipeline schedule: GPipe, 1F1B (default), interleaved 1F1B (--virtual-stages chunks per stage; "
           "micro-batches a multiple of --stages) or zb (zero-bubble ZB-H1: weight gradients fill the bubble)")
    a("--virtual-stages", type=int, default=None, metavar="V",
      help="model chunks per pipeline stage under --schedule interleaved (default 2): the model is built in "
           "stages x V chunks, chunk c on stage c %% stages")
    a("--trace", default=None, metavar="FILE",
      help="write the last training step of every rank (forward, backward, weight-gradient, send/recv, "
           "all-reduce, idle) and the simulator's predicted step as a Chrome/Perfetto trace JSON (rank 0)")


def check_schedule_args(args: argparse.Namespace) -> str | None:
    """Fill ``args.virtual_stages`` (2 under interleaved, else 1) and return the one-line error of a bad
    combination, or ``None``."""
    interleaved = args.schedule == "Interleaved1F1B"
    if args.virtual_stages is None:
        args.virtual_stages = 2 if interleaved else 1
    if args.virtual_stages < 1:
        return f"--virtual-stages {args.virtual_stages} must be >= 1"
    if args.virtual_stages > 1 and not interleaved:
        return f"--virtual-stages {args.virtual_stages} needs --schedule interleaved (got {args.schedule})"
    if interleaved and args.virtual_stages < 2:
        return "--schedule interleaved needs --virtual-stages >= 2 (1 chunk per stage is plain 1F1B: use 1f1b)"
    if interleaved and args.stages < 2:
        return "--schedule interleaved needs --stages >= 2"
    if interleaved and args.micro_batches % args.stages:
        lo = max(args.stages, args.micro_batches - args.micro_batches % args.stages)
        return (f"--schedule interleaved needs --micro-batches a multiple of --stages {args.stages}, got "
                f"{args.micro_batches}; use {lo} or {lo + args.stages}")
    chunks = args.stages * args.virtual_stages
    if chunks > args.n_layer:
        return (f"--stages {args.stages} x --virtual-stages {args.virtual_stages} = {chunks} chunks but the model "
                f"has --n-layer {args.n_layer} blocks; use at least {chunks} layers or fewer chunks")
    return None
