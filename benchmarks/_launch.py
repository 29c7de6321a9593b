"""Run a benchmark function on N fresh gloo ranks (spawned processes, one torch thread each)."""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn, cfg, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, cfg)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world: int, cfg, timeout: float = 1800.0) -> list:
    """Run ``fn(rank, world, cfg)`` on ``world`` spawned gloo ranks (the process group is initialized);
    returns the results ordered by rank. ``fn`` must be a module-level function.

    Raises:
        RuntimeError: a rank failed (with its traceback) or nothing came back within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), fn, cfg, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            results = {rank: (status, payload) for rank, status, payload in
                       (queue.get(timeout=timeout) for _ in range(world))}
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    for rank, (status, payload) in sorted(results.items()):
        if status == "error":
            raise RuntimeError(f"benchmark rank {rank} failed: {payload}")
    return [results[r][1] for r in range(world)]
