"""Paired, order-balanced A-versus-B timing: the one helper every A-vs-B benchmark figure uses.

On a shared host step times drift by more than the differences measured, and whichever system runs first in a
round can be favoured (caches, the neighbours' load). So A and B run in alternating rounds in ABBA order
(round 0: A then B, round 1: B then A, ...), the first ``warmup`` rounds are discarded, and each round gives
one *paired ratio*: B's seconds over A's seconds in that round (the two measurements adjacent in time). A's
throughput over B's is then the median of the paired ratios, reported with its interquartile range, min, max
and count (:func:`summary`). A figure whose IQR straddles its goal is reported as ``goal_met: "unclear"``,
not as met.

Process-free: :func:`rounds` calls two zero-argument timers (each returns seconds; inside gloo ranks each
timer is wrapped in barriers by the caller so that every rank records the same round), and :func:`summary`
is plain statistics, unit-tested in ``tests/test_paired.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence


def abba(n_rounds: int) -> list[tuple[str, str]]:
    """The order of each round: ``("a", "b")`` for even rounds, ``("b", "a")`` for odd (A B B A A B ...)."""
    return [("a", "b") if i % 2 == 0 else ("b", "a") for i in range(n_rounds)]


def rounds(time_a: Callable[[], float], time_b: Callable[[], float], n_rounds: int,
           warmup: int = 1) -> tuple[list[float], list[float]]:
    """Run ``warmup + n_rounds`` rounds of A and B in ABBA order; the seconds of each measured round.

    Args:
        time_a, time_b: each runs one measurement of its system and returns its seconds (e.g. seconds per step
            over ``k`` steps).
        n_rounds: measured rounds (>= 1).
        warmup: rounds run first and discarded (in ABBA order too, so both systems are warmed alike).

    Returns:
        ``(a_seconds, b_seconds)``, one entry per measured round, in round order.

    Raises:
        ValueError: ``n_rounds < 1`` or ``warmup < 0``.
    """
    if n_rounds < 1 or warmup < 0:
        raise ValueError(f"paired rounds: n_rounds={n_rounds} must be >= 1 and warmup={warmup} >= 0")
    timers = {"a": time_a, "b": time_b}
    a, b = [], []
    for i, order in enumerate(abba(warmup + n_rounds)):
        got = {name: timers[name]() for name in order}
        if i >= warmup:
            a.append(got["a"])
            b.append(got["b"])
    return a, b


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(Q1, median, Q3) by linear interpolation between order statistics (``statistics.quantiles`` with
    ``method="inclusive"``); a single value is its own quartiles.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("quartiles of no values")
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def goal_met(q1: float, q3: float, goal: float | None, higher_is_better: bool = True) -> bool | str | None:
    """``True`` when the whole IQR ``[q1, q3]`` meets the goal, ``False`` when none of it does, ``"unclear"``
    when it straddles the goal, ``None`` without a goal."""
    if goal is None:
        return None
    lo, hi = (q1, q3) if higher_is_better else (-q3, -q1)
    g = goal if higher_is_better else -goal
    return True if lo >= g else False if hi < g else "unclear"


def summary(a_seconds: Sequence[float], b_seconds: Sequence[float], goal: float | None = None,
            names: tuple[str, str] = ("a", "b"), higher_is_better: bool = True) -> dict:
    """The paired ratios ``b_i / a_i`` (A's throughput over B's, round by round) and their statistics.

    Args:
        a_seconds, b_seconds: seconds of each measured round, paired by index (from :func:`rounds`).
        goal: the ratio's goal (``ratio >= goal`` when ``higher_is_better``, else ``ratio <= goal``).
        names: what A and B are, for the record.

    Returns:
        ``{"median", "q1", "q3", "iqr", "min", "max", "n", "goal", "goal_met", "ratios", "ratio",
        "a_median_s", "b_median_s"}``: ``iqr`` is ``[q1, q3]``; ``goal_met`` is from :func:`goal_met`.

    Raises:
        ValueError: the two lists differ in length, are empty, or hold a time <= 0.
    """
    if len(a_seconds) != len(b_seconds) or not a_seconds:
        raise ValueError(f"paired summary: {len(a_seconds)} A rounds vs {len(b_seconds)} B rounds; need equal, >= 1")
    if min(*a_seconds, *b_seconds) <= 0:
        raise ValueError("paired summary: every round's seconds must be > 0")
    ratios = [b / a for a, b in zip(a_seconds, b_seconds, strict=True)]
    q1, med, q3 = quartiles(ratios)
    return {"ratio": f"{names[1]} seconds / {names[0]} seconds per ABBA round ({names[0]}'s throughput over "
                     f"{names[1]}'s)",
            "median": med, "q1": q1, "q3": q3, "iqr": [q1, q3], "min": min(ratios), "max": max(ratios),
            "n": len(ratios), "goal": None if goal is None else f"{'>=' if higher_is_better else '<='} {goal}",
            "goal_met": goal_met(q1, q3, goal, higher_is_better), "ratios": ratios,
            "a_median_s": statistics.median(a_seconds), "b_median_s": statistics.median(b_seconds)}


def describe(s: dict) -> str:
    """One line: median [Q1, Q3] (n, goal, met/NOT met/unclear)."""
    met = {True: "met", False: "NOT met", "unclear": "unclear: IQR straddles the goal", None: "no goal"}[s["goal_met"]]
    return f"{s['median']:.3f} [IQR {s['q1']:.3f}, {s['q3']:.3f}] (n={s['n']}, goal {s['goal']}: {met})"
