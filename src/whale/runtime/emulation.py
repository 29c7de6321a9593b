"""Emulated heterogeneous clusters on CPU (DESIGN.md §6): each rank imitates its declared device's speed."""

from __future__ import annotations

import os
import time

from whale.cluster import ClusterSpec, emulation_delays


def emulation_slowdown(cluster: ClusterSpec | None, rank: int, world_size: int, cores: int | None = None) -> float:
    """Extra wait per second of compute for ``rank`` under an emulated cluster (0 when not emulating).

    A rank whose declared device is ``s_max / s_i`` times slower than the fastest waits ``t * (s_max/s_i - 1)``
    after each compute segment of ``t`` seconds. When the ranks outnumber the CPU cores, every rank is slowed
    by a further ``world / cores`` so that the cores are never oversubscribed and each rank's compute runs at
    full single-core speed: the wait becomes ``t * (base * s_max/s_i - 1)`` with ``base = world / cores``.
    Ratios between ranks stay those of the declared devices; absolute speed is not emulated. ``cores``
    defaults to ``WHALE_EMULATION_CORES`` or the machine's CPU count (set it lower on a shared machine to leave
    headroom).
    """
    if cluster is None or not cluster.emulate:
        return 0.0
    cores = cores or int(os.environ.get("WHALE_EMULATION_CORES", 0)) or os.cpu_count() or 1
    base = max(1.0, world_size / cores)
    return base * (emulation_delays(cluster)[rank] + 1.0) - 1.0


def measure_unit_time(size: int = 160, repeats: int = 15) -> float:
    """CPU seconds this thread needs for one fixed unit of work (a ``size x size`` fp32 matmul): the rank's
    real speed, for :func:`calibrated_slowdowns`. Median of ``repeats`` timings (thread CPU time)."""
    import statistics

    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(4):
            a @ b
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def calibrated_slowdowns(cluster: ClusterSpec, unit_times: list[float], world_size: int,
                         cores: int | None = None) -> list[float]:
    """Per-rank slowdowns that make emulated speeds follow the declared ones even when the CPU cores under the
    ranks differ in real speed (a VM's vCPUs often do by 5-25%).

    With ``t_i`` the measured seconds per unit of work on rank i and ``s_i`` its declared FLOP/s, rank i's
    emulated time per unit is ``t_i (1 + slowdown_i) = k / s_i``; ``k`` is chosen so that the fastest emulated
    rank is slowed by exactly the oversubscription ``base`` of :func:`emulation_slowdown`:
    ``slowdown_i = base * max_j(s_j t_j) / (s_i t_i) - 1``. With equal ``t_i`` this is
    ``base * s_max / s_i - 1``.
    """
    cores = cores or int(os.environ.get("WHALE_EMULATION_CORES", 0)) or os.cpu_count() or 1
    base = max(1.0, world_size / cores)
    speeds = [d.fp32_flops for d in cluster.devices()]
    prod = [s * t for s, t in zip(speeds, unit_times, strict=True)]
    top = max(prod)
    return [base * top / p - 1.0 for p in prod]
