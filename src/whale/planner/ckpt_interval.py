"""Checkpoint interval from the measured save cost: lose at most N seconds of work, keep the save overhead bounded.

A job that saves every ``k`` steps of ``t_step`` seconds each, a save costing ``t_save`` seconds, loses on a
failure at worst the ``k`` steps since the last published checkpoint plus the save in flight:
``lost(k) = k * t_step + t_save`` seconds. It spends ``overhead(k) = t_save / (k * t_step)`` of its training time
saving. The interval is the largest ``k`` with ``lost(k) <= max_lost_s`` (fewest saves within the user's loss
target) as long as ``overhead(k) <= max_overhead``; when the two bounds conflict (a save too slow for the loss
target) the overhead bound wins: ``k`` is the smallest interval with ``overhead(k) <= max_overhead``, and the
choice says that the loss target is then exceeded. This is the "target loss of at most N seconds of work" form of
issue 29; Young (1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9)) and Daly
(2006, FGCS 22(3)) instead minimise the expected waste for a known MTBF, ``sqrt(2 * t_save * MTBF)``, which
:func:`young_daly_seconds` gives for comparison. Pure functions, no processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["IntervalChoice", "checkpoint_interval", "young_daly_seconds"]


@dataclass(frozen=True)
class IntervalChoice:
    """The chosen interval.

    Attributes:
        steps: checkpoint every this many steps (>= 1).
        bound: which bound set it: ``"max_lost_seconds"`` (the loss target; the overhead stays within its
            bound), ``"max_overhead"`` (the bounds conflict: the overhead bound wins, the loss target is exceeded)
            or ``"max_steps"`` (both hold for any interval up to the cap).
        lost_seconds: worst-case work lost on a failure, ``steps * step_s + save_s``.
        overhead: share of training time spent saving, ``save_s / (steps * step_s)``.
    """

    steps: int
    bound: str
    lost_seconds: float
    overhead: float

    def describe(self) -> str:
        """One line for the job's log."""
        why = {"max_lost_seconds": "the loss target sets it", "max_steps": "capped at the run's length",
               "max_overhead": "the loss target cannot hold without exceeding the overhead bound; the overhead "
                               "bound wins"}[self.bound]
        return (f"checkpoint every {self.steps} step(s): worst-case loss {self.lost_seconds:.2f} s of work, save "
                f"overhead {self.overhead:.1%} ({why})")


def _lost(k: int, step_s: float, save_s: float) -> float:
    return k * step_s + save_s


def _overhead(k: int, step_s: float, save_s: float) -> float:
    return save_s / (k * step_s)


def checkpoint_interval(step_s: float, save_s: float, max_lost_s: float, max_overhead: float = 0.1,
                        max_steps: int | None = None) -> IntervalChoice:
    """The checkpoint interval in steps (see the module docstring for the rule).

    Args:
        step_s: measured seconds per training step (> 0), e.g. the median of the first steps.
        save_s: measured seconds of one checkpoint save (>= 0), e.g. the job's first save.
        max_lost_s: work (seconds) a failure may lose at most (> 0).
        max_overhead: largest share of training time spent saving (0 < r <= 1).
        max_steps: cap on the interval (the steps left in the run), or ``None``.

    Returns:
        :class:`IntervalChoice`.

    Raises:
        ValueError: a non-positive ``step_s``, ``max_lost_s``, ``max_steps``, a negative ``save_s`` or an
            ``max_overhead`` outside (0, 1], named with its value.
    """
    if not step_s > 0 or not save_s >= 0 or not max_lost_s > 0 or not 0 < max_overhead <= 1:
        raise ValueError(f"checkpoint_interval needs step_s > 0, save_s >= 0, max_lost_s > 0 and 0 < max_overhead "
                         f"<= 1; got step_s={step_s}, save_s={save_s}, max_lost_s={max_lost_s}, "
                         f"max_overhead={max_overhead}")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"checkpoint_interval needs max_steps >= 1 or None, got {max_steps}")
    k_loss = max(0, math.floor((max_lost_s - save_s) / step_s))  # largest k with lost(k) <= max_lost_s
    while k_loss > 0 and _lost(k_loss, step_s, save_s) > max_lost_s:
        k_loss -= 1
    while _lost(k_loss + 1, step_s, save_s) <= max_lost_s:
        k_loss += 1
    k_over = max(1, math.ceil(save_s / (max_overhead * step_s)))  # smallest k with overhead(k) <= max_overhead
    while k_over > 1 and _overhead(k_over - 1, step_s, save_s) <= max_overhead:
        k_over -= 1
    while _overhead(k_over, step_s, save_s) > max_overhead:
        k_over += 1
    if k_loss >= k_over:
        k, bound = k_loss, "max_lost_seconds"
        if max_steps is not None and k >= max_steps:
            k, bound = max_steps, "max_steps"
            if k < k_over:
                k, bound = k_over, "max_overhead"
    else:
        k, bound = k_over, "max_overhead"
    return IntervalChoice(k, bound, _lost(k, step_s, save_s), _overhead(k, step_s, save_s))


def young_daly_seconds(save_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum checkpoint interval, ``sqrt(2 * save_s * mtbf_s)`` seconds of work,
    which Daly (2006) shows is the leading term of the optimum for ``save_s << mtbf_s``.

    Raises:
        ValueError: a negative ``save_s`` or a non-positive ``mtbf_s``.
    """
    if not save_s >= 0 or not mtbf_s > 0:
        raise ValueError(f"young_daly_seconds needs save_s >= 0 and mtbf_s > 0, got {save_s}, {mtbf_s}")
    return math.sqrt(2.0 * save_s * mtbf_s)
