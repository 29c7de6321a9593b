"""Whale's replicate (data parallel) vs torch's DistributedDataParallel on the same model, ranks and data.

Both run in the same processes in paired rounds (:mod:`benchmarks._paired`: ABBA order, warm-up discarded), so
that machine noise hits both alike; the reported ``throughput_ratio`` is the median over rounds of DDP's step
time over Whale's in the same round (Whale's throughput over DDP's, goal >= 0.97), with its IQR in
``throughput_ratio_paired``.

    python benchmarks/dp_overhead.py --nproc 2 --steps 30 --out benchmarks/results/dp_overhead.json
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
from benchmarks._models import Block  # noqa: E402
from benchmarks._paired import describe, rounds, summary  # noqa: E402
from benchmarks._provenance import Run  # noqa: E402


class Net(nn.Module):
    """Token model [B, T] -> logits [B, T, V]."""

    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx)))


def loss_fn(logits, y):
    """Mean token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _time(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank: int, world: int, args) -> dict:
    import whale as wh

    torch.set_num_threads(args.threads)
    ctx = wh.init(wh.Config(seed=0, bucket_cap_mb=args.bucket_mb))
    model = Net(args.vocab, args.dim, args.layers)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=args.bucket_mb)
    engine = wh.parallelize(model, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    per = args.batch // world
    xl, yl = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]

    def ddp_step():
        ddp_opt.zero_grad(set_to_none=True)
        loss_fn(ddp(xl), yl).backward()
        ddp_opt.step()

    def whale_steps():
        for _ in range(args.round_steps):
            engine.step((x, y))

    def ddp_steps():
        for _ in range(args.round_steps):
            ddp_step()

    whale, ddp_s = rounds(lambda: _time(whale_steps) / args.round_steps, lambda: _time(ddp_steps) / args.round_steps,
                          args.steps, args.warmup)
    return {"whale": whale, "ddp": ddp_s}


def main() -> None:
    run = Run()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="measured paired rounds")
    p.add_argument("--round-steps", type=int, default=3, help="steps of each system per round")
    p.add_argument("--warmup", type=int, default=2, help="paired rounds discarded first")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    times = launch(_worker, args.nproc, args)[0]
    report(times, args, run)


def report(times: dict, args, run: Run) -> None:
    """Print the table and write JSON (with provenance)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.seq
    paired = summary(times["whale"], times["ddp"], goal=0.97, names=("whale", "ddp"))
    ratio = paired["median"]
    print(f"{'':8} {'median step (ms)':>17} {'tokens/s':>10}")
    for k in ("whale", "ddp"):
        print(f"{k:8} {med[k] * 1e3:>17.1f} {tokens / med[k]:>10.0f}")
    print(f"throughput ratio Whale / DDP (median paired) = {describe(paired)}")
    result = {"whale_step_s": med["whale"], "ddp_step_s": med["ddp"], "throughput_ratio": ratio,
              "throughput_ratio_paired": paired, "goal_met": paired["goal_met"],
              "nproc": args.nproc, "rounds": args.steps, "round_steps": args.round_steps,
              "batch": args.batch, "seq": args.seq,
              "dim": args.dim, "layers": args.layers, "raw": times}
    if args.out:
        run.write(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
