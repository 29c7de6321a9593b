"""Interleaved 1F1B with different chunk counts per pipeline position, as data.

Interleaved 1F1B (Narayanan et al., SC'21 §2.2; :func:`whale.plan.schedule.interleaved_1f1b`) puts v model chunks
on each of p positions, round-robin: chunk c on position ``c % p``. Here the map is free: ``positions[c]`` is the
position of model chunk c (chunks in model order, chunk c's output feeding chunk c + 1), and position s holds
``k_s >= 1`` chunks, its *local* chunks ``0..k_s-1`` being its model chunks in model order (an action's
``chunk`` is the local index, as in the round-robin schedule). A hand-off between two chunks on one position is
local (no send or receive); :func:`whale.plan.schedule_sim.simulate_lanes` times it as free.

The order generalizes Megatron-LM's (depth-first, in groups of p micro-batches): position s runs its forwards
chunk by chunk for micro-batches ``0..p-1`` (local chunk 0, then 1, ..., then the next p micro-batches), its
backwards likewise from its last chunk; it warms up with ``(k_s - 1) * p + 2 * (C - 1 - g_s)`` forwards (g_s its
last model chunk, C the chunk count: the forwards before the first micro-batch reaches its last chunk, plus one
round trip per later chunk), at most ``m * k_s``, then alternates one forward and one backward, then drains.
With equal counts on the round-robin map this is exactly the interleaved schedule (2(p-r-1) + (v-1)p warm-up
forwards on rank r). If some map deadlocks under that warm-up, every position's warm-up grows by one until
:func:`whale.plan.schedule.validate` proves the schedule complete and deadlock-free; with every warm-up at
``m * k_s`` (all forwards first) no order can deadlock: in each position's list the forwards rise in (group,
chunk, micro-batch), every forward depends on one smaller in that order, and the backwards likewise, so the
smallest unfinished action is always ready.
"""

from __future__ import annotations

from collections.abc import Sequence

from whale.plan.schedule import Action, Schedule, ScheduleError, chunk_ids, make_schedule, validate


def round_robin(num_stages: int, virtual_stages: int) -> tuple[int, ...]:
    """The interleaved map: chunk c of ``p * v`` on position ``c % p``."""
    return tuple(c % num_stages for c in range(num_stages * virtual_stages))


def positions_from_counts(counts: Sequence[int]) -> tuple[int, ...]:
    """The chunk -> position map of per-position chunk counts: round-robin over the positions that still have
    chunks left (counts ``(3, 2)`` -> ``(0, 1, 0, 1, 0)``; ``(3, 1)`` -> ``(0, 1, 0, 0)``, its last hand-off
    local). Equal counts give :func:`round_robin`.

    Raises:
        ScheduleError: a count below 1."""
    if not counts or min(counts) < 1:
        raise ScheduleError(f"every position needs at least one chunk, got counts {list(counts)}")
    left, out = list(counts), []
    while any(left):
        for s, k in enumerate(left):
            if k:
                out.append(s)
                left[s] -= 1
    return tuple(out)


def counts_of(positions: Sequence[int]) -> tuple[int, ...]:
    """Chunks per position of a chunk -> position map."""
    return tuple(sum(1 for q in positions if q == s) for s in range(1 + max(positions)))


def chunked_1f1b(positions: Sequence[int], num_micro_batch: int) -> Schedule:
    """The interleaved schedule of a chunk -> position map (module docstring), validated.

    Args:
        positions: ``positions[c]`` = position of model chunk c; every position ``0..p-1`` holds one or more.
        num_micro_batch: m, a multiple of p.

    Returns:
        One action list per position (``chunk`` = local chunk index).

    Raises:
        ScheduleError: a position without chunks, fewer than 2 positions, m below 1 or not a multiple of p.
    """
    positions, m = tuple(positions), num_micro_batch
    p = 1 + max(positions, default=-1)
    if p < 2 or m < 1 or m % p:
        raise ScheduleError(f"chunk positions {list(positions)} with {m} micro-batches: need >= 2 positions and a "
                            f"number of micro-batches that is a positive multiple of the {p} positions")
    ids = chunk_ids([[]] * p, positions)
    total = [m * len(gs) for gs in ids]
    warm = [min((len(gs) - 1) * p + 2 * (len(positions) - 1 - gs[-1]), t) for gs, t in zip(ids, total, strict=True)]
    while True:
        sched = [_position(len(gs), p, m, w) for gs, w in zip(ids, warm, strict=True)]
        try:
            validate(sched, m, positions)
            return sched
        except ScheduleError:
            if warm == total:  # cannot happen (module docstring): all forwards first never deadlocks
                raise
            warm = [min(w + 1, t) for w, t in zip(warm, total, strict=True)]


def _position(k: int, p: int, m: int, warm: int) -> list[Action]:
    """One position's actions: ``k`` local chunks, groups of ``p`` micro-batches, ``warm`` warm-up forwards."""

    def order(backward: bool) -> list[Action]:
        """Forwards (or backwards) in the depth-first order: per group of p micro-batches, chunk by chunk."""
        kind, chunks = ("B", range(k - 1, -1, -1)) if backward else ("F", range(k))
        return [Action(kind, g + i, c) for g in range(0, m, p) for c in chunks for i in range(p)]

    fwd, bwd = order(False), order(True)
    acts = fwd[:warm]
    for i in range(len(fwd) - warm):
        acts += [fwd[warm + i], bwd[i]]
    return acts + bwd[len(fwd) - warm:]


def schedule_for(kind: str, num_stages: int, num_micro_batch: int, virtual_stages: int = 1,
                 positions: Sequence[int] = ()) -> Schedule:
    """A plan's schedule: :func:`whale.plan.schedule.make_schedule`, or with a chunk -> position map that is not
    round-robin (``Plan.chunk_positions``) :func:`chunked_1f1b`.

    Raises:
        ScheduleError: as those builders; a map with a schedule other than ``"Interleaved1F1B"``, or whose
            positions are not ``0..num_stages-1``.
    """
    if not positions or tuple(positions) == round_robin(num_stages, virtual_stages):
        return make_schedule(kind, num_stages, num_micro_batch, virtual_stages)
    if kind != "Interleaved1F1B" or 1 + max(positions) != num_stages:
        raise ScheduleError(f"chunk positions {list(positions)} need schedule 'Interleaved1F1B' over positions "
                            f"0..{num_stages - 1}, got {kind!r}")
    return chunked_1f1b(positions, num_micro_batch)
