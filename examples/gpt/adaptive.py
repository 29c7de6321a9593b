"""The GPT example's run-time adaptation: a checkpoint interval from the measured save cost (``--ckpt-every auto``),
an emulated device slowed down mid-run (``--slowdown-at``) and straggler re-balancing (``--stragglers``).

The decisions are the library's: :func:`whale.planner.ckpt_interval.checkpoint_interval` and
:class:`whale.elastic.straggler.StragglerController`; this module wires them into the training loop
(:meth:`Adaptive.after_step`, :meth:`Adaptive.save_due`, :meth:`Adaptive.timed_save`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

import whale as wh
from whale.elastic.straggler import StragglerController, slow_down
from whale.planner.ckpt_interval import checkpoint_interval

AUTO_FIRST_SAVE = 3
"""``--ckpt-every auto``: the first checkpoint follows this step; its save and these steps are measured."""


def ckpt_every(text: str):
    """``--ckpt-every``: an int >= 0, or ``auto``."""
    if text == "auto":
        return text
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 or auto, got {value}")
    return value


def slowdown_at(text: str) -> tuple[int, int, float]:
    """``--slowdown-at STEP:RANK:FACTOR``: after step STEP, rank RANK's emulated device is FACTOR x slower."""
    try:
        step, rank, factor = text.split(":")
        out = int(step), int(rank), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be STEP:RANK:FACTOR, e.g. 20:1:3, got {text!r}") from None
    if out[0] < 0 or out[1] < 0 or not out[2] > 0:
        raise argparse.ArgumentTypeError(f"needs STEP >= 0, RANK >= 0 and FACTOR > 0, got {text!r}")
    return out


def add_adaptive_args(a) -> None:
    """The flags; ``a`` is ``add_argument`` (``--ckpt-every`` itself is the training script's)."""
    a("--max-lost-seconds", type=float, default=60.0,
      help="--ckpt-every auto: a failure loses at most this many seconds of work")
    a("--max-save-overhead", type=float, default=0.1,
      help="--ckpt-every auto: at most this share of training time spent saving (wins when the two conflict)")
    a("--slowdown-at", type=slowdown_at, action="append", default=[], metavar="STEP:RANK:FACTOR",
      help="emulated cluster: after step STEP, rank RANK's device is FACTOR times slower (repeatable)")
    a("--stragglers", action="store_true",
      help="re-balance the data-parallel shares when the measured step times show a straggler (whale.elastic)")
    a("--straggler-every", type=int, default=5, help="--stragglers: check every N steps (median over N steps)")
    a("--straggler-threshold", type=float, default=0.05, help="--stragglers: smallest predicted gain that switches")


class Adaptive:
    """Per-run state of the adaptations (every rank has one; its calls are collective where the steps are).

    Args:
        args: the parsed flags; engine: the engine; batches: the loader (its ``rows`` follow a switch);
        end: the run's last step.
    """

    def __init__(self, args, engine: wh.Engine, batches, end: int) -> None:
        self.args, self.engine = args, engine
        self.auto = args.ckpt_every == "auto"
        self.every = None if self.auto else args.ckpt_every
        self.next_save = None
        self.step_times: list[float] = []
        self.record: dict = {"step_times": self.step_times}
        loads = engine.stage in (0, engine.plan.num_stages - 1)

        def rows(plan) -> None:
            if not args.global_batches:
                batches.rows = wh.local_rows(plan, engine.rank, args.batch_size) if loads else []
        self.controller = (StragglerController(args.batch_size, end, on_switch=rows, every=args.straggler_every,
                                               window=args.straggler_every, threshold=args.straggler_threshold,
                                               log=print) if args.stragglers else None)

    def after_step(self, done: int, metrics: dict) -> None:
        """After step ``done``: inject the slowdowns due, let the straggler controller check."""
        self.step_times.append(metrics["step_time"])
        for step, rank, factor in self.args.slowdown_at:
            if step == done and rank == self.engine.rank:
                new = slow_down(self.engine, factor)
                print(f"after step {done}: rank {rank}'s emulated device is {factor:g}x slower (slowdown {new:.2f})",
                      flush=True)
        if self.controller is not None:
            self.controller.after_step(self.engine, metrics)
            self.record["straggler_events"] = self.controller.events

    def save_due(self, done: int, end: int) -> bool:
        """Whether to checkpoint after step ``done`` (the final save is the script's)."""
        if done == end:
            return False
        if self.auto:
            return done == (self.next_save or AUTO_FIRST_SAVE)
        return bool(self.every) and done % self.every == 0

    def timed_save(self, save, done: int) -> None:
        """Run ``save()``; under ``--ckpt-every auto`` the first save's cost (the slowest rank's) and the median
        step so far choose the interval, printed once."""
        t0 = time.perf_counter()
        save()
        self.record.setdefault("saved_steps", []).append(done)
        if not self.auto:
            return
        if self.every is not None:
            self.next_save = done + self.every
            return
        mine = (statistics.median(self.step_times[-AUTO_FIRST_SAVE:]), time.perf_counter() - t0)
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        step_s, save_s = max(e[0] for e in every), max(e[1] for e in every)
        choice = checkpoint_interval(step_s, save_s, self.args.max_lost_seconds, self.args.max_save_overhead)
        self.every, self.next_save = choice.steps, done + choice.steps
        self.record["ckpt_interval"] = dict(steps=choice.steps, bound=choice.bound, step_s=step_s, save_s=save_s,
                                            lost_s=choice.lost_seconds, overhead=choice.overhead)
        if self.engine.rank == 0:
            print(f"--ckpt-every auto: step {step_s:.3f} s, save {save_s:.3f} s: {choice.describe()}", flush=True)
