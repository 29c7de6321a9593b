"""Measured pipeline bubble vs theory on equal stages, one rank per CPU core: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v m + p-1) for interleaved 1F1B, (p-1)/(3m + p-1) for ZB-H1 (:func:`whale.plan.schedule.schedule_bubble`).

Each stage holds the same number of identical MLP blocks; the loss is a cheap mean square. For every
(schedule, micro-batch count) the idle share of each stage over the step's schedule window (the makespan of
the forward/backward schedule over all stages, without gradient sync and optimizer) is compared with theory,
and with the event simulator fed the measured per-micro-batch forward/backward times.

    python benchmarks/pipeline_bubble.py --out benchmarks/results/pipeline_bubble.json
    python benchmarks/pipeline_bubble.py --stages 4 --micro-batches 8 --schedules 1F1B Interleaved1F1B ZB-H1 \
        --out benchmarks/results/pipeline_bubble_schedules.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._launch import launch  # noqa: E402
from benchmarks._provenance import Run  # noqa: E402


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


def _worker(rank, world, args):
    import whale as wh
    from whale.plan.schedule import make_schedule, schedule_bubble
    from whale.plan.schedule_sim import simulate

    results = []
    for schedule in args.schedules:
        v = args.virtual_stages if schedule == "Interleaved1F1B" else 1
        for m in args.micro_batches:
            ctx = wh.init(wh.Config(num_micro_batch=m, schedule=schedule, seed=0, virtual_stages=v))
            eng = wh.parallelize(Pipe(args.dim, world * v, args.blocks // v), F.mse_loss,
                                 lambda ps: torch.optim.SGD(ps, lr=1e-3), ctx=ctx)
            x = torch.randn(args.rows * m, args.dim)
            for _ in range(args.warmup):
                eng.step((x, x))
            idle, fwd, bwd = [], [], []
            for _ in range(args.steps):
                r = eng.step((x, x))
                window = torch.tensor([r["schedule_time"]])
                dist.all_reduce(window, op=dist.ReduceOp.MAX)  # the step's makespan over all stages
                idle.append(1 - r["busy_time"] / float(window))
                # per micro-batch through the whole stage: all its chunks, B and W of a split backward
                fwd.append(sum(c1 - c0 for label, _, c0, c1 in eng.last_timeline if label[0] == "F") / m)
                bwd.append(sum(c1 - c0 for label, _, c0, c1 in eng.last_timeline if label[0] in "BW") / m)
            gathered = [None] * world
            dist.all_gather_object(gathered, (statistics.median(idle), statistics.median(fwd), statistics.median(bwd)))
            if rank == 0:
                sim = simulate(make_schedule(schedule, world, m, v), [g[1] for g in gathered],
                               [g[2] for g in gathered])
                results.append({"schedule": schedule, "micro_batches": m, "stages": world, "virtual_stages": v,
                                "idle_share": [g[0] for g in gathered],
                                "theory": schedule_bubble(schedule, world, m, v),
                                "fwd_s": [g[1] for g in gathered], "bwd_s": [g[2] for g in gathered],
                                "simulated_idle_share": sim["idle_share"]})
    return results


def main() -> None:
    run = Run()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="ranks = stages (keep <= CPU cores)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe"],
                   choices=["1F1B", "GPipe", "Interleaved1F1B", "ZB-H1"])
    p.add_argument("--virtual-stages", type=int, default=2, help="chunks per stage of Interleaved1F1B")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--blocks", type=int, default=2, help="blocks per stage (split into its chunks)")
    p.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = launch(_worker, args.stages, args)[0]
    print("idle share of the schedule time per stage: measured, event simulation fed the measured per-stage\n"
          "forward/backward times (stages are never exactly equal on shared vCPUs), and theory (schedule_bubble)")
    print(f"{'schedule':>15} {'m':>3} {'theory':>7}  {'measured':<16} {'simulated':<16} {'F ms':<12} {'B ms':<12} "
          f"mean |meas-theory|")
    for r in results:
        err = sum(abs(i - r["theory"]) for i in r["idle_share"]) / len(r["idle_share"])
        r["mean_abs_error_vs_theory"] = err
        r["mean_abs_error_vs_simulated"] = sum(abs(i - j) for i, j in zip(r["idle_share"], r["simulated_idle_share"],
                                                                             strict=True)) / len(r["idle_share"])
        meas = " ".join(f"{i:.3f}" for i in r["idle_share"])
        sim = " ".join(f"{i:.3f}" for i in r["simulated_idle_share"])
        fwd = " ".join(f"{t * 1e3:.1f}" for t in r["fwd_s"])
        bwd = " ".join(f"{t * 1e3:.1f}" for t in r["bwd_s"])
        print(f"{r['schedule']:>15} {r['micro_batches']:>3} {r['theory']:>7.3f}  {meas:<16} {sim:<16} {fwd:<12} "
              f"{bwd:<12} {err:.3f}")
    if args.out:
        run.write(args.out, {"results": results, "args": vars(args)})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
