"""Emulated heterogeneous clusters on CPU: each rank imitates its declared device's speed.

Our machines have CPUs only, so a cluster spec with ``emulate: true`` makes each CPU rank behave like its
declared device: its compute segments are stretched to the declared speed relative to the fastest device
(:class:`EmulatedDevice`), calibrated to the real speed of every rank's core (:func:`calibrate`). Every report
made under emulation says so.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch
import torch.distributed as dist

from whale.cluster import ClusterSpec, emulation_cores, emulation_delays


def emulation_slowdown(cluster: ClusterSpec | None, rank: int, world_size: int, cores: float | None = None) -> float:
    """Extra wait per second of compute for ``rank`` under an emulated cluster (0 when not emulating).

    A rank whose declared device is ``s_max / s_i`` times slower than the fastest waits ``t * (s_max/s_i - 1)``
    after each compute segment of ``t`` seconds. When the ranks outnumber the CPU cores, every rank is slowed
    by a further ``world / cores`` so that the cores are never oversubscribed and each rank's compute runs at
    full single-core speed: the wait becomes ``t * (base * s_max/s_i - 1)`` with ``base = world / cores``.
    Ratios between ranks stay those of the declared devices; absolute speed is not emulated. ``cores`` defaults to
    ``WHALE_EMULATION_CORES`` or the machine's CPU count (:func:`whale.cluster.emulation_cores`; set it lower on a
    shared machine to leave headroom).

    Raises:
        ValueError: a bad ``WHALE_EMULATION_CORES``.
    """
    if cluster is None or not cluster.emulate:
        return 0.0
    base = max(1.0, world_size / emulation_cores(cores))
    return base * (emulation_delays(cluster)[rank] + 1.0) - 1.0


def measure_unit_time(size: int = 160, repeats: int = 40) -> float:
    """CPU seconds this thread needs for one fixed unit of work (four ``size x size`` fp32 matmuls): the rank's
    real speed, for :func:`calibrated_slowdowns`. The fastest of ``repeats`` timings of thread CPU time (the
    usual estimator of a machine's intrinsic speed: interference only ever adds time). Call it on every rank
    at once (after a barrier), so that all ranks probe under the same host load."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(4):
            a @ b
        times.append(time.thread_time() - t0)
    return min(times)


def calibrated_slowdowns(cluster: ClusterSpec, unit_times: list[float], world_size: int,
                         cores: float | None = None) -> list[float]:
    """Per-rank slowdowns that make emulated speeds follow the declared ones even when the CPU cores under the
    ranks differ in real speed (a VM's vCPUs often do by 5-25%).

    With ``t_i`` the measured seconds per unit of work on rank i and ``s_i`` its declared FLOP/s, rank i's
    emulated time per unit is ``t_i (1 + slowdown_i) = k / s_i``; ``k`` is chosen so that the fastest emulated
    rank is slowed by exactly the oversubscription ``base`` of :func:`emulation_slowdown`:
    ``slowdown_i = base * max_j(s_j t_j) / (s_i t_i) - 1``. With equal ``t_i`` this is
    ``base * s_max / s_i - 1``.
    """
    base = max(1.0, world_size / emulation_cores(cores))
    speeds = [d.fp32_flops for d in cluster.devices()]
    prod = [s * t for s, t in zip(speeds, unit_times, strict=True)]
    top = max(prod)
    return [base * top / p - 1.0 for p in prod]


def calibrate(cluster: ClusterSpec | None, rank: int, world_size: int) -> EmulatedDevice | None:
    """This rank's emulated device under an emulated cluster (collective: every rank probes its core's speed at
    once, after a barrier, and the slowdowns follow :func:`calibrated_slowdowns`); ``None`` when the cluster is
    not emulated (real hardware)."""
    if cluster is None or not cluster.emulate:
        return None
    if world_size == 1:
        return EmulatedDevice(emulation_slowdown(cluster, rank, world_size))
    times = [None] * world_size
    dist.barrier()  # probe together: every rank under the same host load
    dist.all_gather_object(times, measure_unit_time())
    return EmulatedDevice(calibrated_slowdowns(cluster, times, world_size)[rank])


class EmulatedDevice:
    """Stretches this rank's compute segments to its declared device's speed.

    A segment that took ``c`` seconds of this thread's CPU time, begun at wall time ``w0``, is made to end at
    ``w0 + max(c, (1 + slowdown) * median(c over the last `window` segments with the same key))``: its typical
    cost on this core times the device's relative slowness, and never before its real compute is done. Host
    jitter (a VM's caches, interrupts, a neighbour's memory traffic) is absorbed by the wait instead of being
    passed on, let alone multiplied by ``1 + slowdown`` (4-6x under the oversubscription base): a GPU's kernel
    times are steady for a given shape, and synchronous data parallelism pays the slowest rank of every step, so
    jitter would be charged to the plan. Only a segment slower than ``1 + slowdown`` times its median shows
    through. Wall time a segment spends off the CPU (waiting for a core, or in a blocking collective inside it,
    such as a split layer's all-reduce) is absorbed by the wait, so the emulation under-counts blocking
    collectives inside segments. Keys name segments of equal work, e.g.
    ``(kind, input shapes and dtypes)``; the ``max_keys`` most recently used are kept.

    Work started from inside a segment (gradient all-reduces launched by backward hooks) is :meth:`defer`-red
    and started at its emulated time: a launch requested after a fraction ``f`` of the segment's CPU time starts
    at ``w0 + f x`` the emulated duration, as it would on the declared device, so the last gradient bucket's
    all-reduce is exposed after backward instead of hidden in the wait.

    Args:
        slowdown: extra seconds per second of compute (>= 0), from :func:`emulation_slowdown` or
            :func:`calibrated_slowdowns`.
        window: segments per key whose median sets the wait.
        clock, cpu_clock, sleep: wall clock, this thread's CPU clock (seconds) and sleep; injectable for tests.

    Raises:
        ValueError: a negative ``slowdown`` or a ``window`` below 1.
    """

    def __init__(self, slowdown: float, window: int = 9, max_keys: int = 64, clock=time.perf_counter,
                 cpu_clock=time.thread_time, sleep=time.sleep) -> None:
        if slowdown < 0 or window < 1:
            raise ValueError(f"EmulatedDevice needs slowdown >= 0 and window >= 1, got {slowdown}, {window}")
        self.slowdown = slowdown
        self._window, self._max_keys = window, max_keys
        self._history: dict = {}
        self._pending: list = []
        self._clock, self._cpu_clock, self._sleep = clock, cpu_clock, sleep

    def defer(self, fn) -> None:
        """Run ``fn()`` at its emulated time in the current segment (at the latest when the segment's wait ends,
        or at :meth:`flush`)."""
        self._pending.append((self._cpu_clock(), fn))

    def flush(self) -> None:
        """Run every deferred function now, in order."""
        pending, self._pending = self._pending, []
        for _, fn in pending:
            fn()

    def segment_cpu_seconds(self) -> dict:
        """Per segment key, the median CPU seconds of its kept segments (what :meth:`wait` stretches): the
        engine's own compute timings, read by the engine calibration (:mod:`whale.calibration.engine`)."""
        return {key: statistics.median(hist) for key, hist in self._history.items()}

    def wait(self, key, wall0: float, cpu0: float, cpu_seconds: float) -> float:
        """Sleep until the emulated end of a segment begun at wall time ``wall0`` and CPU time ``cpu0`` that took
        ``cpu_seconds`` of CPU, running deferred work at its emulated times. Returns the seconds slept."""
        hist = self._history.pop(key, None) or collections.deque(maxlen=self._window)
        self._history[key] = hist  # most recently used last
        while len(self._history) > self._max_keys:
            del self._history[next(iter(self._history))]
        hist.append(cpu_seconds)
        total = max(cpu_seconds, (1.0 + self.slowdown) * statistics.median(hist))
        slept = 0.0
        pending, self._pending = self._pending, []
        for cpu_at, fn in pending:
            frac = min(1.0, max(0.0, (cpu_at - cpu0) / cpu_seconds)) if cpu_seconds > 0 else 1.0
            slept += self._sleep_until(wall0 + frac * total)
            fn()
        return slept + self._sleep_until(wall0 + total)

    def _sleep_until(self, when: float) -> float:
        pause = when - self._clock()
        if pause > 0:
            self._sleep(pause)
            return pause
        return 0.0
