"""Run a benchmark function on N fresh gloo ranks (spawned processes, one torch thread each).

When a rank fails, the error raised names the rank that failed first and why, decided as ``whale launch`` does
(:mod:`whale.runtime.attribution`), never from message text: the earliest genuine error (one that is no failed
collective: :func:`whale.runtime.failures.is_communication_error`) with its traceback; else a rank that died
without a word (its exit code or signal, and its last heartbeat); else the earliest failed collective and the rank
furthest behind. On a timeout the rank that stopped making progress is named from the engine's heartbeats
(:mod:`whale.runtime.heartbeat`, written to a per-launch directory).
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from whale.runtime import failures, heartbeat
from whale.runtime.attribution import exit_how

GRACE_S = 10.0
"""Seconds the other ranks get to end (and say why) once one rank failed, before they are killed."""


def _entry(rank: int, world: int, init_file: str, fn, cfg, queue, folder: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[failures.ERROR_DIR_ENV] = folder
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        heartbeat.start(rank)
        queue.put((rank, "ok", fn(rank, world, cfg), time.time()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        kind = "peer" if failures.is_communication_error(exc) else "error"
        queue.put((rank, kind, f"{failures.error_line(exc, rank)}\n{traceback.format_exc()}", time.time()))
    finally:
        heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs, queue, timeout: float) -> tuple[dict, dict, bool]:
    """Results ``{rank: (kind, payload, time)}`` and deaths ``{rank: (exit code, time seen)}`` until every rank
    answered or died, ``GRACE_S`` after the first failure, or ``timeout`` (then the third value is True)."""
    results: dict[int, tuple] = {}
    died: dict[int, tuple] = {}
    deadline, first_failure = time.monotonic() + timeout, None
    while len(results) + len(died) < len(procs):
        now = time.monotonic()
        if now > deadline or (first_failure is not None and now - first_failure > GRACE_S):
            return results, died, now > deadline
        try:
            rank, kind, payload, when = queue.get(timeout=0.2)
            results[rank] = (kind, payload, when)
            if kind != "ok" and first_failure is None:
                first_failure = time.monotonic()
            continue
        except queue_mod.Empty:
            pass
        for r, p in enumerate(procs):
            if r not in results and r not in died and p.exitcode is not None and queue.empty():
                died[r] = (p.exitcode, time.time())
                first_failure = first_failure or time.monotonic()
    return results, died, False


def _blame(results: dict, died: dict, timed_out: bool, timeout: float, folder: str, world: int) -> str | None:
    """The error text naming the rank that failed first (module docstring), or ``None`` when all succeeded."""
    failed = {r: v for r, v in results.items() if v[0] != "ok"}
    if not failed and not died and not timed_out:
        return None
    beats = heartbeat.read_all(folder)
    genuine = sorted((v[2], r) for r, v in failed.items() if v[0] == "error")
    peers = sorted((v[2], r) for r, v in failed.items() if v[0] == "peer")
    others = "".join(f"\n  rank {r}: {v[1].splitlines()[0]}" for r, v in sorted(failed.items()))
    if genuine:
        rank = genuine[0][1]
        return f"benchmark rank {rank} failed first: {failed[rank][1]}{others}"
    if died:
        rank = min(died, key=lambda r: died[r][1])
        state = beats.get(rank, {})
        last = f"; its last heartbeat: step {state['step']}, {state['phase']}" if state.get("step") else ""
        return f"benchmark rank {rank} died first ({exit_how(died[rank][0])}) without an error{last}{others}"
    if peers and not timed_out:
        rank, behind = peers[0][1], heartbeat.laggard(beats)
        far = f"; furthest behind: rank {behind}, {heartbeat.describe(beats[behind])}" if beats else ""
        return f"benchmark rank {rank}'s collective failed first: {failed[rank][1]}{far}{others}"
    silent = set(range(world)) - set(results)
    rank = heartbeat.laggard(beats, silent) if beats else None
    where = f"; rank {rank} stopped making progress at {heartbeat.describe(beats[rank])}" if rank is not None else ""
    return f"benchmark: not every rank answered within {timeout:.0f} s{where}{others}"


def launch(fn, world: int, cfg, timeout: float = 1800.0) -> list:
    """Run ``fn(rank, world, cfg)`` on ``world`` spawned gloo ranks (the process group is initialized);
    returns the results ordered by rank. ``fn`` must be a module-level function.

    Raises:
        RuntimeError: a rank failed, died or hung (the first one named, see the module docstring), or nothing
            came back within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "errors")
        os.mkdir(folder)
        procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), fn, cfg, queue, folder))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            results, died, timed_out = _collect(procs, queue, timeout)
            error = _blame(results, died, timed_out, timeout, folder, world)
        finally:
            for p in procs:
                p.join(timeout=0 if p.exitcode is not None else 5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if error is not None:
        raise RuntimeError(error)
    return [results[r][1] for r in range(world)]
