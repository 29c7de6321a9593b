"""Emulated heterogeneous clusters on CPU (DESIGN.md §6): each rank imitates its declared device's speed."""

from __future__ import annotations

import os

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
