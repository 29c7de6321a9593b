"""Where a Whale pipeline step spends its time beside ``torch.distributed.pipelining``'s, per rank (a profile).

The cases of :mod:`benchmarks.vs_torch_pipelining` (2 stages, gloo, one thread per rank; by default dim 512,
256 rows per micro-batch, 4 micro-batches, 1F1B and ZB-H1), the two frameworks' steps in ABBA order between
barriers. Per rank and framework, the median over steps of (milliseconds):

- ``step``: the whole step between barriers; ``schedule``: Whale's ``executor.run`` / torch's
  ``schedule.step``; ``after``: the step less its schedule (gradient sync, loss all-reduce, NaN/inf check,
  optimizer, zeroing; and Whale's batch slicing before it);
- per action kind (F, B, W; Whale's B of ZB-H1 is its input-gradient pass) the compute summed over the step
  (Whale: its timeline; torch: ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``),
  and ``wait`` = the schedule less that compute (receives, sends, bubbles).

Absolute times on a shared CPU host mean little; read the two columns of one rank side by side.

    python benchmarks/pipeline_overheads.py --schedules 1F1B ZB-H1 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._launch import launch  # noqa: E402
from benchmarks._torch_timing import TIMES as _CUR  # noqa: E402
from benchmarks._torch_timing import torch_timers as _torch_timers  # noqa: E402
from benchmarks._torch_timing import wrap as _wrap  # noqa: E402
from benchmarks.pipeline_bubble import Pipe  # noqa: E402
from benchmarks.vs_torch_pipelining import _torch_runner, _whale_runner  # noqa: E402

EXTRA = ("batch", "sync", "update", "memory", "optim", "finite")
"""Whale's parts of ``after`` (ms): batch slicing, gradient sync, the update (loss all-reduce, NaN/inf check,
optimizer, zeroing), the memory monitor's step end; within the update the optimizer and the NaN/inf check."""


def _case(rank: int, world: int, args, schedule: str) -> dict:
    """Both frameworks on one schedule; per framework the median per step of each part (ms)."""
    torch.manual_seed(args.seed)
    model = Pipe(args.dim, world, args.blocks)
    whale_step = _whale_runner(copy.deepcopy(model), schedule, args)
    torch_step = _torch_runner(copy.deepcopy(model), schedule, rank, world, args)
    engine, cur = whale_step.engine, _CUR
    _wrap(engine.executor, "run", cur, "schedule")
    for obj, name, key in ((engine, "_checked_micro_batches", "batch"), (engine.grad_sync, "finish", "sync"),
                           (engine, "_apply_gradients", "update"), (engine.memory, "end_step", "memory"),
                           (engine.optimizer, "step", "optim"), (engine.nonfinite, "local", "finite")):
        _wrap(obj, name, cur, key)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.rows * args.micro_batches, args.dim, generator=g)
    y = torch.randn(args.rows * args.micro_batches, args.dim, generator=g)
    rec: dict = {"whale": defaultdict(list), "torch": defaultdict(list)}
    for i in range(args.warmup + args.steps):
        for name in (("whale", "torch") if i % 2 == 0 else ("torch", "whale")):
            cur.clear()
            dist.barrier()
            t0 = time.perf_counter()
            (whale_step if name == "whale" else torch_step)(x, y)
            dist.barrier()
            total = time.perf_counter() - t0
            if name == "whale":
                for label, _, c0, c1 in engine.last_timeline:
                    cur[label[0]] += c1 - c0
            if i >= args.warmup:
                parts = rec[name]
                parts["step"].append(total)
                parts["after"].append(total - cur["schedule"])
                parts["wait"].append(cur["schedule"] - sum(cur[k] for k in "FBW"))
                for k in ("schedule", "F", "B", "W", *EXTRA):
                    parts[k].append(cur[k])
    return {name: {k: statistics.median(v) * 1e3 for k, v in parts.items()} for name, parts in rec.items()}


def worker(rank: int, world: int, args) -> list:
    """Every schedule on this rank; returns ``[(schedule, {framework: {part: ms}})]``."""
    _torch_timers()
    return [(s, _case(rank, world, args, s)) for s in args.schedules]


def main() -> None:
    """Launch 2 ranks and print the parts per rank."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", nargs="+", default=["1F1B", "ZB-H1"], choices=["GPipe", "1F1B", "ZB-H1"])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--virtual-stages", type=int, default=1, help=argparse.SUPPRESS)  # read by _whale_runner
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    per_rank = launch(worker, 2, args)
    keys = ("step", "schedule", "after", "F", "B", "W", "wait", *EXTRA)
    print(f"{'schedule':>8} rank {'framework':>9} " + " ".join(f"{k:>8}" for k in keys) + "   (ms, median)")
    for rank, cases in enumerate(per_rank):
        for schedule, rec in cases:
            for name, parts in rec.items():
                print(f"{schedule:>8} {rank:>4} {name:>9} " + " ".join(f"{parts[k]:>8.2f}" for k in keys))


if __name__ == "__main__":
    main()
