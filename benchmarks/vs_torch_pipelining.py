"""Whale's pipeline vs ``torch.distributed.pipelining`` on the same model, stages, micro-batches and schedule.

Two stages (world 2, gloo, one CPU thread per rank), 4 micro-batches, GPipe and 1F1B, at a tiny model (dim 64,
~2-4 ms per micro-batch: per-step overheads dominate) and a larger one (dim 512, as in pipeline_bubble.py).
The model (``pipeline_bubble.Pipe``: ``--blocks`` MLP blocks per stage, each stage's blocks under
``wh.replicate(1)``) is built once from ``--seed``; Whale gets one deep copy (``wh.parallelize`` with
``wh.Config(num_micro_batch=4, schedule=...)``), torch another, cut into per-rank stage modules by hand
(``PipelineStage`` over this rank's blocks, ``ScheduleGPipe`` / ``Schedule1F1B``). Plain MSE on random data,
SGD (no momentum), the same fixed global batch every step.

Loss reductions agree: Whale's loss is the mean over the global batch (each micro-batch's per-sample mean
weighted by rows / global batch). torch computes ``F.mse_loss`` (a per-sample mean) per micro-batch and, with
``scale_grads=True`` (the default), divides the gradients by the number of micro-batches, so its gradients
are those of the mean of the micro-batch losses; micro-batches have equal rows, so that mean is the global
batch mean, and torch's step loss is reported as ``mean(losses)`` from its last stage.

Steps are paired (:mod:`benchmarks._paired`: rounds of one step each in ABBA order, warm-up rounds discarded)
so host drift hits both alike; each step is timed between barriers on both ranks.
``throughput_ratio_vs_torch_pipelining`` = the median over rounds of torch's step seconds / Whale's in the same
round (goal >= 1.0), with its IQR and ``goal_met`` (``"unclear"`` when the IQR straddles 1.0) in ``paired``.
A Whale step includes what its API returns (the global loss all-reduced to every rank); torch's
step is ``schedule.step`` + ``optimizer.step`` + ``zero_grad`` (its loss stays on the last stage and is
read outside the timed region).

    python benchmarks/vs_torch_pipelining.py --out benchmarks/results/vs_torch_pipelining.json
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._launch import launch  # noqa: E402
from benchmarks._paired import rounds, summary  # noqa: E402
from benchmarks._provenance import Run  # noqa: E402
from benchmarks.pipeline_bubble import Pipe  # noqa: E402

SCHEDULES = ("GPipe", "1F1B")


def _timed(fn) -> tuple[float, object]:
    """Seconds of ``fn()`` between barriers on every rank, and its result."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - start, out


def _torch_stage(model: Pipe, rank: int, world: int, per_stage: int) -> nn.Module:
    """This rank's blocks of ``model`` (stage ``rank`` of ``world``) as one sequential stage module."""
    return nn.Sequential(*list(model.blocks)[rank * per_stage:(rank + 1) * per_stage])


def _torch_runner(model: Pipe, schedule: str, rank: int, world: int, args):
    """A ``step(x, y) -> loss | None`` over ``torch.distributed.pipelining`` (loss on the last stage only)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage_mod = _torch_stage(model, rank, world, args.blocks)
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=args.micro_batches, loss_fn=F.mse_loss, scale_grads=True)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=args.lr)
    last = rank == world - 1

    def step(x, y):
        """One schedule step and optimizer step; the micro-batch losses on the last stage."""
        losses: list = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses if last else None

    return step


def _whale_runner(model: Pipe, schedule: str, args):
    """A ``step(x, y) -> global mean loss`` over Whale (``wh.parallelize`` of the annotated model)."""
    import whale as wh

    ctx = wh.init(wh.Config(num_micro_batch=args.micro_batches, schedule=schedule, seed=args.seed))
    engine = wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=args.lr), ctx=ctx)
    return lambda x, y: engine.step((x, y))["loss"]


def _case(rank: int, world: int, args, dim: int, rows: int, schedule: str) -> dict | None:
    """Both frameworks on one (model, schedule); interleaved timed steps. Returns the case's record on rank 0."""
    torch.manual_seed(args.seed)  # the same model on every rank
    model = Pipe(dim, world, args.blocks)
    whale_step = _whale_runner(copy.deepcopy(model), schedule, args)
    torch_step = _torch_runner(copy.deepcopy(model), schedule, rank, world, args)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(rows * args.micro_batches, dim, generator=g)
    y = torch.randn(rows * args.micro_batches, dim, generator=g)
    losses: dict[str, list] = {"whale": [], "torch": []}
    runners = {"whale": whale_step, "torch": torch_step}

    def timer(name):
        """One timed step of one framework; keeps its loss (every step, warm-up included, in step order)."""
        def run():
            seconds, loss = _timed(lambda: runners[name](x, y))
            losses[name].append([float(v.detach()) for v in loss] if isinstance(loss, list) else loss)
            return seconds
        return run

    whale_s, torch_s = rounds(timer("whale"), timer("torch"), args.steps, args.warmup)
    times = {"whale": whale_s, "torch": torch_s}
    torch_losses = [statistics.fmean(ls) for ls in losses["torch"]] if rank == world - 1 else None
    gathered = [None] * world
    dist.all_gather_object(gathered, torch_losses)
    if rank != 0:
        return None
    return _record(dim, rows, schedule, times, [float(v) for v in losses["whale"]], gathered[world - 1])


def _record(dim: int, rows: int, schedule: str, times: dict, whale_losses: list, torch_losses: list) -> dict:
    """The JSON record of one case."""
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = summary(times["whale"], times["torch"], goal=1.0, names=("whale", "torch"))
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(whale_losses, torch_losses, strict=True)]
    return {"schedule": schedule, "dim": dim, "rows_per_micro_batch": rows,
            "whale_step_s": med["whale"], "torch_step_s": med["torch"],
            "throughput_ratio_vs_torch_pipelining": paired["median"], "paired": paired,
            "goal_met": paired["goal_met"],
            "first_loss_whale": whale_losses[0], "first_loss_torch": torch_losses[0],
            "first_loss_rel_diff": rel[0], "max_loss_rel_diff_all_steps": max(rel),
            "losses_whale": whale_losses, "losses_torch": torch_losses, "raw_step_s": times}


def worker(rank: int, world: int, args) -> list[dict]:
    """Every case on this rank (``world`` must be 2: one rank per stage); the records on rank 0."""
    results = []
    for dim, rows in ((args.tiny_dim, args.tiny_rows), (args.dim, args.rows)):
        for schedule in SCHEDULES:
            results.append(_case(rank, world, args, dim, rows, schedule))
    return results if rank == 0 else []


def report(results: list[dict], args, seconds: float | None = None, run: Run | None = None) -> dict:
    """Print the table; write ``{"args": ..., "results": ...}`` to ``args.out`` when given. Returns that dict."""
    print(f"{'model':>10} {'schedule':>8} {'whale ms':>9} {'torch ms':>9} {'ratio':>7}  {'goal':<5} "
          f"{'loss whale':>11} {'loss torch':>11} {'rel diff':>9}")
    for r in results:
        ratio = r["throughput_ratio_vs_torch_pipelining"]
        met = {True: "met", False: "NOT", "unclear": "?IQR"}[r["goal_met"]]
        model = f"d{r['dim']}x{r['rows_per_micro_batch']}"
        print(f"{model:>10} {r['schedule']:>8} {r['whale_step_s'] * 1e3:>9.2f} {r['torch_step_s'] * 1e3:>9.2f} "
              f"{ratio:>7.3f}  {met:<5} {r['first_loss_whale']:>11.6f} "
              f"{r['first_loss_torch']:>11.6f} {r['first_loss_rel_diff']:>9.1e}")
    print("ratio = median paired torch step / Whale step (throughput ratio, goal >= 1.0; ?IQR: the IQR straddles "
          "it); losses of the first step")
    out = {"args": vars(args), "results": results, "wall_s": seconds}
    if args.out:
        out = (run or Run()).write(args.out, out)
        print(f"wrote {args.out}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: the documented run)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--blocks", type=int, default=2, help="MLP blocks per stage")
    p.add_argument("--tiny-dim", type=int, default=64)
    p.add_argument("--tiny-rows", type=int, default=512, help="rows per micro-batch of the tiny model")
    p.add_argument("--dim", type=int, default=512, help="the larger model's width")
    p.add_argument("--rows", type=int, default=256, help="rows per micro-batch of the larger model")
    p.add_argument("--steps", type=int, default=60, help="measured paired rounds (one step of each) per case")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main() -> None:
    """Launch 2 ranks, run every case, report."""
    run = Run()
    args = parse_args()
    start = time.perf_counter()
    results = launch(worker, 2, args)[0]
    report(results, args, time.perf_counter() - start, run)


if __name__ == "__main__":
    main()
