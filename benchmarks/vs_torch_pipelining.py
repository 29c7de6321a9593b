"""Whale's pipeline vs ``torch.distributed.pipelining`` on the same model, stages, micro-batches and schedule.

Two stages (world 2, gloo, one CPU thread per rank), 4 micro-batches, at a tiny model (dim 64, ~2-4 ms per
micro-batch: per-step overheads dominate) and a larger one (dim 512, as in pipeline_bubble.py), for each
schedule pair (Whale's, torch's): GPipe / ``ScheduleGPipe``, 1F1B / ``Schedule1F1B``, Interleaved1F1B with
``--virtual-stages`` chunks per rank / ``ScheduleInterleaved1F1B``, and zero-bubble ZB-H1 /
``ScheduleInterleavedZeroBubble`` with one stage per rank (its ZB1P order: the paper's ZB-H1).
The model (``pipeline_bubble.Pipe``: ``--blocks`` MLP blocks per rank, in ``v`` chunks of ``blocks / v`` under
``wh.replicate(1)`` each, so every schedule runs the same work per rank) is built once from ``--seed``; Whale
gets one deep copy (``wh.parallelize`` with ``wh.Config(num_micro_batch=4, schedule=..., virtual_stages=v)``),
torch another, cut into per-rank stage modules by hand (one ``PipelineStage`` per chunk of this rank: chunk c of
rank r is stage ``c*p + r``). Plain MSE on random data, SGD (no momentum), the same fixed global batch every
step.

Loss reductions agree: Whale's loss is the mean over the global batch (each micro-batch's per-sample mean
weighted by rows / global batch). torch computes ``F.mse_loss`` (a per-sample mean) per micro-batch and, with
``scale_grads=True`` (the default), divides the gradients by the number of micro-batches, so its gradients
are those of the mean of the micro-batch losses; micro-batches have equal rows, so that mean is the global
batch mean, and torch's step loss is reported as ``mean(losses)`` from its last stage.

Blocks of ``--block`` consecutive steps (4) are paired in ABBA order (Whale's block, torch's, then torch's,
Whale's, ...) so host drift hits both alike; each block is timed between barriers on both ranks and gives seconds
per step, so one step's millisecond jitter (a 20 ms step of the tiny model) is averaged over the block.
``throughput_ratio_vs_torch_pipelining`` = the median over pairs of torch's step seconds / Whale's
(goal >= 1.0), with its interquartile range and ``goal_met`` (``"unclear"`` when the IQR straddles 1.0), by
:func:`benchmarks._paired.summary`.
Each framework's measured idle share per stage (1 - busy / the step's schedule makespan; torch's busy time is
that of its stages' forward / backward / weight-gradient calls, :mod:`benchmarks._torch_timing`) is reported
beside the schedule's formula (:func:`whale.plan.schedule.schedule_bubble`): the formula prices transfers at
zero, so ``whale_minus_torch_idle`` tells what the schedule's implementation adds from what the host's
transfers add to both. A Whale step includes what its API returns
(the global loss all-reduced to every rank); torch's step is ``schedule.step`` + ``optimizer.step`` +
``zero_grad`` (its loss stays on the last stage and is read outside the timed region).

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
from benchmarks._paired import summary  # noqa: E402
from benchmarks._provenance import Run  # noqa: E402
from benchmarks._torch_timing import TIMES, torch_timers  # noqa: E402
from benchmarks.pipeline_bubble import Pipe  # noqa: E402
from whale.plan.schedule import schedule_bubble  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZB-H1")
TORCH_SCHEDULES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
                   "ZB-H1": "ScheduleInterleavedZeroBubble"}
"""Whale's schedule -> torch.distributed.pipelining's class of the same schedule."""


def _timed(fn) -> tuple[float, object]:
    """Seconds of ``fn()`` between barriers on every rank, and its result."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - start, out


def _chunks(schedule: str, args) -> int:
    """Model chunks per rank of ``schedule``."""
    return args.virtual_stages if schedule == "Interleaved1F1B" else 1


def _torch_runner(model: Pipe, schedule: str, rank: int, world: int, args):
    """A ``step(x, y) -> loss | None`` over ``torch.distributed.pipelining`` (loss on the last stage only)."""
    from torch.distributed import pipelining

    v = _chunks(schedule, args)
    per = args.blocks // v
    blocks = list(model.blocks)
    mods = [nn.Sequential(*blocks[c * per:(c + 1) * per]) for c in range(rank, world * v, world)]
    stages = [pipelining.PipelineStage(m, c, world * v, torch.device("cpu"))
              for m, c in zip(mods, range(rank, world * v, world), strict=True)]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    multi = schedule in ("Interleaved1F1B", "ZB-H1")
    sched = cls(stages if multi else stages[0], n_microbatches=args.micro_batches, loss_fn=F.mse_loss,
                scale_grads=True)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=args.lr)
    last = rank == world - 1

    def step(x, y):
        """One schedule step and optimizer step: ``(micro-batch losses on the last stage else None, busy s,
        schedule s)`` (busy: the stages' forward / backward / weight-gradient calls, :mod:`benchmarks.
        _torch_timing`)."""
        losses: list = []
        TIMES.clear()
        if rank == 0:
            sched.step(x, target=y, losses=losses) if multi else sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        busy, window = TIMES["F"] + TIMES["B"] + TIMES["W"], TIMES["schedule"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses if last else None, busy, window

    return step


def _whale_runner(model: Pipe, schedule: str, args):
    """A ``step(x, y) -> (global mean loss, busy s, schedule s)`` over Whale (``wh.parallelize``)."""
    import whale as wh

    ctx = wh.init(wh.Config(num_micro_batch=args.micro_batches, schedule=schedule, seed=args.seed,
                            virtual_stages=_chunks(schedule, args)))
    engine = wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=args.lr), ctx=ctx)

    def step(x, y):
        """One Whale step."""
        out = engine.step((x, y))
        return out["loss"], out["busy_time"], out["schedule_time"]

    step.engine = engine  # for benchmarks/pipeline_overheads.py
    return step


def _case(rank: int, world: int, args, dim: int, rows: int, schedule: str) -> dict | None:
    """Both frameworks on one (model, schedule); interleaved timed steps. Returns the case's record on rank 0."""
    torch.manual_seed(args.seed)  # the same model on every rank
    v = _chunks(schedule, args)
    model = Pipe(dim, world * v, args.blocks // v)
    whale_step = _whale_runner(copy.deepcopy(model), schedule, args)
    torch_step = _torch_runner(copy.deepcopy(model), schedule, rank, world, args)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(rows * args.micro_batches, dim, generator=g)
    y = torch.randn(rows * args.micro_batches, dim, generator=g)
    times: dict[str, list[float]] = {"whale": [], "torch": []}
    losses: dict[str, list] = {"whale": [], "torch": []}
    spans: dict[str, list[tuple[float, float]]] = {"whale": [], "torch": []}
    runners = {"whale": whale_step, "torch": torch_step}
    k = args.block
    for i in range(args.warmup + args.steps // k):
        order = ("whale", "torch") if i % 2 == 0 else ("torch", "whale")
        for name in order:
            seconds, outs = _timed(lambda n=name: [runners[n](x, y) for _ in range(k)])
            for loss, busy, window in outs:
                if i >= args.warmup:
                    spans[name].append((busy, window))
                losses[name].append([float(v.detach()) for v in loss] if isinstance(loss, list) else loss)
            if i >= args.warmup:
                times[name].append(seconds / k)
    torch_losses = [statistics.fmean(ls) for ls in losses["torch"]] if rank == world - 1 else None
    gathered = [None] * world
    dist.all_gather_object(gathered, (torch_losses, spans))
    if rank != 0:
        return None
    idle = _idle_shares([g[1]["whale"] for g in gathered])
    torch_idle = _idle_shares([g[1]["torch"] for g in gathered])
    theory = schedule_bubble(schedule, world, args.micro_batches, v)
    return _record(dim, rows, schedule, times, [float(v) for v in losses["whale"]], gathered[world - 1][0]) | {
        "virtual_stages": v, "torch_schedule": TORCH_SCHEDULES[schedule], "whale_idle_share": idle,
        "theory_idle_share": theory, "idle_minus_theory": [i - theory for i in idle],
        "torch_idle_share": torch_idle, "whale_minus_torch_idle": [a - b for a, b in zip(idle, torch_idle,
                                                                                          strict=True)]}


def _idle_shares(spans: list[list[tuple[float, float]]]) -> list[float]:
    """Per stage, the median over steps of 1 - busy / the step's makespan (the largest schedule time of any
    stage); ``spans[stage][step] = (busy s, schedule s)``."""
    out = []
    for mine in spans:
        out.append(statistics.median(1 - b / max(s[i][1] for s in spans) for i, (b, _) in enumerate(mine)))
    return out


def _record(dim: int, rows: int, schedule: str, times: dict, whale_losses: list, torch_losses: list) -> dict:
    """The JSON record of one case."""
    med = {k: statistics.median(v) for k, v in times.items()}
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(whale_losses, torch_losses, strict=True)]
    paired = summary(times["whale"], times["torch"], goal=1.0, names=("whale", "torch"))
    return {"schedule": schedule, "dim": dim, "rows_per_micro_batch": rows,
            "whale_step_s": med["whale"], "torch_step_s": med["torch"],
            "throughput_ratio_vs_torch_pipelining": paired["median"], "throughput_ratio_iqr": paired["iqr"],
            "pairs": paired["n"], "goal_met": paired["goal_met"], "paired": paired,
            "first_loss_whale": whale_losses[0], "first_loss_torch": torch_losses[0],
            "first_loss_rel_diff": rel[0], "max_loss_rel_diff_all_steps": max(rel),
            "losses_whale": whale_losses, "losses_torch": torch_losses, "raw_step_s": times}


def worker(rank: int, world: int, args) -> list[dict]:
    """Every case on this rank (``world`` must be 2: one rank per stage); the records on rank 0."""
    torch_timers()
    results = []
    for dim, rows in ((args.tiny_dim, args.tiny_rows), (args.dim, args.rows)):
        for schedule in args.schedules:
            results.append(_case(rank, world, args, dim, rows, schedule))
    return results if rank == 0 else []


def report(results: list[dict], args, seconds: float | None = None, run: Run | None = None) -> dict:
    """Print the table; write ``{"args", "provenance", "results"}`` to ``args.out`` when given. Returns that dict."""
    print(f"{'model':>10} {'schedule':>15} {'whale ms':>9} {'torch ms':>9} {'ratio':>7} {'IQR':>13}  {'goal':<5} "
          f"{'rel loss diff':>13}  idle share per stage (theory)")
    for r in results:
        ratio = r["throughput_ratio_vs_torch_pipelining"]
        model = f"d{r['dim']}x{r['rows_per_micro_batch']}"
        iqr = "{:.3f}-{:.3f}".format(*r["throughput_ratio_iqr"])
        idle = " ".join(f"{i:.3f}" for i in r["whale_idle_share"]) + " torch " + " ".join(
            f"{i:.3f}" for i in r["torch_idle_share"])
        print(f"{model:>10} {r['schedule']:>15} {r['whale_step_s'] * 1e3:>9.2f} {r['torch_step_s'] * 1e3:>9.2f} "
              f"{ratio:>7.3f} {iqr:>13}  {str(r['goal_met']):<5} {r['first_loss_rel_diff']:>13.1e}  "
              f"{idle} ({r['theory_idle_share']:.3f})")
    print("ratio = median over ABBA pairs of torch step / Whale step (throughput ratio, goal >= 1.0); loss diff of "
          "the first step; idle = 1 - busy / schedule makespan (Whale's, then torch's), theory = schedule_bubble")
    out = {"args": vars(args), "results": results, "wall_s": seconds}
    if args.out:
        out = (run or Run()).write(args.out, out)
        print(f"wrote {args.out}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: the documented run)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--blocks", type=int, default=2, help="MLP blocks per rank (split into its chunks)")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank of Interleaved1F1B")
    p.add_argument("--tiny-dim", type=int, default=64)
    p.add_argument("--tiny-rows", type=int, default=512, help="rows per micro-batch of the tiny model")
    p.add_argument("--dim", type=int, default=512, help="the larger model's width")
    p.add_argument("--rows", type=int, default=256, help="rows per micro-batch of the larger model")
    p.add_argument("--steps", type=int, default=120, help="timed steps per framework and case")
    p.add_argument("--block", type=int, default=4, help="consecutive steps of one framework per timed unit: a "
                   "pair compares two blocks (seconds per step), so one step's jitter is averaged over the block")
    p.add_argument("--warmup", type=int, default=2, help="discarded pairs of blocks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.block < 1 or args.steps < args.block or args.steps % args.block:
        p.error(f"--steps {args.steps} must be a positive multiple of --block {args.block} (steps per timed block)")
    return args


def main() -> None:
    """Launch 2 ranks, run every case, report."""
    args = parse_args()
    run, start = Run(), time.perf_counter()
    results = launch(worker, 2, args)[0]
    report(results, args, time.perf_counter() - start, run)


if __name__ == "__main__":
    main()
