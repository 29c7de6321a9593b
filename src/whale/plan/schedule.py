"""Pipeline schedules as data: one list of actions per stage, plus the formulas that follow from them.

An action is ``F{m}`` (forward of micro-batch m) or ``B{m}`` (backward of m). Communication is implied:
``F`` on stage s > 0 first receives its inputs from stage s-1, ``F`` on s < S-1 then sends its outputs to
s+1; ``B`` on s < S-1 first receives output gradients from s+1 and ``B`` on s > 0 then sends input gradients
to s-1. Sends are asynchronous, receives block: :func:`validate` checks that a schedule cannot deadlock
under these rules.

Sources: GPipe (Huang et al., 2019) runs all forwards, then all backwards; 1F1B (PipeDream-Flush,
Narayanan et al., 2021) runs ``S - s`` warm-up forwards on stage s, then alternates one forward and one
backward, bounding in-flight micro-batches on stage s by ``S - s``. On equal stages both leave every stage idle
for (p-1)/(m+p-1) of the step (p stages, m micro-batches): :func:`bubble_fraction`.

This module is pure data and arithmetic: it imports nothing from the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["1F1B", "GPipe"]
"""Name of a pipeline schedule."""

SCHEDULES: tuple[ScheduleName, ...] = ("1F1B", "GPipe")
"""Every schedule Whale can build and run, the default first."""


class ScheduleError(ValueError):
    """A schedule that is malformed or would deadlock; the message names stage, action and reason."""


@dataclass(frozen=True)
class Action:
    """One unit of stage work: ``kind`` ``"F"`` or ``"B"`` for micro-batch ``mb``."""

    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


Schedule = list[list[Action]]


def gpipe(num_stages: int, num_micro_batch: int) -> Schedule:
    """GPipe: every stage runs ``F0..F{m-1}`` then ``B0..B{m-1}``."""
    _check_sizes(num_stages, num_micro_batch)
    one = [Action("F", i) for i in range(num_micro_batch)] + [Action("B", i) for i in range(num_micro_batch)]
    return [list(one) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_micro_batch: int) -> Schedule:
    """1F1B: stage s warms up with ``min(S - s, m)`` forwards, then alternates B and F, then drains."""
    _check_sizes(num_stages, num_micro_batch)
    out: Schedule = []
    for s in range(num_stages):
        warm = in_flight_micro_batches(s, num_stages, num_micro_batch, "1F1B")
        acts = [Action("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < num_micro_batch:
            acts.append(Action("B", b))
            b += 1
            if f < num_micro_batch:
                acts.append(Action("F", f))
                f += 1
        out.append(acts)
    return out


def make_schedule(kind: str, num_stages: int, num_micro_batch: int) -> Schedule:
    """Build the named schedule (one of :data:`SCHEDULES`) and validate it.

    Raises:
        ScheduleError: an unknown name, or fewer than one stage or micro-batch.
    """
    builders = {"1F1B": one_f_one_b, "GPipe": gpipe}
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; choose one of {list(SCHEDULES)}")
    sched = builders[kind](num_stages, num_micro_batch)
    validate(sched, num_micro_batch)
    return sched


def _check_sizes(num_stages: int, num_micro_batch: int) -> None:
    if num_stages < 1 or num_micro_batch < 1:
        raise ScheduleError(f"need >= 1 stage and >= 1 micro-batch, got {num_stages} and {num_micro_batch}")


def validate(schedule: Schedule, num_micro_batch: int) -> None:
    """Check a schedule: each stage runs F and B of every micro-batch exactly once, F before B, and the
    whole pipeline completes when receives block and sends do not (every send is matched by a receive).

    Raises:
        ScheduleError: naming the stage and the offending action, or the actions stuck in a deadlock.
    """
    for s, acts in enumerate(schedule):
        for kind in "FB":
            got = sorted(a.mb for a in acts if a.kind == kind)
            if got != list(range(num_micro_batch)):
                raise ScheduleError(f"stage {s}: {kind} actions cover micro-batches {got}, "
                                    f"expected each of 0..{num_micro_batch - 1} once")
        seen: set[int] = set()
        for a in acts:
            if a.kind == "F":
                seen.add(a.mb)
            elif a.mb not in seen:
                raise ScheduleError(f"stage {s}: B{a.mb} comes before F{a.mb}")
    _simulate_order(schedule)


def _ready(schedule: Schedule, s: int, a: Action, done: set[tuple[int, str, int]]) -> bool:
    last = len(schedule) - 1
    if a.kind == "F":
        return s == 0 or (s - 1, "F", a.mb) in done
    return s == last or (s + 1, "B", a.mb) in done


def _simulate_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """Run the schedule in lock-step rounds; return the global completion order or raise on deadlock."""
    pos = [0] * len(schedule)
    done: set[tuple[int, str, int]] = set()
    order: list[tuple[int, Action]] = []
    while any(p < len(acts) for p, acts in zip(pos, schedule, strict=True)):
        progressed = False
        for s, acts in enumerate(schedule):
            if pos[s] < len(acts) and _ready(schedule, s, acts[pos[s]], done):
                a = acts[pos[s]]
                done.add((s, a.kind, a.mb))
                order.append((s, a))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} waits at {acts[pos[s]]}" for s, acts in enumerate(schedule) if pos[s] < len(acts)]
            raise ScheduleError("schedule deadlocks: " + "; ".join(stuck))
    return order


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of micro-batches whose forward ran but whose backward has not (activation memory)."""
    live, peak = 0, 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(schedule: Schedule, fwd: list[float], bwd: list[float], comm: float = 0.0) -> dict:
    """Event simulation of one step: per-stage forward/backward times (seconds per micro-batch) and a fixed
    P2P latency ``comm`` per transfer. Returns ``{"step": t, "busy": [..], "idle_share": [..]}``.

    With equal stages and ``comm = 0`` the idle share of every stage is :func:`bubble_fraction`. One lane of
    :func:`simulate_lanes`.
    """
    m = len(schedule[0]) // 2
    out = simulate_lanes(schedule, [[[f] * m] for f in fwd], [[[b] * m] for b in bwd],
                         [[comm] for _ in schedule])
    step = max(c for lanes in out["end"] for c in lanes)
    busy = [m * (fwd[s] + bwd[s]) for s in range(len(schedule))]
    return {"step": step, "busy": busy, "idle_share": [1 - b / step for b in busy]}


def simulate_lanes(schedule: Schedule, fwd: list[list[list[float]]], bwd: list[list[list[float]]],
                   comm: list[list[float]], peers: list[list[list[int]]] | None = None) -> dict:
    """Event simulation of one step's schedule over every (stage, lane) rank.

    Args:
        schedule: one action list per stage (every lane of a stage runs it).
        fwd, bwd: ``[stage][lane][micro-batch]`` seconds of each forward / backward.
        comm: ``[stage][lane]`` seconds of one transfer from that lane across the boundary to stage + 1
            (activations forward; the same for their gradients backward; ignored on the last stage).
        peers: ``[stage][lane]`` lanes of stage + 1 the lane exchanges rows with (default: the same lane).

    A forward starts when its rank is free and every transfer into it has arrived (receives block; sends are
    asynchronous), a backward likewise from stage + 1. Returns ``{"end": [stage][lane] seconds the schedule ends
    on that rank, "busy": [stage][lane] compute seconds, "events": [(stage, lane, "F"|"B", mb, start, end)]}``.

    Raises:
        ScheduleError: the schedule deadlocks; ValueError: a cost list of the wrong shape.
    """
    lanes = [len(f) for f in fwd]
    if len(fwd) != len(schedule) or len(bwd) != len(schedule) or [len(b) for b in bwd] != lanes:
        raise ValueError(f"fwd/bwd must be [stage][lane][micro-batch] for {len(schedule)} stages, got "
                         f"{lanes} and {[len(b) for b in bwd]} lanes")
    peers = peers or [[[j] for j in range(n)] for n in lanes]
    feeds = [[[j for j in range(lanes[s - 1]) if lane in peers[s - 1][j]] if s else [] for lane in range(lanes[s])]
             for s in range(len(schedule))]
    finish: dict[tuple[int, int, str, int], float] = {}
    clock = [[0.0] * n for n in lanes]
    events = []
    for s, a in _simulate_order(schedule):
        for lane in range(lanes[s]):
            if a.kind == "F":
                dep = max((finish[(s - 1, j, "F", a.mb)] + comm[s - 1][j] for j in feeds[s][lane]), default=0.0)
                cost = fwd[s][lane][a.mb]
            else:
                dep = max((finish[(s + 1, j, "B", a.mb)] + comm[s][lane] for j in peers[s][lane]), default=0.0) \
                    if s < len(schedule) - 1 else 0.0
                cost = bwd[s][lane][a.mb]
            start = max(clock[s][lane], dep)
            clock[s][lane] = start + cost
            finish[(s, lane, a.kind, a.mb)] = clock[s][lane]
            events.append((s, lane, a.kind, a.mb, start, clock[s][lane]))
    busy = [[sum(fwd[s][lane]) + sum(bwd[s][lane]) for lane in range(n)] for s, n in enumerate(lanes)]
    return {"end": clock, "busy": busy, "events": events}


def in_flight_micro_batches(stage: int, num_stages: int, num_micro_batch: int,
                            schedule: ScheduleName = "1F1B") -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) of ``num_stages`` holds at once.

    1F1B: min(S - s, m) (stage s runs S - s forwards before its first backward); GPipe: m (all forwards
    first). This is :func:`max_in_flight` of the built schedule's stage, in closed form.

    Raises:
        ValueError: ``stage`` outside ``[0, num_stages)``, a count below 1, or an unknown schedule; the
            message names the values.
    """
    if num_stages < 1 or num_micro_batch < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"need 0 <= stage < num_stages and counts >= 1, got stage={stage}, "
                         f"num_stages={num_stages}, num_micro_batch={num_micro_batch}")
    if schedule == "1F1B":
        return min(num_stages - stage, num_micro_batch)
    if schedule == "GPipe":
        return num_micro_batch
    raise ValueError(f"schedule {schedule!r} is unknown; choose one of {list(SCHEDULES)}")


def bubble_fraction(num_stages: int, num_micro_batch: int) -> float:
    """Idle share of every stage in a GPipe or 1F1B step on equal stages with free communication:
    (p-1)/(m+p-1) for p stages and m micro-batches (Huang et al. 2019; Narayanan et al. 2021).

    Raises:
        ScheduleError: fewer than one stage or micro-batch.
    """
    _check_sizes(num_stages, num_micro_batch)
    return (num_stages - 1) / (num_micro_batch + num_stages - 1)


def format_schedule(schedule: Schedule) -> str:
    """Readable printout, one line per stage: ``stage 0: F0 F1 B0 F2 B1 ...``."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(schedule))
