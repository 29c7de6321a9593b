"""Measured pipeline bubble vs theory (p-1)/(m+p-1) on equal stages, one rank per CPU core.

Each stage holds the same number of identical MLP blocks; the loss is a cheap mean square. For every
(schedule, micro-batch count) the idle share of each stage's schedule time (forward/backward work plus the
waits between, without gradient sync and optimizer) is compared with theory, and with the event simulator
fed the measured per-micro-batch forward/backward times.

    python benchmarks/pipeline_bubble.py --out benchmarks/results/pipeline_bubble.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class Block(nn.Module):
    """x + W2 gelu(W1 x), [B, d] -> [B, d]."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Pipe(nn.Module):
    """``stages`` replicate(1) TaskGraphs of ``per_stage`` equal blocks each."""

    def __init__(self, d: int, stages: int, per_stage: int) -> None:
        super().__init__()
        import whale as wh

        blocks = []
        for _ in range(stages):
            with wh.replicate(1):
                blocks += [Block(d) for _ in range(per_stage)]
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x):
        return self.blocks(x)


def _worker(rank, world, init_file, args, q):
    import whale as wh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = []
    for schedule in ("1F1B", "GPipe"):
        for m in args.micro_batches:
            ctx = wh.init(wh.Config(num_micro_batch=m, schedule=schedule, seed=0))
            eng = wh.parallelize(Pipe(args.dim, world, args.blocks), F.mse_loss,
                                 lambda ps: torch.optim.SGD(ps, lr=1e-3), ctx=ctx)
            x = torch.randn(args.rows * m, args.dim)
            for _ in range(args.warmup):
                eng.step((x, x))
            idle = []
            for _ in range(args.steps):
                r = eng.step((x, x))
                idle.append(1 - r["busy_time"] / r["schedule_time"])
            gathered = [None] * world
            dist.all_gather_object(gathered, statistics.median(idle))
            if rank == 0:
                results.append({"schedule": schedule, "micro_batches": m, "stages": world,
                                "idle_share": gathered, "theory": (world - 1) / (m + world - 1)})
    if rank == 0:
        q.put(results)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="ranks = stages (keep <= CPU cores)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args.stages, os.path.join(tmp, "s"), args, q))
                 for r in range(args.stages)]
        for proc in procs:
            proc.start()
        results = q.get(timeout=1800)
        for proc in procs:
            proc.join()
    print(f"{'schedule':>8} {'m':>3} {'theory':>7}  measured idle share per stage   worst rel. error")
    for r in results:
        err = max(abs(i - r["theory"]) / r["theory"] for i in r["idle_share"])
        r["max_rel_error"] = err
        shares = "  ".join(f"{i:.3f}" for i in r["idle_share"])
        print(f"{r['schedule']:>8} {r['micro_batches']:>3} {r['theory']:>7.3f}  {shares:<30} {err:>8.1%}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
