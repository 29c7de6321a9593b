"""A small Whale job in which one rank fails mid-step (benchmarks/reliability.py, benchmarks/_rel_failures.py,
tests).

Usage: ``whale launch -n N benchmarks/_raise_job.py --raise-rank R --raise-step S --timeout T [--mode M]
[--message TEXT]``. At step S (counted from 0) rank R, after printing ``RAISE_AT <unix time>`` to stderr:

* ``--mode raise`` (default): raises ``RuntimeError(TEXT)`` instead of running the step (its peers are then
  inside that step's collectives); TEXT defaults to ``injected failure on rank R at step S``;
* ``--mode kill``: kills itself with SIGKILL instead of running the step;
* ``--mode hang``: hangs (sleeps an hour) in its stage's forward of micro-batch 0 of that step, so its peers'
  collectives time out after T seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import whale as wh  # noqa: E402
from tests.models import TinyLM, lm_batches, lm_loss  # noqa: E402


def _announce() -> None:
    print(f"RAISE_AT {time.time():.3f}", file=sys.stderr, flush=True)


def main() -> None:
    """Train TinyLM (2 stages when the world size is even) and fail on one rank at one step."""
    p = argparse.ArgumentParser()
    p.add_argument("--raise-rank", type=int, default=1)
    p.add_argument("--raise-step", type=int, default=3)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--mode", choices=("raise", "kill", "hang"), default="raise")
    p.add_argument("--message", default=None)
    args = p.parse_args()
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, timeout_s=args.timeout))
    stages = (1, 1) if ctx.world_size % 2 == 0 else (2,)
    engine = wh.parallelize(TinyLM(stage_layers=stages), lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                            ctx=ctx)
    mine = ctx.rank == args.raise_rank
    hang = {"now": False}
    if mine and args.mode == "hang":
        def stall(module, inputs):
            """Hang in this stage's forward once armed."""
            if hang["now"]:
                _announce()
                time.sleep(3600)
        engine.module.register_forward_pre_hook(stall)
    for i, b in enumerate(lm_batches(args.steps, 8)):
        if mine and i == args.raise_step:  # its peers are already inside step i
            if args.mode == "raise":
                _announce()
                raise RuntimeError(args.message or f"injected failure on rank {ctx.rank} at step {i}")
            if args.mode == "kill":
                _announce()
                os.kill(os.getpid(), signal.SIGKILL)
            hang["now"] = True
        engine.step(b)
    print(f"rank {ctx.rank} finished", flush=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
