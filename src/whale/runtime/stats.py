"""Measured step times of one rank: the per-stage busy/idle report and profile-guided re-balancing.

The arithmetic of re-balancing is the pure planner function :func:`whale.planner.hardware.rebalance`; this module
only keeps the measurements and gathers them from every rank.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import torch.distributed as dist

from whale.plan.plan import Plan
from whale.planner import hardware


@dataclass(frozen=True)
class StepTiming:
    """One step on one rank: ``busy`` seconds of compute, ``schedule`` seconds of the forward/backward schedule
    (gradient sync and the optimizer step excluded) and the ``rows`` (samples) it computed."""

    busy: float
    schedule: float
    rows: int


def _gather(value, world_size: int) -> list:
    if world_size == 1:
        return [value]
    out = [None] * world_size
    dist.all_gather_object(out, value)
    return out


class StepHistory:
    """The latest ``maxlen`` step timings of this rank.

    Args:
        maxlen: steps kept.
    """

    def __init__(self, maxlen: int = 20) -> None:
        self.steps: deque[StepTiming] = deque(maxlen=maxlen)

    def record(self, timing: StepTiming) -> None:
        """Add one step."""
        self.steps.append(timing)

    def seconds_per_row(self) -> float:
        """Median over the recorded steps of busy seconds per row (0.0 with no steps), so a first step's
        one-off costs (allocation, warm-up) do not skew it."""
        per_row = [t.busy / t.rows for t in self.steps if t.rows]
        return statistics.median(per_row) if per_row else 0.0

    def rebalance(self, plan: Plan, lane: int, world_size: int, stage: int = 0) -> Plan:
        """A new plan whose lane shares follow every lane's measured compute time per row (collective: every
        rank must call it with its ``stage`` and ``lane``). With stages of one width a lane counts its slowest
        stage; stages of different widths re-balance each stage's lanes by their own times. The history is
        cleared.

        Raises:
            PlanError: some lane has no measurement yet.
        """
        every = _gather((stage, lane, self.seconds_per_row()), world_size)
        self.steps.clear()
        if plan.uniform_width:  # a lane counts its slowest stage
            per_lane = [0.0] * plan.num_lanes
            for _, other, t in every:
                per_lane[other] = max(per_lane[other], t)
            return hardware.rebalance(plan, per_lane)
        per_stage = [[0.0] * plan.lanes_of(s) for s in range(plan.num_stages)]
        for st, other, t in every:
            per_stage[st][other] = t
        return hardware.rebalance(plan, per_stage)

    def stage_stats(self, plan: Plan, stage: int, world_size: int) -> list[dict]:
        """Per stage, mean busy (compute) seconds per step and the schedule's makespan over the recorded steps,
        gathered from all ranks (collective). ``idle_share = 1 - busy/step`` is the pipeline bubble plus
        stage-to-stage transfer time, comparable with (p-1)/(m+p-1)."""
        n = len(self.steps)
        mine = (stage, sum(t.busy for t in self.steps), sum(t.schedule for t in self.steps), n)
        every = _gather(mine, world_size)
        out = []
        for s in range(plan.num_stages):
            rows = [(b / k, w / k) for st, b, w, k in every if st == s and k]
            out.append({"stage": s, "busy": sum(r[0] for r in rows) / max(1, len(rows)),
                        "step": sum(r[1] for r in rows) / max(1, len(rows))})
        window = max(o["step"] for o in out)  # the schedule's makespan: the slowest stage's window
        for o in out:
            o["step"] = window
            o["idle_share"] = 1 - o["busy"] / window if window else 0.0
        return out
