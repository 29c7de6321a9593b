"""Straggler re-balancing, decided: new data-parallel shares for measured speeds, the predicted gain, and whether
it pays for the switch.

A device that slows down mid-run (thermal throttling, a noisy neighbour, a failing part) makes every synchronous
data-parallel step wait for it. Given each lane's measured compute seconds per row (the median over a window of
recent steps, gathered from every rank; a lane counts its slowest pipeline stage) the step is modelled as
``other_s + max_lane(fixed_lane + rows_lane * seconds_per_row_lane)``: the lanes' compute, the slowest one
deciding, plus what the shares do not change (gradient sync, optimizer, the pipeline's fill and drain),
``other_s``, measured as the median step time minus the slowest lane's median compute. ``fixed_lane`` is the
lane's compute that does not scale with its rows (kernel launches, the per-segment overheads); it is 0 unless the
lane was measured at two row counts (:func:`lane_costs` fits the line through them). The new shares are the exact
min-max whole-row split of every micro-batch (:func:`whale.plan.shares.min_max_shares` with each lane's
``fixed / m`` and seconds per row; with no fixed part this is the split :func:`whale.planner.hardware.rebalance`'s
weights ``1 / seconds_per_row`` give). The switch is worth it when the predicted speedup exceeds ``1 +
threshold`` (measurement noise must not flip shares back and forth) and the predicted seconds saved over the
remaining steps exceed the measured switch cost. Pure functions: the controller that measures and applies is
:mod:`whale.elastic.straggler`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from whale.plan.plan import Plan, PlanError
from whale.plan.shares import min_max_shares
from whale.planner.hardware import rebalance

__all__ = ["RebalanceDecision", "lane_seconds_per_row", "lane_costs", "lane_rows", "predict_step_seconds",
           "plan_rebalance"]


@dataclass(frozen=True)
class RebalanceDecision:
    """What :func:`plan_rebalance` decided.

    Attributes:
        switch: re-balance now.
        plan: the re-balanced plan (the candidate, also when ``switch`` is false).
        rows_before, rows_after: rows per step of every lane under the current and the new shares.
        step_before_s, step_after_s: predicted seconds per step under each.
        speedup: ``step_before_s / step_after_s`` (throughput after over before).
        gain_s: predicted seconds saved over the remaining steps (``remaining * (before - after)``).
        switch_s: the switch cost it was weighed against (s).
        reason: why (one line).
    """

    switch: bool
    plan: Plan
    rows_before: tuple[int, ...]
    rows_after: tuple[int, ...]
    step_before_s: float
    step_after_s: float
    speedup: float
    gain_s: float
    switch_s: float
    reason: str

    def describe(self) -> str:
        """One line for the job's log."""
        verb = "re-balancing" if self.switch else "keeping the shares"
        return (f"straggler: {verb}: rows per lane {list(self.rows_before)} -> {list(self.rows_after)}, predicted "
                f"step {self.step_before_s:.3f} s -> {self.step_after_s:.3f} s (x{self.speedup:.2f}), gain "
                f"{self.gain_s:.1f} s over the remaining steps vs switch cost {self.switch_s:.3f} s: {self.reason}")


def lane_seconds_per_row(plan: Plan, measured: Sequence[tuple[int, int, float]]) -> list[float]:
    """Per lane, the seconds per row of its slowest stage, from every rank's ``(stage, lane, seconds_per_row)``.

    Raises:
        PlanError: stages of different widths (re-balancing those is not done), or a lane without a positive
            measurement.
    """
    if not plan.uniform_width:
        raise PlanError(f"straggler re-balancing needs stages of one width; this plan's widths are "
                        f"{plan.stage_widths} (re-balance each stage's lanes with Engine.rebalance instead)")
    per_lane = [0.0] * plan.num_lanes
    for _, lane, spr in measured:
        per_lane[lane] = max(per_lane[lane], spr)
    if any(not t > 0 for t in per_lane):
        raise PlanError(f"straggler re-balancing needs a positive seconds-per-row measurement for every lane, got "
                        f"{per_lane}")
    return per_lane


def lane_costs(now: Sequence[tuple[int, float]], before: Sequence[tuple[int, float]] | None = None
               ) -> tuple[list[float], list[float]]:
    """Per lane, ``(seconds_per_row, fixed_seconds)`` from its measured ``(rows, busy seconds)`` per step.

    With only ``now`` (or the same rows before), the cost is proportional: ``busy / rows`` per row, no fixed part.
    With ``before`` at rows differing by at least 2, the line through the two points: ``busy = fixed + rows *
    per_row``, kept when ``per_row > 0`` and ``fixed >= 0`` (otherwise the speed changed between the two
    measurements, and the proportional cost of ``now`` is used).

    Raises:
        PlanError: a lane with no rows or no positive busy time now.
    """
    per_row, fixed = [], []
    for lane, (rows, busy) in enumerate(now):
        if rows < 1 or not busy > 0:
            raise PlanError(f"straggler re-balancing needs every lane's rows >= 1 and busy seconds > 0; lane {lane} "
                            f"has {rows} rows, {busy} s")
        b, a = busy / rows, 0.0
        if before is not None and abs(rows - before[lane][0]) >= 2:
            slope = (busy - before[lane][1]) / (rows - before[lane][0])
            if slope > 0 and busy - slope * rows >= 0:
                b, a = slope, busy - slope * rows
        per_row.append(b)
        fixed.append(a)
    return per_row, fixed


def lane_rows(plan: Plan, global_batch: int) -> tuple[int, ...]:
    """Rows per step of every lane (all micro-batches together) under ``plan``'s shares."""
    return tuple(sum(b - a for a, b in lane) for lane in plan.micro_batch_rows(global_batch, 0))


def predict_step_seconds(plan: Plan, global_batch: int, seconds_per_row: Sequence[float], other_s: float,
                         fixed_s: Sequence[float] | None = None) -> float:
    """``other_s + max_lane(fixed_s[lane] + rows_lane * seconds_per_row[lane])`` under ``plan``'s shares (s)."""
    rows = lane_rows(plan, global_batch)
    fixed = fixed_s if fixed_s is not None else [0.0] * len(rows)
    return other_s + max(f + r * t for r, t, f in zip(rows, seconds_per_row, fixed, strict=True))


def plan_rebalance(plan: Plan, global_batch: int, seconds_per_row: Sequence[float], other_s: float,
                   remaining_steps: int, switch_s: float, threshold: float = 0.05,
                   fixed_s: Sequence[float] | None = None) -> RebalanceDecision:
    """Decide whether to re-balance the lanes' shares (see the module docstring).

    Args:
        plan: the running plan (stages of one width).
        global_batch: rows per step.
        seconds_per_row: per lane, measured compute seconds per row (:func:`lane_seconds_per_row`).
        other_s: measured seconds of the step the shares do not change (>= 0; clamped at 0).
        remaining_steps: steps left in the run.
        switch_s: measured cost of a switch (s).
        threshold: smallest predicted relative gain worth a switch (noise guard), e.g. 0.05 for 5%.
        fixed_s: per lane, compute seconds per step that do not scale with its rows (:func:`lane_costs`).

    Raises:
        PlanError: as :func:`whale.planner.hardware.rebalance` and :meth:`Plan.micro_batch_rows`.
    """
    other = max(0.0, other_s)
    new = rebalance(plan, list(seconds_per_row))
    if fixed_s is not None and any(f > 0 for f in fixed_s):  # whole rows per micro-batch as the lane weights
        m = plan.num_micro_batch
        rows = min_max_shares(global_batch // m, list(seconds_per_row), [f / m for f in fixed_s], min_share=1)
        new = dataclasses.replace(new, lane_weights=tuple(float(r) for r in rows))
    before = predict_step_seconds(plan, global_batch, seconds_per_row, other, fixed_s)
    after = predict_step_seconds(new, global_batch, seconds_per_row, other, fixed_s)
    speedup = before / after if after > 0 else 1.0
    gain = remaining_steps * (before - after)
    if speedup <= 1.0 + threshold:
        switch, reason = False, f"predicted gain below the {threshold:.0%} threshold"
    elif gain <= switch_s:
        switch, reason = False, "the gain over the remaining steps does not pay for the switch"
    else:
        switch, reason = True, "the gain over the remaining steps exceeds the switch cost"
    return RebalanceDecision(switch, new, lane_rows(plan, global_batch), lane_rows(new, global_batch), before, after,
                             speedup, gain, switch_s, reason)
