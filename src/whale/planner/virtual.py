"""Hardware-aware virtual stages: the layers of every model chunk of an interleaved pipeline, how many chunks each
pipeline position holds, and the devices of every position, chosen together by device speed and memory, exactly.

Problem. Units (layers) ``0..n-1`` are cut into ``C = p * v`` contiguous, non-empty chunks. Position s holds
``k_s >= 1`` of them: v each, chunk c on position ``c % p`` (the interleaved 1F1B placement of Narayanan et al.,
SC'21 §2.2), or, with :attr:`VirtualProblem.vary_counts`, any counts summing to C, chunk c on position
``positions_from_counts(k)[c]`` (round-robin over the positions with chunks left, a hand-off between two
chunks of one position local; :mod:`whale.plan.schedule_chunks`, whose schedule the runtime runs). Position s
runs on a group of ``width`` devices drawn from device *types* (``type_counts[t]`` interchangeable devices of
type t). Chunk c of units ``i..j-1`` on a group takes, per micro-batch, ``max over the group's types t of
sum(unit_fwd[i:j][t])`` seconds forward and likewise backward (the slowest device of the group sets the pace, as
in :mod:`whale.planner.placement`). The objective is the predicted step time of the schedule with those chunk
times: the event simulation of the schedule (:func:`whale.plan.schedule_sim.simulate_lanes`, the one home of the
schedule's timing), so the bubble, the warm-up and which chunk waits for which all count, not only the slowest
position. Position s needs, on every device of its group, the static bytes of its chunks plus the largest sum
of activation bytes its own action order holds at once (:func:`whale.plan.schedule.max_in_flight` with
per-chunk sizes), plus the backward's temporaries of its worst unit (one unit runs backward at a time: the
gradient of its output and its own temporaries, as :mod:`whale.frontend.memplan` counts a stage's), plus three
point-to-point buffers per boundary with a chunk on another position (:class:`whale.planner.memory_types.
StageMemory`'s ``p2p_bytes``), at most the smallest capacity among the group's types.

A fast device gets more layers: its chunks are larger, and (``vary_counts``) it may hold more of them, which
fills its share of the bubble with more, smaller pieces of work.

Algorithm (exact): every sequence of groups over the positions (compositions of the width over the types
left, most of the earlier types first, as :func:`whale.planner.placement.compositions`), for each every count
vector (:func:`count_vectors`: the even one first, then, with ``vary_counts``, every composition of C into p
parts >= 1), and for each a depth-first branch and bound over the chunk ends. Group sequence and counts fix
the schedule (its action order per position, hence the chunk -> position map). The bound of a prefix of chunks
is the simulated step with every later chunk at zero cost, and its memory with their bytes at zero: the step
time is a max-plus expression of the action times in a fixed order (receives block, so the order the schedule
runs in does not depend on the times), hence non-decreasing in every time, and memory is non-decreasing in
every byte, so a prefix whose bound is no better than the best complete cut, or which is over memory already,
cannot lead to a better feasible cut. The even counts are searched first, the others after with half a budget
of their own (:func:`plan_virtual_stages`); within both budgets the result is exact, else marked not proven. Tested
against enumerating every cut, count vector and group sequence (tests/test_virtual_planner.py: worst ratio 1.0).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from whale.plan.schedule import completion_order, max_in_flight
from whale.plan.schedule_chunks import positions_from_counts, schedule_for
from whale.plan.schedule_sim import simulate_lanes
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
        peak_bytes: per position, the bytes one of its devices needs (static + activations held at once + the
            worst unit's backward temporaries + point-to-point buffers).
        exact: False when the search stopped at its budget (:data:`SEARCH_BUDGET`): the best cut found, not
            proven optimal.
        positions: model chunk -> position (``p * v`` entries; round-robin ``c % p`` unless the problem lets the
            chunk counts vary: :func:`whale.plan.schedule_chunks.positions_from_counts`).
    """

    counts: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    step: float
    peak_bytes: tuple[float, ...]
    exact: bool = True
    positions: tuple[int, ...] = ()

    @property
    def chunks_per_position(self) -> tuple[int, ...]:
        """Chunks each position holds (``v`` each on the round-robin map)."""
        return tuple(self.positions.count(s) for s in range(len(self.groups)))


SEARCH_BUDGET = 20000
"""Simulated steps the exact search over even chunk counts may evaluate (half as many more for other counts; about
0.2-0.5 ms each for 4 positions x 2 chunks, so seconds in all); past it every open branch follows only its most
promising option and no further chunk counts are tried (:func:`plan_virtual_stages`), so a cut is still found, and
:attr:`VirtualCut.exact` says it is not proven optimal."""


@dataclass(frozen=True)
class VirtualProblem:
    """The costs :func:`plan_virtual_stages` cuts by (see the module docstring for the model).

    Attributes:
        unit_fwd, unit_bwd: ``[unit][type]`` seconds of each unit's forward / backward for one micro-batch on one
            device of each type.
        unit_bytes: static bytes of each unit (parameters, gradients, optimizer state, buffers).
        unit_act: activation bytes each unit keeps per micro-batch until its backward.
        unit_temp: bytes each unit's backward holds beyond the activations kept (the gradient of its output and
            its own temporaries) for one micro-batch; empty: none.
        unit_out: bytes of each unit's output for one micro-batch (a chunk ending there sends that many); empty:
            none.
        unit_tied: per unit, ``(owner unit, static bytes)`` of each weight it shares with an earlier unit (a
            tied LM head's embedding: ``unit_bytes`` counts it in the owner only); a position holding the unit
            but not its owner keeps its own copy. Empty: none.
        type_counts: devices of each type (types listed by memory, largest first: ties keep the memory order).
        type_capacity: bytes one device of each type may use.
        positions: pipeline positions p (>= 2); virtual: chunks per position v (>= 1); micro_batches: m (a
            multiple of p); width: devices per position (its data-parallel lanes, ``K * n``).
        vary_counts: also choose how many of the ``p * v`` chunks each position holds (each >= 1), not v each.
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
    vary_counts: bool = False
    unit_temp: Sequence[float] = ()
    unit_out: Sequence[float] = ()
    unit_tied: Sequence[Sequence[tuple[int, float]]] = ()

    def check(self) -> None:
        """Raises ValueError naming the first inconsistent field (lengths, counts, negative or non-finite)."""
        n, T, p = len(self.unit_fwd), len(self.type_counts), self.positions
        if any(len(x) != n for x in (self.unit_bwd, self.unit_bytes, self.unit_act)) or \
                any(len(x) not in (0, n) for x in (self.unit_temp, self.unit_out, self.unit_tied)) or \
                any(len(r) != T for r in (*self.unit_fwd, *self.unit_bwd)) or len(self.type_capacity) != T:
            raise ValueError(f"unit_fwd/unit_bwd ([unit][type], {T} types), unit_bytes and unit_act need one entry "
                             f"per unit ({n}), unit_temp, unit_out and unit_tied one per unit or none; type_capacity "
                             "one per type")
        if any(not 0 <= o < u or not (b >= 0 and math.isfinite(b)) for u, ts in enumerate(self.unit_tied)
               for o, b in ts):
            raise ValueError("unit_tied needs (owner, bytes) pairs with an earlier owner unit and finite bytes >= 0")
        if p < 2 or self.virtual < 1 or n < p * self.virtual:
            raise ValueError(f"cannot cut {n} units into {p} positions x {self.virtual} chunks; need p >= 2, v >= 1 "
                             f"and at least p * v = {p * self.virtual} units")
        if self.width < 1 or sum(self.type_counts) < p * self.width or min(self.type_counts) < 0:
            raise ValueError(f"{p} positions of {self.width} devices need {p * self.width} devices, the types have "
                             f"{list(self.type_counts)}")
        values = [x for r in (*self.unit_fwd, *self.unit_bwd) for x in r] + [
            *self.unit_bytes, *self.unit_act, *self.unit_temp, *self.unit_out, *self.type_capacity]
        if any(not (x >= 0 and math.isfinite(x)) for x in values):
            raise ValueError("unit costs, bytes and capacities must be finite numbers >= 0")


class _Evaluator:
    """Step time and memory of (a prefix of) chunk cuts on one group sequence and one count of chunks per
    position; unassigned chunks cost nothing."""

    def __init__(self, pb: VirtualProblem, groups: tuple[tuple[int, ...], ...], counts: tuple[int, ...]) -> None:
        self.pb, self.groups, self.counts = pb, groups, counts
        self.positions = positions_from_counts(counts)
        self.local = [self.positions[:c].count(q) for c, q in enumerate(self.positions)]  # chunk -> local index
        self.schedule = schedule_for("Interleaved1F1B", pb.positions, pb.micro_batches, pb.virtual, self.positions)
        self.order = completion_order(self.schedule, self.positions)  # fixed: it does not depend on the times
        self.types = [[t for t, k in enumerate(g) if k] for g in groups]
        self.cap = [min(pb.type_capacity[t] for t in ts) for ts in self.types]
        self.pre = {name: _prefix(rows) for name, rows in (("f", pb.unit_fwd), ("b", pb.unit_bwd))}
        self.bytes, self.act = _prefix1(pb.unit_bytes), _prefix1(pb.unit_act)
        n = len(pb.unit_act)
        self.temp, self.out = list(pb.unit_temp) or [0.0] * n, list(pb.unit_out) or [0.0] * n
        self.tied = list(pb.unit_tied) or [()] * n

    def _time(self, kind: str, s: int, i: int, j: int) -> float:
        pre = self.pre[kind]
        return max(pre[j][t] - pre[i][t] for t in self.types[s])

    def memory(self, ends: Sequence[int]) -> list[float]:
        """Bytes per position for chunks ending at ``ends`` (chunk c = units ends[c-1]..ends[c]-1)."""
        starts, last, pos = [0, *ends[:-1]], len(self.positions) - 1, self.positions
        sizes = [[0.0] * k for k in self.counts]
        static, worst = [0.0] * len(self.counts), [0.0] * len(self.counts)
        for c, (i, j) in enumerate(zip(starts, ends, strict=True)):
            s = pos[c]
            sizes[s][self.local[c]] = self.act[j] - self.act[i]
            sent = self.out[j - 1] if c < last and pos[c + 1] != s else 0.0  # to / from another position
            got = self.out[i - 1] if c > 0 and pos[c - 1] != s else 0.0
            static[s] += self.bytes[j] - self.bytes[i] + 3 * (sent + got)
            worst[s] = max(worst[s], *self.temp[i:j])
        copies = {(pos[bisect.bisect_right(ends, u)], o, b) for u in range(ends[-1] if ends else 0)
                  for o, b in self.tied[u] if pos[bisect.bisect_right(ends, o)] != pos[bisect.bisect_right(ends, u)]}
        for s, _, b in copies:  # a weight tied to a unit on another position: this position's own copy
            static[s] += b
        return [static[s] + max_in_flight(self.schedule[s], sizes[s]) + worst[s] for s in range(len(self.counts))]

    def fits(self, ends: Sequence[int]) -> bool:
        """Every position within its group's smallest capacity."""
        return all(b <= c for b, c in zip(self.memory(ends), self.cap, strict=True))

    def step(self, ends: Sequence[int]) -> float:
        """Simulated step seconds of the schedule (chunks past ``ends`` at zero cost)."""
        m, starts = self.pb.micro_batches, [0, *ends[:-1]]
        f = [[0.0] * k for k in self.counts]
        b = [[0.0] * k for k in self.counts]
        for c, (i, j) in enumerate(zip(starts, ends, strict=True)):
            s, k = self.positions[c], self.local[c]
            f[s][k], b[s][k] = self._time("f", s, i, j), self._time("b", s, i, j)
        tf, tb = [sum(r) for r in f], [sum(r) for r in b]
        shares = [[(x / tf[s] if tf[s] else 0.0, y / tb[s] if tb[s] else 0.0) for x, y in zip(f[s], b[s], strict=True)]
                  for s in range(len(self.counts))]
        out = simulate_lanes(self.schedule, [[[t] * m] for t in tf], [[[t] * m] for t in tb],
                             [[0.0] for _ in tf], chunk_shares=shares, positions=self.positions, order=self.order)
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
    ``[step, ends, evaluator]``, improved in place; ``spent[0]`` counts the simulated steps (past ``budget``
    only the most promising option of each open branch is followed)."""

    def walk(ends: list[int]) -> None:
        """Extend ``ends`` by the next chunk's end, most promising bound first."""
        c, i = len(ends), ends[-1] if ends else 0
        if c == chunks:
            step = ev.step(ends)
            if step < best[0]:
                best[:] = [step, tuple(ends), ev]
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


def count_vectors(pb: VirtualProblem) -> list[tuple[int, ...]]:
    """The chunks-per-position vectors searched: ``(v, ..., v)`` first, then (with ``vary_counts``) every other
    way of giving the ``p * v`` chunks to the p positions, each at least one, nearest the even counts first
    (by the sum of ``|k_s - v|``, then in lexicographic order)."""
    p, v = pb.positions, pb.virtual
    if not pb.vary_counts:
        return [(v,) * p]
    cuts = itertools.combinations(range(1, p * v), p - 1)
    every = [tuple(b - a for a, b in zip((0, *c), (*c, p * v), strict=True)) for c in cuts]
    return sorted(every, key=lambda k: (sum(abs(x - v) for x in k), k))


def plan_virtual_stages(pb: VirtualProblem, budget: int = SEARCH_BUDGET) -> VirtualCut:
    """The chunk cut, the chunks per position (with ``pb.vary_counts``) and the per-position device groups
    minimizing the interleaved schedule's predicted step time within memory (exact within ``budget`` simulated
    steps; see the module docstring for the model and the algorithm).

    The search runs in two phases: every group sequence with v chunks per position (the round-robin placement)
    within ``budget`` simulated steps, then, with ``pb.vary_counts``, every other count vector on every group
    sequence within ``budget // 2`` more; past its budget a phase follows only the most promising option of each
    open branch and the second stops trying further count vectors (the cut is then marked not exact), so varying
    the counts costs at most about half a budget more than the even search.

    Returns:
        The optimal :class:`VirtualCut`; among equal steps, v chunks each over other counts, then the first
        group sequence of :func:`group_sequences` (and count vector of :func:`count_vectors`) reaching it.

    Raises:
        ValueError: inconsistent input (:meth:`VirtualProblem.check`).
        InfeasiblePlanError: no cut fits memory on any group sequence; names the smallest need of the
            position that overflows least on the evenest cut, and the fixes.
    """
    pb.check()
    n, chunks = len(pb.unit_fwd), pb.positions * pb.virtual
    best: list = [math.inf, None, None]
    spent, seqs, (even, *others) = [0], group_sequences(pb), count_vectors(pb)
    for groups in seqs:  # phase 1: v chunks each (the round-robin placement)
        _branch(_Evaluator(pb, groups, even), n, chunks, best, spent, budget)
    exact, limit = spent[0] <= budget, spent[0] + budget // 2
    for counts, groups in itertools.product(others, seqs):  # phase 2: other counts, with a budget of their own
        if spent[0] > limit:
            exact = False
            break
        _branch(_Evaluator(pb, groups, counts), n, chunks, best, spent, limit)
    if best[1] is None:
        _infeasible(pb, n, chunks)
    ev = best[2]
    ends = best[1]
    sizes = tuple(b - a for a, b in zip([0, *ends[:-1]], ends, strict=True))
    return VirtualCut(sizes, ev.groups, best[0], tuple(ev.memory(ends)), exact and spent[0] <= limit, ev.positions)


def _infeasible(pb: VirtualProblem, n: int, chunks: int) -> None:
    """Raise :class:`InfeasiblePlanError` for the evenest cut on the memory-order groups."""
    ev = _Evaluator(pb, group_sequences(pb)[0], count_vectors(pb)[0])
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
    """The optimal step by enumerating every group sequence, chunk count vector and cut (tests; exponential)."""
    n, chunks, best = len(pb.unit_fwd), pb.positions * pb.virtual, math.inf
    for groups in group_sequences(pb):
        for counts in count_vectors(pb):
            ev = _Evaluator(pb, groups, counts)
            for cuts in itertools.combinations(range(1, n), chunks - 1):
                ends = [*cuts, n]
                if ev.fits(ends):
                    best = min(best, ev.step(ends))
    return best
