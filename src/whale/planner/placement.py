"""Pipeline placement: the stage cut and which devices run each stage, chosen jointly and exactly.

The Whale paper (Jia et al., USENIX ATC 2022, §3.3) orders devices by memory, largest first, and then cuts the
layers for that order. The cut is optimal only for that order: the memory order can put the slowest device on
the heaviest stage (4x slower than another order) or call a model infeasible that another order fits. Here both
are chosen together.

Problem. Layers ``0..n-1`` are cut into S contiguous, non-empty stages; stage s runs on a group of ``widths[s]``
devices (its data-parallel lanes), drawn from device *types* t with ``type_counts[t]`` devices each (devices of
one type are interchangeable). Stage s of layers ``i..j-1`` on a group takes
``stage_scale[s] * max over the group's types t of (layer_seconds[i][t] + ... + layer_seconds[j-1][t])``
seconds (the slowest device sets the pace) and needs ``bytes[i:j] + in_flight[s] * act_bytes[i:j]`` bytes on
every device of its group (under 1F1B stage s holds ``min(S - s, m)`` micro-batches:
:func:`whale.plan.schedule.in_flight_micro_batches`). Minimize the slowest stage, every stage within memory.

Algorithm: a dynamic program over (stages placed, counts of each type used, layers consumed). Since the stage
index follows from the devices used, the state is (counts used, layers consumed); for each state it tries
every group for the next stage (a composition of its width over the types left) and every end layer,
vectorized over layers with numpy: O(states x groups x n^2). It is exact for the stated cost; the layer cost
is any additive per-layer, per-type number (seconds from FLOPs and datasheet speed today; a calibrated time per
FLOP by layer type plugs in unchanged). Among optimal placements it prefers, stage by stage, the group with
more of the earlier types (callers list types by memory, largest first, so the memory order wins ties) and
then the earliest end (earlier stages, which hold more micro-batches, stay short).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from whale.planner.balance import InfeasiblePlanError
from whale.units import format_bytes


@dataclass(frozen=True)
class StagePlacement:
    """A placement found by :func:`place_stages`.

    Attributes:
        counts: layers per stage (each >= 1, adding up to the layer count).
        groups: per stage, devices of each type it runs on (``groups[s][t]``; sums to ``widths[s]``).
        seconds: per stage, its time under the cost model (seconds, or the unit of ``layer_seconds``).
        bottleneck: the slowest stage's time, ``max(seconds)``.
    """

    counts: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    seconds: tuple[float, ...]
    bottleneck: float


def compositions(width: int, room: Sequence[int]) -> list[tuple[int, ...]]:
    """Every way to take ``width`` devices from types with ``room[t]`` devices left, most of type 0 first
    (lexicographically descending)."""
    if not room:
        return [()] if width == 0 else []
    out = []
    for k in range(min(width, room[0]), -1, -1):
        out += [(k, *rest) for rest in compositions(width - k, room[1:])]
    return out


Choices = Callable[[int, list[int]], list[tuple[int, ...]]]
"""``choices(stage, room)``: the groups stage ``stage`` may run on when ``room[t]`` devices of type t are left,
in order of preference."""


def _states(widths: Sequence[int], type_counts: Sequence[int], choices: Choices) -> list[list[tuple[int, ...]]]:
    """Counts of each type used after each number of stages placed (level 0..S)."""
    levels = [[tuple(0 for _ in type_counts)]]
    for s in range(len(widths)):
        nxt = {}
        for u in levels[-1]:
            for g in choices(s, [c - x for c, x in zip(type_counts, u, strict=True)]):
                nxt[_add(u, g)] = None
        levels.append(list(nxt))
    return levels


def placement_work(widths: Sequence[int], type_counts: Sequence[int], n_layers: int) -> float:
    """Upper bound on the element operations of :func:`place_stages` (transitions x (n + 1)^2), computed without
    enumerating: per level, the vectors of used counts with the right sum, times the groups of the next width.
    About 3e-8 s each on one CPU core; callers with a time budget fall back to fixed groups above it."""
    ways = [1.0]  # ways[k]: used-count vectors adding up to k
    for c in type_counts:
        ways = [sum(ways[k - x] for x in range(min(c, k) + 1) if k - x < len(ways)) for k in range(len(ways) + c)]
    T, used, total = len(type_counts), 0, 0.0
    for w in widths:
        total += (ways[used] if used < len(ways) else 0.0) * math.comb(w + T - 1, T - 1)
        used += w
    return total * (n_layers + 1) ** 2


Cost = Callable[[int, tuple[int, ...]], np.ndarray]
"""``cost(stage, group)[i, j]``: the stage's cost on layers ``i..j-1`` (``inf`` where not allowed)."""


def _solve(n: int, widths: Sequence[int], type_counts: Sequence[int], cost: Cost,
           choices: Choices) -> tuple[float, list]:
    """Exact min over placements of the max stage cost: backward DP over (level, counts used) of vectors over
    layers consumed, then a forward walk taking the preferred choice that keeps the optimum. Returns
    (optimum, [(group, start, end)] per stage); ``(inf, [])`` when nothing is allowed."""
    levels = _states(widths, type_counts, choices)
    S = len(widths)
    done = np.full(n + 1, np.inf)
    done[n] = 0.0
    best: list[dict] = [dict() for _ in range(S + 1)]
    best[S] = {u: done for u in levels[S]}
    for s in range(S - 1, -1, -1):
        for u in levels[s]:
            room = [c - x for c, x in zip(type_counts, u, strict=True)]
            vals = [np.maximum(cost(s, g), best[s + 1][_add(u, g)][None, :]).min(axis=1)
                    for g in choices(s, room)]
            best[s][u] = np.min(vals, axis=0) if vals else np.full(n + 1, np.inf)
    target = float(best[0][levels[0][0]][0])
    if not math.isfinite(target):
        return target, []
    path, u, i = [], levels[0][0], 0
    for s in range(S):
        room = [c - x for c, x in zip(type_counts, u, strict=True)]
        g, j = next((g, j) for g in choices(s, room) for j in range(i + 1, n + 1)
                    if max(cost(s, g)[i, j], best[s + 1][_add(u, g)][j]) <= target)
        path.append((g, i, j))
        u, i = _add(u, g), j
    return target, path


def _add(u: tuple[int, ...], g: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a + b for a, b in zip(u, g, strict=True))


def _check(layer_seconds, layer_bytes, layer_act_bytes, type_counts, type_capacity, widths, in_flight,
           stage_scale) -> None:
    n, S, T = len(layer_seconds), len(widths), len(type_counts)
    if len(layer_bytes) != n or len(layer_act_bytes) != n or any(len(row) != T for row in layer_seconds):
        raise ValueError(f"layer_seconds ([layer][type], {T} types), layer_bytes and layer_act_bytes need one "
                         f"entry per layer ({n})")
    if len(type_capacity) != T or len(in_flight) != S or len(stage_scale) != S:
        raise ValueError(f"type_capacity needs one entry per type ({T}); in_flight and stage_scale one per stage "
                         f"({S})")
    if S < 1 or n < S:
        raise ValueError(f"cannot cut {n} layers into {S} non-empty stages; use at most {n} stages")
    if any(w < 1 for w in widths) or any(c < 0 for c in type_counts) or sum(type_counts) < sum(widths):
        raise ValueError(f"stages of widths {list(widths)} need {sum(widths)} devices, the types have "
                         f"{list(type_counts)} = {sum(type_counts)}")
    for name, xs in (("layer_seconds", [x for row in layer_seconds for x in row]), ("layer_bytes", layer_bytes),
                     ("layer_act_bytes", layer_act_bytes), ("type_capacity", type_capacity),
                     ("stage_scale", stage_scale), ("in_flight", in_flight)):
        if any(not (x >= 0 and math.isfinite(x)) for x in xs):
            raise ValueError(f"{name} must hold finite numbers >= 0, got {list(xs)}")


def place_stages(layer_seconds: Sequence[Sequence[float]], layer_bytes: Sequence[float],
                 layer_act_bytes: Sequence[float], type_counts: Sequence[int], type_capacity: Sequence[float],
                 widths: Sequence[int], in_flight: Sequence[int], stage_scale: Sequence[float] | None = None,
                 groups: Sequence[Sequence[int]] | None = None) -> StagePlacement:
    """The contiguous cut and the device group of every stage minimizing the slowest stage within memory.

    Args:
        layer_seconds: ``[layer][type]`` cost of each layer on one device of each type for one micro-batch
            (seconds; any additive cost works).
        layer_bytes: static bytes per layer (parameters, gradients, optimizer state, buffers).
        layer_act_bytes: activation bytes per layer per micro-batch kept while it is in flight.
        type_counts: devices of each type; list types by memory, largest first, so ties keep the memory order.
        type_capacity: bytes one device of each type may use.
        widths: devices per stage (its data-parallel lanes).
        in_flight: micro-batches stage s holds at once
            (:func:`whale.plan.schedule.in_flight_micro_batches`).
        stage_scale: per stage, a factor on its time (e.g. the narrowest stage's lanes over this stage's lanes,
            when a wider stage takes fewer rows per device); default 1.
        groups: fix each stage's devices (``groups[s][t]``), leaving only the cut to choose (e.g. the memory
            order, where :func:`placement_work` is too large); default: every group is tried.

    Returns:
        The optimal :class:`StagePlacement` (exact; see the module docstring for the tie rule).

    Raises:
        InfeasiblePlanError: no placement fits memory; names the stage, its device type and the bytes it lacks
            in the placement whose worst overflow is smallest.
        ValueError: mismatched lengths, negative or non-finite values, fewer layers than stages, or fewer
            devices than the stages need.
    """
    scale = [1.0] * len(widths) if stage_scale is None else [float(x) for x in stage_scale]
    _check(layer_seconds, layer_bytes, layer_act_bytes, type_counts, type_capacity, widths, in_flight, scale)
    n, T = len(layer_seconds), len(type_counts)
    def pre(xs) -> np.ndarray:
        """Prefix sums over layers, starting at 0."""
        x = np.asarray(xs, dtype=np.float64)
        return np.concatenate([np.zeros((1, *x.shape[1:])), np.cumsum(x, axis=0)])

    sec = pre(layer_seconds)  # [n+1, T]
    dsec = sec[None, :, :] - sec[:, None, :]  # [i, j, t] = cost of layers i..j-1 on type t
    dmem, dact = (X[None, :] - X[:, None] for X in (pre(layer_bytes), pre(layer_act_bytes)))
    empty = np.tril(np.ones((n + 1, n + 1), dtype=bool))

    def overflow(s: int, g: tuple[int, ...]) -> np.ndarray:
        """Bytes over the group's smallest capacity for every cut of stage s."""
        cap = min(type_capacity[t] for t in range(T) if g[t])
        return np.where(empty, np.inf, dmem + in_flight[s] * dact - cap)

    def seconds(s: int, g: tuple[int, ...]) -> np.ndarray:
        """Stage time for every cut of stage s on group g (inf where it does not fit)."""
        t = scale[s] * dsec[:, :, [t for t in range(T) if g[t]]].max(axis=2)
        return np.where(overflow(s, g) <= 0, t, np.inf)

    choices = _choices(widths, groups, T)
    best, path = _solve(n, widths, type_counts, _cached(seconds), choices)
    if not path:
        _infeasible(n, widths, type_counts, type_capacity, _cached(overflow), dmem, dact, in_flight, choices)
    times = tuple(float(scale[s] * max(dsec[i, j, t] for t in range(T) if g[t]))
                  for s, (g, i, j) in enumerate(path))
    return StagePlacement(tuple(j - i for _, i, j in path), tuple(g for g, _, _ in path), times, best)


def _choices(widths: Sequence[int], groups: Sequence[Sequence[int]] | None, T: int) -> Choices:
    """Every composition of each stage's width (``groups=None``), or only the fixed group of each stage.

    Raises:
        ValueError: fixed groups of the wrong number, length or width.
    """
    if groups is None:
        return lambda s, room: compositions(widths[s], room)
    fixed = [tuple(int(x) for x in g) for g in groups]
    if len(fixed) != len(widths) or any(len(g) != T or sum(g) != w or min(g) < 0
                                        for g, w in zip(fixed, widths, strict=False)):
        raise ValueError(f"groups must give, per stage, a count >= 0 of each of the {T} types adding up to the "
                         f"stage's width {list(widths)}; got {[list(g) for g in fixed]}")
    return lambda s, room: [fixed[s]] if all(a <= b for a, b in zip(fixed[s], room, strict=True)) else []


def _cached(cost: Cost) -> Cost:
    """``cost`` computed once per (stage, group)."""
    memo: dict = {}

    def get(s: int, g: tuple[int, ...]) -> np.ndarray:
        """The memoized cost matrix."""
        if (s, g) not in memo:
            memo[s, g] = cost(s, g)
        return memo[s, g]

    return get


def _infeasible(n, widths, type_counts, type_capacity, overflow: Cost, dmem, dact, in_flight, choices) -> None:
    """Raise :class:`InfeasiblePlanError` for the placement with the least worst overflow.

    Raises:
        ValueError: the fixed groups do not fit the device counts or the stage widths.
    """
    _, path = _solve(n, widths, type_counts, overflow, choices)
    if not path:
        raise ValueError(f"the stage groups cannot be drawn from {list(type_counts)} devices per type for stages of "
                         f"widths {list(widths)}; give groups of those widths within those counts")
    worst = max(range(len(path)), key=lambda s: overflow(s, path[s][0])[path[s][1], path[s][2]])
    g, i, j = path[worst]
    t = min((t for t in range(len(g)) if g[t]), key=lambda t: type_capacity[t])
    need = float(dmem[i, j] + in_flight[worst] * dact[i, j])
    raise InfeasiblePlanError(
        f"no cut of {n} layers into {len(widths)} stages fits memory on any assignment of the devices "
        f"(types {list(type_counts)} with {[format_bytes(c) for c in type_capacity]} each); the closest puts "
        f"layers {i}..{j - 1} on stage {worst} (device type {t}), which needs {format_bytes(need)} with "
        f"{in_flight[worst]} micro-batch(es) in flight but has {format_bytes(type_capacity[t])}, lacking "
        f"{format_bytes(need - type_capacity[t])}. Use more stages, devices with more memory or fewer "
        "micro-batches in flight", worst, need, type_capacity[t])
