"""A small Whale job in which one rank raises mid-step (benchmarks/reliability.py, tests).

Usage: ``whale launch -n N benchmarks/_raise_job.py --raise-rank R --raise-step S --timeout T``. Rank R raises
``RuntimeError("injected failure ...")`` instead of running step S (its peers are then inside that step's
collectives) after printing ``RAISE_AT <unix time>`` to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import whale as wh  # noqa: E402
from tests.models import TinyLM, lm_batches, lm_loss  # noqa: E402


def main() -> None:
    """Train TinyLM (2 stages when the world size is even) and raise on one rank at one step."""
    p = argparse.ArgumentParser()
    p.add_argument("--raise-rank", type=int, default=1)
    p.add_argument("--raise-step", type=int, default=3)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, timeout_s=args.timeout))
    stages = (1, 1) if ctx.world_size % 2 == 0 else (2,)
    engine = wh.parallelize(TinyLM(stage_layers=stages), lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                            ctx=ctx)
    for i, b in enumerate(lm_batches(args.steps, 8)):
        if ctx.rank == args.raise_rank and i == args.raise_step:  # its peers are already inside step i
            print(f"RAISE_AT {time.time():.3f}", file=sys.stderr, flush=True)
            raise RuntimeError(f"injected failure on rank {ctx.rank} at step {i}")
        engine.step(b)
    print(f"rank {ctx.rank} finished", flush=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
