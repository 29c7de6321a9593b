"""Pipeline schedules as data: one list of actions per stage (rank position), plus the formulas that follow.

An action is ``F{m}`` (forward of micro-batch m), ``B{m}`` (backward of m: the full backward, or under
zero-bubble only the input-gradient pass) or ``W{m}`` (zero-bubble: the weight-gradient pass of m), each of one
model *chunk* (``F{m}c{c}``; chunk 0 is printed bare). With ``v`` chunks per rank (interleaved schedules) chunk
c of rank r runs virtual stage ``c*p + r`` of ``p*v`` (Narayanan et al. SC'21 §2.2); with one chunk the virtual
stage is the rank. Communication is implied: ``F`` of virtual stage s > 0 first receives its inputs from s-1,
``F`` of s < S-1 then sends its outputs to s+1; ``B`` of s < S-1 first receives output gradients from s+1 and
``B`` of s > 0 then sends input gradients to s-1; ``W`` communicates nothing. Sends are asynchronous, receives
block: :func:`validate` checks that a schedule cannot deadlock under these rules.

Sources: GPipe (Huang et al., 2019) runs all forwards, then all backwards; 1F1B (PipeDream-Flush,
Narayanan et al., 2021) runs ``S - s`` warm-up forwards on stage s, then alternates one forward and one
backward, bounding in-flight micro-batches on stage s by ``S - s``. On equal stages both leave every stage idle
for (p-1)/(m+p-1) of the step (p stages, m micro-batches): :func:`bubble_fraction`. Interleaved 1F1B
(:func:`interleaved_1f1b`) and zero-bubble ZB-H1 (:func:`zb_h1`) are described at their builders;
:func:`schedule_bubble` gives each schedule's formula.

This module is pure data and arithmetic: it imports nothing from the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["1F1B", "GPipe", "Interleaved1F1B", "ZB-H1"]
"""Name of a pipeline schedule."""

SCHEDULES: tuple[ScheduleName, ...] = ("1F1B", "GPipe")
"""The schedules the planner searches over (and prices), the default first."""

RUNNABLE_SCHEDULES: tuple[ScheduleName, ...] = ("1F1B", "GPipe", "Interleaved1F1B", "ZB-H1")
"""Every schedule Whale can build and run: :data:`SCHEDULES`, interleaved 1F1B and zero-bubble ZB-H1."""


class ScheduleError(ValueError):
    """A schedule that is malformed or would deadlock; the message names stage, action and reason."""


@dataclass(frozen=True)
class Action:
    """One unit of stage work: ``kind`` ``"F"``, ``"B"`` or ``"W"`` for micro-batch ``mb`` of model chunk
    ``chunk`` (0 unless the schedule is interleaved)."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


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


def interleaved_1f1b(num_stages: int, num_micro_batch: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21 §2.2; the order of Megatron-LM's interleaved schedule): each
    of the p ranks holds v chunks, chunk c of rank r being virtual stage ``c*p + r``. Forwards go through the
    chunks in groups of p micro-batches (chunk 0 for micro-batches 0..p-1, chunk 1 for the same, ..., then the
    next p micro-batches), backwards likewise from the last chunk. Rank r warms up with
    ``min(2*(p - r - 1) + (v - 1)*p, m*v)`` forwards, then alternates one forward and one backward, then drains.

    On equal stages with free communication the bubble is ``(p-1)/(v*m)`` of the ideal step time: each rank
    idles ``(p-1)`` chunk-forward-backward times, ``1/v`` of a 1F1B stage's (:func:`schedule_bubble`). Activation
    memory on rank r peaks at ``min(2*(p-r-1) + (v-1)*p + 1, m*v)`` chunk micro-batches of ``1/v`` of the
    rank's layers each (rank 0: about ``p + (p-1)/v`` stage micro-batches against 1F1B's p, the paper's
    "slightly more memory"; :func:`in_flight_micro_batches`).

    Raises:
        ScheduleError: a count below 1, or ``m`` not a multiple of p (the micro-batches go through the chunks in
            groups of p; Megatron-LM has the same rule), naming the value and the nearest valid counts.
    """
    p, m, v = num_stages, num_micro_batch, virtual_stages
    _check_sizes(p, m)
    if v < 1:
        raise ScheduleError(f"virtual_stages must be >= 1, got {v}")
    if m % p:
        lo, hi = max(p, m - m % p), m - m % p + p
        raise ScheduleError(f"Interleaved1F1B needs num_micro_batch a multiple of the {p} pipeline stages, got {m}; "
                            f"use {lo} or {hi} micro-batches")
    total = m * v

    def at(k: int, backward: bool) -> tuple[int, int]:
        """``(chunk, micro-batch)`` of a stage's ``k``-th forward (or backward) in the interleaved order."""
        group, within = divmod(k, p * v)
        chunk = within // p
        return (v - 1 - chunk if backward else chunk), group * p + within % p

    out: Schedule = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [Action("F", *reversed(at(k, False))) for k in range(warm)]
        for i in range(total - warm):
            acts.append(Action("F", *reversed(at(warm + i, False))))
            acts.append(Action("B", *reversed(at(i, True))))
        acts += [Action("B", *reversed(at(k, True))) for k in range(total - warm, total)]
        out.append(acts)
    return out


def zb_h1(num_stages: int, num_micro_batch: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3): the backward is split
    into ``B`` (gradients of the stage's inputs, which the previous stage waits for) and ``W`` (gradients of its
    weights, which nobody waits for). Stage s keeps 1F1B's order of F and B (``min(p - s, m)`` warm-up
    forwards) and places each W where the rank would otherwise wait, as a unit-time list schedule
    (F = B = W): a W runs when the next F/B is not ready, or when one more forward would hold more than p
    micro-batches (F done, W not) — the peak activation memory of 1F1B (p micro-batches on stage 0), the
    "H1" memory limit — and the remaining Ws close the step.

    On equal stages with free communication, T_F = T_B = T_W and m >= p the bubble is ``(p-1)(T_F + T_B - T_W)``
    per rank against 1F1B's ``(p-1)(T_F + T_B + T_W)``: a third (:func:`schedule_bubble`, which also gives
    m < p). Memory: at most p
    micro-batches' activations per stage (the W keeps those the weight gradient needs: a stage's inputs to
    each linear layer, until its W).

    Raises:
        ScheduleError: a count below 1.
    """
    p, m = num_stages, num_micro_batch
    _check_sizes(p, m)
    order = [[a for a in acts] for acts in one_f_one_b(p, m)]  # the F/B order of each stage
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, mb) -> unit time it ends
    out: Schedule = [[] for _ in range(p)]
    pos, clock, pending = [0] * p, [0] * p, [[] for _ in range(p)]
    while any(pos[s] < len(order[s]) or pending[s] for s in range(p)):
        s = min(range(p), key=lambda r: (clock[r] if pos[r] < len(order[r]) or pending[r] else 1 << 30, r))
        act = order[s][pos[s]] if pos[s] < len(order[s]) else None
        ready_at = _unit_ready(act, s, p, done) if act is not None else None
        live = sum(1 for a in out[s] if a.kind == "F") - sum(1 for a in out[s] if a.kind == "W")
        over = act is not None and act.kind == "F" and live >= p
        if pending[s] and (act is None or over or ready_at is None or ready_at > clock[s]):
            act = pending[s].pop(0)
        elif ready_at is None:  # not ready and nothing to fill: jump to the next event
            clock[s] = min(t for t in done.values() if t > clock[s]) if any(t > clock[s] for t in done.values()) \
                else clock[s] + 1
            continue
        else:
            clock[s] = max(clock[s], ready_at)
            pos[s] += 1
            if act.kind == "B":
                pending[s].append(Action("W", act.mb))
        clock[s] += 1
        done[(s, act.kind, act.mb)] = clock[s]
        out[s].append(act)
    return out


def _unit_ready(a: Action, s: int, p: int, done: dict) -> int | None:
    """Unit time at which ``a`` of stage s can start (its input arrived), or None if not yet known."""
    if a.kind == "F":
        return 0 if s == 0 else done.get((s - 1, "F", a.mb))
    return done.get((s, "F", a.mb)) if s == p - 1 else done.get((s + 1, "B", a.mb))


def make_schedule(kind: str, num_stages: int, num_micro_batch: int, virtual_stages: int = 1) -> Schedule:
    """Build the named schedule (one of :data:`RUNNABLE_SCHEDULES`) and validate it. ``virtual_stages``: chunks
    per rank, ``Interleaved1F1B`` only (1 elsewhere).

    Raises:
        ScheduleError: an unknown name, fewer than one stage or micro-batch, ``virtual_stages`` other than 1
            for a schedule without chunks, or the interleaved schedule's micro-batch rule.
    """
    if kind not in RUNNABLE_SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; choose one of {list(RUNNABLE_SCHEDULES)}")
    if kind == "Interleaved1F1B":
        sched = interleaved_1f1b(num_stages, num_micro_batch, virtual_stages)
    elif virtual_stages != 1:
        raise ScheduleError(f"virtual_stages={virtual_stages} needs schedule 'Interleaved1F1B', not {kind!r}; "
                            "use virtual_stages=1 or the interleaved schedule")
    else:
        sched = {"1F1B": one_f_one_b, "GPipe": gpipe, "ZB-H1": zb_h1}[kind](num_stages, num_micro_batch)
    validate(sched, num_micro_batch)
    return sched


def _check_sizes(num_stages: int, num_micro_batch: int) -> None:
    if num_stages < 1 or num_micro_batch < 1:
        raise ScheduleError(f"need >= 1 stage and >= 1 micro-batch, got {num_stages} and {num_micro_batch}")


def num_chunks(schedule: Schedule) -> int:
    """Model chunks per rank (virtual stages per rank) a schedule runs: 1 + its largest chunk index."""
    return 1 + max((a.chunk for acts in schedule for a in acts), default=0)


def validate(schedule: Schedule, num_micro_batch: int, positions: tuple[int, ...] | None = None) -> None:
    """Check a schedule: each rank runs F and B of every (chunk, micro-batch) exactly once, W of each once or
    never (then B is the full backward), F before B before W, and the whole pipeline completes when receives
    block and sends do not (every send is matched by a receive). ``positions``: the model chunk -> position
    map (:func:`chunk_ids`; default round-robin).

    Raises:
        ScheduleError: naming the stage and the offending action, or the actions stuck in a deadlock.
    """
    ids = chunk_ids(schedule, positions)
    for s, acts in enumerate(schedule):
        for c in range(len(ids[s])):
            for kind in "FBW":
                got = sorted(a.mb for a in acts if a.kind == kind and a.chunk == c)
                if got != list(range(num_micro_batch)) and (kind != "W" or got):
                    where = f" of chunk {c}" if c else ""
                    raise ScheduleError(f"stage {s}: {kind} actions{where} cover micro-batches {got}, "
                                        f"expected each of 0..{num_micro_batch - 1} once")
        seen: set[tuple[str, int, int]] = set()
        for a in acts:
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before is not None and (before, a.chunk, a.mb) not in seen:
                raise ScheduleError(f"stage {s}: {a} comes before {Action(before, a.mb, a.chunk)}")
            seen.add((a.kind, a.chunk, a.mb))
    completion_order(schedule, positions)


def chunk_ids(schedule: Schedule, positions: tuple[int, ...] | None = None) -> list[list[int]]:
    """``[position][local chunk]`` -> model chunk. ``positions[c]`` is the position of model chunk c (its local
    chunks in model order: :mod:`whale.plan.schedule_chunks`); default round-robin, chunk ``c*p + s`` on s.

    Raises:
        ScheduleError: ``positions`` leaves a position without chunks or names one outside the schedule."""
    p = len(schedule)
    if positions is None:
        return [[c * p + s for c in range(num_chunks(schedule))] for s in range(p)]
    ids = [[c for c, q in enumerate(positions) if q == s] for s in range(p)]
    if not all(ids) or sum(map(len, ids)) != len(positions):
        raise ScheduleError(f"chunk positions {list(positions)} must give each of the {p} positions a chunk")
    return ids


def completion_order(schedule: Schedule, positions: tuple[int, ...] | None = None) -> list[tuple[int, Action]]:
    """Run the schedule in lock-step rounds; return the global completion order ``[(stage, action)]`` or raise
    :class:`ScheduleError` on deadlock. A forward of model chunk g waits for g - 1's, a backward for g + 1's (W
    for nothing: validate checks its B)."""
    ids = chunk_ids(schedule, positions)
    last = sum(map(len, ids)) - 1
    pos = [0] * len(schedule)
    done: set[tuple[int, str, int]] = set()  # (model chunk, kind, micro-batch)
    order: list[tuple[int, Action]] = []
    while any(q < len(acts) for q, acts in zip(pos, schedule, strict=True)):
        progressed = False
        for s, acts in enumerate(schedule):
            if pos[s] == len(acts):
                continue
            a = acts[pos[s]]
            g = ids[s][a.chunk]
            need = (g - 1, "F") if a.kind == "F" and g else (g + 1, "B") if a.kind == "B" and g < last else None
            if need is None or (*need, a.mb) in done:
                done.add((g, a.kind, a.mb))
                order.append((s, a))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} waits at {acts[pos[s]]}" for s, acts in enumerate(schedule) if pos[s] < len(acts)]
            raise ScheduleError("schedule deadlocks: " + "; ".join(stuck))
    return order


def max_in_flight(actions: list[Action], chunk_sizes: list[float] | None = None) -> float:
    """Largest number of (chunk, micro-batch) forwards whose activations are held (activation memory): from the
    F until the B, or until the W when the actions split the backward. With ``chunk_sizes`` (bytes one
    micro-batch of each chunk keeps) the largest sum of held bytes instead (chunks of different sizes)."""
    free = "W" if any(a.kind == "W" for a in actions) else "B"
    live, peak = 0, 0
    for a in actions:
        size = 1 if chunk_sizes is None else chunk_sizes[a.chunk]
        live += size if a.kind == "F" else -size if a.kind == free else 0
        peak = max(peak, live)
    return peak


def pending_weight_passes(actions: list[Action]) -> tuple[int, int]:
    """``(most W passes waiting while a B runs, most waiting right after a B)`` in one stage's actions: the
    micro-batches whose B is done and whose W is not (each keeps the gradients its W starts from); ``(0, 0)``
    without W actions. ZB-H1's stage 1 of 2, ``F0 B0 F1 B1 W0 ...``: B1 runs with W0 waiting, then both wait:
    ``(1, 2)``."""
    waiting, during, after = set(), 0, 0
    for a in actions:
        if a.kind == "B":
            during = max(during, len(waiting))
            waiting.add((a.chunk, a.mb))
            after = max(after, len(waiting))
        elif a.kind == "W":
            waiting.discard((a.chunk, a.mb))
    return (during, after) if any(a.kind == "W" for a in actions) else (0, 0)


def in_flight_micro_batches(stage: int, num_stages: int, num_micro_batch: int,
                            schedule: ScheduleName = "1F1B", virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage ``stage`` (0-based) of ``num_stages`` holds at once, in units of
    one micro-batch through the whole stage.

    1F1B: min(S - s, m) (stage s runs S - s forwards before its first backward); GPipe: m (all forwards
    first); ZB-H1: min(S, m) on every stage (its memory limit: 1F1B's peak, held until each W);
    Interleaved1F1B with v chunks: min(2(S - s - 1) + (v - 1)S + 1, m v) chunk micro-batches of 1/v of the
    stage each. This is :func:`max_in_flight` of the built schedule's stage, in closed form.

    Raises:
        ValueError: ``stage`` outside ``[0, num_stages)``, a count below 1, or an unknown schedule; the
            message names the values.
    """
    if num_stages < 1 or num_micro_batch < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"need 0 <= stage < num_stages and counts >= 1, got stage={stage}, "
                         f"num_stages={num_stages}, num_micro_batch={num_micro_batch}")
    p, m, v = num_stages, num_micro_batch, virtual_stages
    if schedule == "1F1B":
        return min(p - stage, m)
    if schedule == "GPipe":
        return m
    if schedule == "ZB-H1":
        return min(p, m)
    if schedule == "Interleaved1F1B":
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v) / v
    raise ValueError(f"schedule {schedule!r} is unknown; choose one of {list(RUNNABLE_SCHEDULES)}")


def bubble_fraction(num_stages: int, num_micro_batch: int) -> float:
    """Idle share of every stage in a GPipe or 1F1B step on equal stages with free communication:
    (p-1)/(m+p-1) for p stages and m micro-batches (Huang et al. 2019; Narayanan et al. 2021).

    Raises:
        ScheduleError: fewer than one stage or micro-batch.
    """
    _check_sizes(num_stages, num_micro_batch)
    return (num_stages - 1) / (num_micro_batch + num_stages - 1)


def schedule_bubble(kind: str, num_stages: int, num_micro_batch: int, virtual_stages: int = 1) -> float:
    """Idle share of every rank in one step of schedule ``kind`` on equal stages with free communication, the
    forward taking a third of a micro-batch's compute and the backward two thirds (``T_F = T_B = T_W`` once
    the backward is split), p stages, m micro-batches, v chunks per rank:

    - GPipe, 1F1B: (p-1)/(m+p-1) (:func:`bubble_fraction`);
    - Interleaved1F1B: bubble time (p-1)/(v*m) of the ideal step (Narayanan et al. SC'21 §2.2), idle share
      (p-1)/(v*m + p-1);
    - ZB-H1: bubble time (p-1)(T_F + T_B - T_W) = (p-1) units against 3m units of compute when m >= p (Qi et al.
      ICLR'24 §3), idle share (p-1)/(3m + p-1); with m < p too few Ws exist to fill it: p - 1 + (p - m) units.

    Raises:
        ScheduleError: fewer than one stage or micro-batch; an unknown schedule.
    """
    _check_sizes(num_stages, num_micro_batch)
    p, m, v = num_stages, num_micro_batch, virtual_stages
    if kind in ("1F1B", "GPipe"):
        return bubble_fraction(p, m)
    if kind == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    if kind == "ZB-H1":
        bubble = p - 1 + max(0, p - m)
        return bubble / (3 * m + bubble)
    raise ScheduleError(f"unknown schedule {kind!r}; choose one of {list(RUNNABLE_SCHEDULES)}")


def format_schedule(schedule: Schedule) -> str:
    """Readable printout, one line per stage: ``stage 0: F0 F1 B0 F2 B1 ...``."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(schedule))
