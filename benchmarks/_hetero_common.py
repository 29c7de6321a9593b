"""Helpers shared by the cases of :mod:`benchmarks.heterogeneous` (run inside the gloo ranks)."""

from __future__ import annotations

import dataclasses
import os
import time

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
CLUSTERS = os.path.join(HERE, "clusters")


def load_spec(name_or_path: str, **changes):
    """A cluster spec from ``benchmarks/clusters/<name>`` (or a path), with dataclass fields replaced."""
    from whale.cluster import ClusterSpec

    path = name_or_path if os.path.exists(name_or_path) else os.path.join(CLUSTERS, name_or_path)
    spec = ClusterSpec.from_yaml(path)
    return dataclasses.replace(spec, **changes) if changes else spec


def emulation_setup(cfg: dict, rank: int) -> None:
    """Emulate as if the host had ``cfg["emulation_cores"]`` cores (``WHALE_EMULATION_CORES``; fewer than it
    has slows every rank further, so ranks rarely queue for a core) and, with ``cfg["pin"]``, pin this rank to
    core ``rank % cpus`` (an emulated device keeps its core and caches: no migrations between ranks)."""
    if cfg.get("emulation_cores"):
        os.environ["WHALE_EMULATION_CORES"] = str(cfg["emulation_cores"])
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cfg.get("pin") and cpus:
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def timed_steps(engine, batch, k: int = 1) -> float:
    """Wall seconds per step of ``k`` back-to-back steps, between barriers (every rank has finished the
    previous work before and this work after)."""
    if dist.get_world_size() > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(k):
        engine.step(batch)
    if dist.get_world_size() > 1:
        dist.barrier()
    return (time.perf_counter() - start) / k


def interleave(engines: dict, batch, warmup: int, rounds: int, k: int = 1) -> dict:
    """``k`` steps of every engine round by round (order reversed every other round); per engine the measured
    seconds per step of each round after ``warmup`` rounds."""
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            t = timed_steps(engines[name], batch, k)
            if i >= warmup:
                times[name].append(t)
    return times


def gather(obj) -> list:
    """``obj`` of every rank, by rank."""
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rows_per_rank(plan, batch: int) -> list[int]:
    """Samples per rank in one step."""
    rows = plan.micro_batch_rows(batch)
    return [sum(b - a for a, b in rows[plan.coords(r)[1]]) for r in range(plan.world_size)]
