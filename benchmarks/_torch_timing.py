"""Timers on ``torch.distributed.pipelining``'s schedules and stages, for the benchmarks that put its steps beside
Whale's (:mod:`benchmarks.vs_torch_pipelining`, :mod:`benchmarks.pipeline_overheads`).

torch's schedules keep no timeline of their own, so the compute of a step is the time spent in its stages'
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` (keys ``"F"``, ``"B"``, ``"W"``)
and the schedule's time that of ``schedule.step`` (key ``"schedule"``); the wrappers add two
``time.perf_counter`` calls per action.
"""

from __future__ import annotations

import time
from collections import defaultdict

TIMES: dict = defaultdict(float)
"""Seconds per part of the step under way (cleared by the caller before each step)."""


def wrap(obj, name: str, into: dict, key: str) -> None:
    """Time every call of ``obj.name`` (seconds added to ``into[key]``)."""
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] += time.perf_counter() - t0
    setattr(obj, name, timed)


_DONE: list = []


def torch_timers() -> None:
    """Time torch's schedules' ``step`` and its per-chunk forward / backward / weight-gradient calls into
    :data:`TIMES` (class-level, once per process)."""
    if _DONE:
        return
    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining import stage as st

    for name, key in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        wrap(st._PipelineStageBase, name, TIMES, key)
    for cls in (ts.ScheduleGPipe, ts.Schedule1F1B, ts.ScheduleInterleaved1F1B, ts.ScheduleInterleavedZeroBubble):
        wrap(cls, "step", TIMES, "schedule")
    _DONE.append(True)
