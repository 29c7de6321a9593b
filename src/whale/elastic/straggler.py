"""The straggler controller: measures every rank's step, asks the planner, switches the shares without a restart.

Called by the training loop after every step (:meth:`StragglerController.after_step`). Each rank keeps its
latest ``window`` steps' compute seconds (the engine's measured busy time, emulated device time included) and
step seconds. Every ``every`` steps the ranks gather the medians (one ``all_gather_object``); the medians make a
single slow or fast step harmless. A lane's cost per row comes from its rows and median compute now, and, when a
switch changed its rows since the previous check, from the line through both measurements (its fixed part too:
:func:`whale.planner.straggler.lane_costs`). Every rank then runs the same pure decision
(:func:`whale.planner.straggler.plan_rebalance`) on the same numbers, so all switch at the same step, or none.
The switch cost weighed against the gain is measured: at the first check the controller times a switch to the
running plan itself (the engine's plan swap, the loaders' rows, a barrier; the collective batch checks of the
three steps after a real switch, a few milliseconds, are not in it). A switch only replaces the plan's
lane shares (:meth:`whale.Engine.switch_shares`): the processes, the modules and the optimizer state stay, and the
math stays that of one process (a token-weighted loss is normalised over the global batch whatever the shares).

``forced={step: lane_weights}`` replaces detection by switches at given steps: a reference run that switches to
the same plans at the same steps without any slowdown.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch.distributed as dist

from whale.plan.plan import PlanError
from whale.planner.straggler import RebalanceDecision, lane_costs, lane_rows, plan_rebalance

__all__ = ["StragglerController", "slow_down"]


def slow_down(engine, factor: float) -> float:
    """Emulation: make this rank's emulated device ``factor`` times slower from now on (its compute segments
    take ``factor`` x as long); returns the new slowdown.

    Raises:
        ValueError: ``factor`` <= 0, or the engine is not emulating a device (no cluster spec with emulate).
    """
    if not factor > 0:
        raise ValueError(f"slow_down needs a factor > 0 (compute time multiplier), got {factor}")
    if engine.slowdown is None:
        raise ValueError("slow_down needs an emulated cluster (a cluster spec with emulate: true); this engine runs "
                         "on real hardware")
    engine.slowdown = (1.0 + engine.slowdown) * factor - 1.0
    return engine.slowdown


def _gather(value) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class StragglerController:
    """Detects a straggler from measured step times and re-balances the data-parallel shares.

    Args:
        global_batch: rows per step (all lanes).
        total_steps: the run's last step (the gain counts the steps left).
        on_switch: ``fn(plan)`` called on every rank after a switch (set the loaders' rows there).
        every: check every this many steps (one gather).
        window: steps per median (>= 1; a check waits for a full window).
        threshold: smallest predicted relative gain that switches (noise guard).
        forced: ``{step: lane_weights}``: switch to these shares after these steps instead of detecting.
        log: where rank 0's decisions go (``print``; ``None``: silent).

    Attributes:
        events: one dict per switch: ``step``, ``rows_before``, ``rows_after``, ``predicted_speedup``,
            ``switch_s``, ``lane_weights``; ``checks``: the decisions of every check.
        switch_s: the measured switch cost (s), ``None`` before the first check.

    Raises:
        ValueError: ``every`` or ``window`` below 1, a negative ``threshold``.
    """

    def __init__(self, global_batch: int, total_steps: int, on_switch: Callable | None = None, every: int = 5,
                 window: int = 5, threshold: float = 0.05, forced: dict | None = None, log=print) -> None:
        if every < 1 or window < 1 or threshold < 0:
            raise ValueError(f"StragglerController needs every >= 1, window >= 1, threshold >= 0; got every={every}, "
                             f"window={window}, threshold={threshold}")
        self.global_batch, self.total_steps, self.on_switch = global_batch, total_steps, on_switch
        self.every, self.window, self.threshold = every, window, threshold
        self.forced = dict(forced or {})
        self.log = log
        self._busy: deque[float] = deque(maxlen=window)
        self._last: list | None = None  # every lane's (rows, median busy s) at the previous check
        self._step: deque[float] = deque(maxlen=window)
        self.events: list[dict] = []
        self.checks: list[RebalanceDecision] = []
        self.switch_s: float | None = None

    def after_step(self, engine, metrics: dict) -> RebalanceDecision | None:
        """Record the step just done (``metrics`` as :meth:`whale.Engine.step` returns them); on a check step
        decide and maybe switch (collective then: every rank must call it after every step). Returns the
        decision when it switched.

        Raises:
            PlanError: on a check, a plan whose stages differ in width (not re-balanced here).
        """
        self._busy.append(engine.history.steps[-1].busy)
        self._step.append(metrics["step_time"])
        done = engine.steps_done
        if self.forced:
            if done in self.forced:
                plan = dataclasses.replace(engine.plan, lane_weights=tuple(self.forced[done]))
                self._apply(engine, plan, done, None)
            return None
        if done % self.every or len(self._step) < self.window or done >= self.total_steps:
            return None
        return self._check(engine, done)

    def _check(self, engine, done: int) -> RebalanceDecision | None:
        """Gather the medians, decide (same numbers on every rank), switch if it pays."""
        every = _gather((engine.lane, statistics.median(self._busy), statistics.median(self._step)))
        if self.switch_s is None:
            self.switch_s = self._measure_switch(engine)
        plan = engine.plan
        if not plan.uniform_width:
            raise PlanError(f"straggler re-balancing needs stages of one width; this plan's widths are "
                            f"{plan.stage_widths}")
        rows = lane_rows(plan, self.global_batch)
        busy = [0.0] * plan.num_lanes  # a lane counts its slowest stage
        for lane, b, _ in every:
            busy[lane] = max(busy[lane], b)
        now = list(zip(rows, busy, strict=True))
        per_row, fixed = lane_costs(now, self._last)
        self._last = now
        other = max(step for *_, step in every) - max(busy)
        decision = plan_rebalance(plan, self.global_batch, per_row, other, self.total_steps - done, self.switch_s,
                                  self.threshold, fixed)
        self.checks.append(decision)
        if not decision.switch:
            return None
        self._apply(engine, decision.plan, done, decision)
        return decision

    def _measure_switch(self, engine) -> float:
        """Seconds of a switch to the running plan itself (the same work as a real switch), the slowest rank's."""
        t0 = time.perf_counter()
        engine.switch_shares(engine.plan)
        if self.on_switch is not None:
            self.on_switch(engine.plan)
        if dist.is_initialized():
            dist.barrier()
        return max(_gather(time.perf_counter() - t0))

    def _apply(self, engine, plan, done: int, decision: RebalanceDecision | None) -> None:
        before = list(lane_rows(engine.plan, self.global_batch))
        engine.switch_shares(plan)
        if self.on_switch is not None:
            self.on_switch(plan)
        self._busy.clear()
        self._step.clear()
        after = list(lane_rows(plan, self.global_batch))
        self.events.append({"step": done, "rows_before": before, "rows_after": after,
                            "predicted_speedup": decision.speedup if decision else None,
                            "switch_s": self.switch_s, "lane_weights": list(plan.lane_weights)})
        if self.log is not None and engine.rank == 0:
            self.log(f"after step {done}: " + (decision.describe() if decision else
                                                f"straggler: switching to the given shares: rows per lane {before} -> "
                                                f"{after}"))
