"""Hardware-aware virtual stages: the layers of every model chunk of an interleaved pipeline and the devices of
every pipeline position, chosen together by device speed and memory, exactly.

Problem. Units (layers) ``0..n-1`` are cut into ``C = p * v`` contiguous, non-empty chunks; chunk c runs on
pipeline position ``c % p`` (the interleaved 1F1B placement of Narayanan et al., SC'21 §2.2, which the runtime
runs: :mod:`whale.parallel.chunks`). Position s runs on a group of ``width`` devices drawn from device *types*
(``type_counts[t]`` interchangeable devices of type t). Chunk c of units ``i..j-1`` on a group takes, per
micro-batch, ``max over the group's types t of sum(unit_fwd[i:j][t])`` seconds forward and likewise backward
(the slowest device of the group sets the pace, as in :mod:`whale.planner.placement`). The objective is the
predicted step time of the interleaved schedule with those chunk times: the event simulation of the schedule
(:func:`whale.plan.schedule.simulate_lanes`, the one home of the schedule's timing), so the bubble, the
warm-up and which chunk waits for which all count, not only the slowest position. Position s needs, on every
device of its group, the static bytes of its chunks plus the largest sum of activation bytes its own action
order holds at once (:func:`whale.plan.schedule.max_in_flight` with per-chunk sizes), at most the smallest
capacity among the group's types.

A fast device gets more layers: its chunks are larger. Every position holds v chunks (the runtime's
round-robin placement), so a device's share of the model is set by its chunks' sizes, not by their number.

Algorithm (exact): every sequence of groups over the positions (compositions of the width over the types
left, most of the earlier types first, as :func:`whale.planner.placement.compositions`), and for each a
depth-first branch and bound over the chunk ends. The bound of a prefix of chunks is the simulated step with
every later chunk at zero cost, and its memory with their bytes at zero: the step time is a max-plus
expression of the action times in a fixed order (receives block, so the order the schedule runs in does not
depend on the times), hence non-decreasing in every time, and memory is non-decreasing in every byte, so a
prefix whose bound is no better than the best complete cut, or which is over memory already, cannot lead to
a better feasible cut. Tested against enumerating every cut and group sequence (tests/test_virtual_planner.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from whale.plan.schedule import interleaved_1f1b, max_in_flight, simulate_lanes
from whale.planner.balance import InfeasiblePlanError
from whale.planner.placement import compositions
from whale.units import format_bytes


@dataclass(frozen=True)
class VirtualCut:
    """An interleaved cut found by :func:`plan_virtual_stages`.

    Attributes:
        counts: units per chunk, ``p * v`` entries; chunk c runs on position ``c % p``.
        groups: per position, devices of each type it runs on (``groups[s][t]``; sums to the width).
        step: predicted step seconds of the schedule (forward and backward of every micro-batch).
        peak_bytes: per position, the bytes one of its devices needs (static + activations held at once).
        exact: False when the search stopped at its budget (:data:`SEARCH_BUDGET`): the best cut found, not
            proven optimal.
    """

    counts: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    step: float
    peak_bytes: tuple[float, ...]
    exact: bool = True


SEARCH_BUDGET = 20000
"""Simulated steps the exact search may evaluate (about 10 s on one core); past it every open branch follows only
its most promising option, so a cut is still found, and :attr:`VirtualCut.exact` says it is not proven optimal."""


@dataclass(frozen=True)
class VirtualProblem:
    """The costs :func:`plan_virtual_stages` cuts by (see the module docstring for the model).

    Attributes:
        unit_fwd, unit_bwd: ``[unit][type]`` seconds of each unit's forward / backward for one micro-batch on one
            device of each type.
        unit_bytes: static bytes of each unit (parameters, gradients, optimizer state, buffers).
        unit_act: activation bytes each unit keeps per micro-batch until its backward.
        type_counts: devices of each type (types listed by memory, largest first: ties keep the memory order).
        type_capacity: bytes one device of each type may use.
        positions: pipeline positions p (>= 2); virtual: chunks per position v (>= 1); micro_batches: m (a
            multiple of p); width: devices per position (its data-parallel lanes, ``K * n``).
    """

    unit_fwd: Sequence[Sequence[float]]
    unit_bwd: Sequence[Sequence[float]]
    unit_bytes: Sequence[float]
    unit_act: Sequence[float]
    type_counts: Sequence[int]
    type_capacity: Sequence[float]
    positions: int
    virtual: int
    micro_batches: int
    width: int = 1

    def check(self) -> None:
        """Raises ValueError naming the first inconsistent field (lengths, counts, negative or non-finite)."""
        n, T, p = len(self.unit_fwd), len(self.type_counts), self.positions
        if any(len(x) != n for x in (self.unit_bwd, self.unit_bytes, self.unit_act)) or \
                any(len(r) != T for r in (*self.unit_fwd, *self.unit_bwd)) or len(self.type_capacity) != T:
            raise ValueError(f"unit_fwd/unit_bwd ([unit][type], {T} types), unit_bytes and unit_act need one entry "
                             f"per unit ({n}); type_capacity one per type")
        if p < 2 or self.virtual < 1 or n < p * self.virtual:
            raise ValueError(f"cannot cut {n} units into {p} positions x {self.virtual} chunks; need p >= 2, v >= 1 "
                             f"and at least p * v = {p * self.virtual} units")
        if self.width < 1 or sum(self.type_counts) < p * self.width or min(self.type_counts) < 0:
            raise ValueError(f"{p} positions of {self.width} devices need {p * self.width} devices, the types have "
                             f"{list(self.type_counts)}")
        values = [x for r in (*self.unit_fwd, *self.unit_bwd) for x in r] + [*self.unit_bytes, *self.unit_act,
                                                                              *self.type_capacity]
        if any(not (x >= 0 and math.isfinite(x)) for x in values):
            raise ValueError("unit costs, bytes and capacities must be finite numbers >= 0")


class _Evaluator:
    """Step time and memory of (a prefix of) chunk cuts on one group sequence; unassigned chunks cost nothing."""

    def __init__(self, pb: VirtualProblem, groups: tuple[tuple[int, ...], ...]) -> None:
        self.pb, self.groups = pb, groups
        p, v, m = pb.positions, pb.virtual, pb.micro_batches
        self.schedule = interleaved_1f1b(p, m, v)
        self.types = [[t for t, k in enumerate(g) if k] for g in groups]
        self.cap = [min(pb.type_capacity[t] for t in ts) for ts in self.types]
        self.pre = {name: _prefix(rows) for name, rows in (("f", pb.unit_fwd), ("b", pb.unit_bwd))}
        self.bytes, self.act = _prefix1(pb.unit_bytes), _prefix1(pb.unit_act)

    def _time(self, kind: str, s: int, i: int, j: int) -> float:
        pre = self.pre[kind]
        return max(pre[j][t] - pre[i][t] for t in self.types[s])

    def memory(self, ends: Sequence[int]) -> list[float]:
        """Bytes per position for chunks ending at ``ends`` (chunk c = units ends[c-1]..ends[c]-1)."""
        p, v = self.pb.positions, self.pb.virtual
        starts = [0, *ends[:-1]]
        out = []
        for s in range(p):
            sizes, static = [0.0] * v, 0.0
            for c in range(s, len(ends), p):
                i, j = starts[c], ends[c]
                sizes[c // p] = self.act[j] - self.act[i]
                static += self.bytes[j] - self.bytes[i]
            out.append(static + max_in_flight(self.schedule[s], sizes))
        return out

    def fits(self, ends: Sequence[int]) -> bool:
        """Every position within its group's smallest capacity."""
        return all(b <= c for b, c in zip(self.memory(ends), self.cap, strict=True))

    def step(self, ends: Sequence[int]) -> float:
        """Simulated step seconds of the schedule (chunks past ``ends`` at zero cost)."""
        p, v, m = self.pb.positions, self.pb.virtual, self.pb.micro_batches
        starts = [0, *ends[:-1]]
        f = [[0.0] * v for _ in range(p)]
        b = [[0.0] * v for _ in range(p)]
        for c, (i, j) in enumerate(zip(starts, ends, strict=True)):
            f[c % p][c // p], b[c % p][c // p] = self._time("f", c % p, i, j), self._time("b", c % p, i, j)
        tf, tb = [sum(r) for r in f], [sum(r) for r in b]
        shares = [[(f[s][c] / tf[s] if tf[s] else 0.0, b[s][c] / tb[s] if tb[s] else 0.0) for c in range(v)]
                  for s in range(p)]
        out = simulate_lanes(self.schedule, [[[tf[s]] * m] for s in range(p)], [[[tb[s]] * m] for s in range(p)],
                             [[0.0] for _ in range(p)], chunk_shares=shares)
        return max(end for lanes in out["end"] for end in lanes)


def _prefix(rows: Sequence[Sequence[float]]) -> list[list[float]]:
    out = [[0.0] * len(rows[0])]
    for r in rows:
        out.append([a + x for a, x in zip(out[-1], r, strict=True)])
    return out


def _prefix1(xs: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def group_sequences(pb: VirtualProblem) -> list[tuple[tuple[int, ...], ...]]:
    """Every sequence of per-position device groups within the type counts, earlier types first."""
    out: list[tuple[tuple[int, ...], ...]] = []

    def walk(prefix: tuple, room: list[int]) -> None:
        """Extend ``prefix`` by one position's group from the devices in ``room``."""
        if len(prefix) == pb.positions:
            out.append(prefix)
            return
        for g in compositions(pb.width, room):
            walk((*prefix, g), [r - k for r, k in zip(room, g, strict=True)])

    walk((), list(pb.type_counts))
    return out


def _branch(ev: _Evaluator, n: int, chunks: int, best: list, spent: list[int], budget: int) -> None:
    """Depth-first branch and bound over the chunk ends on one group sequence; ``best`` is
    ``[step, ends, groups]``, improved in place; ``spent[0]`` counts the simulated steps (past ``budget``
    only the most promising option of each open branch is followed)."""

    def walk(ends: list[int]) -> None:
        """Extend ``ends`` by the next chunk's end, most promising bound first."""
        c, i = len(ends), ends[-1] if ends else 0
        if c == chunks:
            step = ev.step(ends)
            if step < best[0]:
                best[:] = [step, tuple(ends), ev.groups]
            return
        last = n - (chunks - c - 1)  # every later chunk keeps a unit; the last chunk ends at n
        options = []
        for j in range(last if c == chunks - 1 else i + 1, last + 1):
            cand = [*ends, j]
            if ev.fits(cand):
                bound = ev.step(cand)
                spent[0] += 1
                if bound < best[0]:
                    options.append((bound, j))
        for k, (bound, j) in enumerate(sorted(options)):
            if bound < best[0] and (k == 0 or spent[0] <= budget):
                walk([*ends, j])

    walk([])


def plan_virtual_stages(pb: VirtualProblem, budget: int = SEARCH_BUDGET) -> VirtualCut:
    """The chunk cut and the per-position device groups minimizing the interleaved schedule's predicted step
    time within memory (exact within ``budget`` simulated steps; see the module docstring for the model and
    the algorithm).

    Returns:
        The optimal :class:`VirtualCut`; among equal steps, the first group sequence of
        :func:`group_sequences` reaching it.

    Raises:
        ValueError: inconsistent input (:meth:`VirtualProblem.check`).
        InfeasiblePlanError: no cut fits memory on any group sequence; names the smallest need of the
            position that overflows least on the evenest cut, and the fixes.
    """
    pb.check()
    n, chunks = len(pb.unit_fwd), pb.positions * pb.virtual
    best: list = [math.inf, None, None]
    spent = [0]
    for groups in group_sequences(pb):
        _branch(_Evaluator(pb, groups), n, chunks, best, spent, budget)
    if best[1] is None:
        _infeasible(pb, n, chunks)
    ev = _Evaluator(pb, best[2])
    ends = best[1]
    counts = tuple(b - a for a, b in zip([0, *ends[:-1]], ends, strict=True))
    return VirtualCut(counts, best[2], best[0], tuple(ev.memory(ends)), spent[0] <= budget)


def _infeasible(pb: VirtualProblem, n: int, chunks: int) -> None:
    """Raise :class:`InfeasiblePlanError` for the evenest cut on the memory-order groups."""
    ev = _Evaluator(pb, group_sequences(pb)[0])
    ends = [round(n * (c + 1) / chunks) for c in range(chunks)]
    ends = [max(e, c + 1) for c, e in enumerate(ends)]
    need = ev.memory(ends)
    s = max(range(pb.positions), key=lambda k: need[k] - ev.cap[k])
    raise InfeasiblePlanError(
        f"no cut of {n} units into {pb.positions} positions x {pb.virtual} chunks fits the devices' memory: e.g. "
        f"the even cut needs {format_bytes(need[s])} on position {s} whose devices have {format_bytes(ev.cap[s])}; "
        "use fewer virtual stages, more micro-batches of fewer rows, activation checkpointing or devices with "
        "more memory", s, need[s], ev.cap[s])


def brute_force(pb: VirtualProblem) -> float:
    """The optimal step by enumerating every group sequence and every cut (tests; exponential)."""
    n, chunks, best = len(pb.unit_fwd), pb.positions * pb.virtual, math.inf
    for groups in group_sequences(pb):
        ev = _Evaluator(pb, groups)
        for cuts in itertools.combinations(range(1, n), chunks - 1):
            ends = [*cuts, n]
            if ev.fits(ends):
                best = min(best, ev.step(ends))
    return best
