"""Lane rows and ZeRO shard shares within memory, chosen together, for one combination of memory techniques
(pure functions of plain data; the Whale paper's §3.3 balancing, Jia et al., USENIX ATC 2022, made exact).

For pipeline stage s and lane l (rank ``plan.rank_of(s, l)``) under :class:`~whale.planner.memory.MemoryOptions`,
:func:`~whale.planner.memory.rank_memory` is linear in the lane's rows ``r`` (per micro-batch) and in its share
``f`` of the stage's ZeRO-sharded state, and so is the rank's time in
:func:`~whale.planner.steptime.memory_time.step_seconds`::

    device bytes  a + b f + p r  <=  capacity        host bytes  ha + hb f  <=  host capacity
    seconds       r t + ring + c f                   (t = micro-batches x training FLOPs per sample / speed)

The coefficients are read off ``rank_memory`` and ``technique_seconds`` (each formula keeps one home). Rows
are whole, add up to the micro-batch's rows and give every lane at least one; the shares ``f`` add up to 1 per
stage (the runtime cuts whole elements by them, which may give a lane up to ``lanes`` elements more than its
fraction: each lane keeps room for them).

- Without offload under ZeRO (``c = hb = 0``) a share only needs room. A lane's rows are bounded by its memory
  at ``f = 0``; the rows are the exact min-max of compute time within these bounds
  (:func:`~whale.plan.shares.min_max_shares`); a stage's shares follow the room its lanes have left. They fit
  iff the stage's lanes together have room for the state, ``sum_l (capacity - a - p r_l) >= b``, the same for
  every split of the rows within the bounds, so the rows are free to follow speed. Exact.
- With offload under ZeRO a share also costs time. Bisection on the step time ``T``: at ``T`` lane l with r rows
  can take ``f <= G_l(r) = min over stages of min((T - ring - r t) / c, (capacity - a - p r) / b,
  (host capacity - ha) / hb, 1)``, concave in r; the rows maximizing ``sum_l G_l`` (greedy on the marginal
  loss, exact for separable concave functions) decide whether ``T`` is feasible (``sum >= 1``). Exact for one
  stage (and for each stage of a plan whose stages have different widths); with several stages sharing lanes a
  lane's share must fit every stage (conservative).

Either way more memory (device or host) only widens what is searched: feasibility and the predicted step time
never get worse (up to the bisection's 1e-13 relative precision).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from whale.plan.plan import Plan
from whale.plan.shares import min_max_shares
from whale.planner.balance import InfeasiblePlanError, max_units
from whale.planner.hardware import predicted_utilization
from whale.planner.memory import MemoryOptions, StageMemory, rank_memory
from whale.planner.steptime.memory_time import technique_seconds
from whale.units import format_bytes


@dataclass(frozen=True)
class Cell:
    """One rank running one stage: the linear model of the module docstring (bytes, seconds per step)."""

    rank: int
    t: float
    ring: float
    c: float
    a: float
    b: float
    p: float
    cap: float
    ha: float
    hb: float
    hcap: float

    def share_room(self, r: int, limit: float) -> float:
        """Largest share ``f`` (at most 1) with ``r`` rows within memory and the step time ``limit``; -1 when
        even ``f = 0`` does not fit."""
        slack, room, hroom = limit - self.ring - r * self.t, self.cap - self.a - r * self.p, self.hcap - self.ha
        if slack < 0 or room < 0 or hroom < 0:
            return -1.0
        return min(1.0, slack / self.c if self.c > 0 else 1.0, room / self.b if self.b > 0 else 1.0,
                   hroom / self.hb if self.hb > 0 else 1.0)


def cell(st: StageMemory, rank: int, flight: int, lanes: int, opt: MemoryOptions, micro: int, speed: float,
         capacity: tuple[float, float], lane_bandwidth: float) -> Cell:
    """The :class:`Cell` of ``rank`` running stage ``st`` (``flight`` micro-batches in flight, ``lanes`` lanes,
    ``micro`` micro-batches per step, ``speed`` FLOP/s, ``capacity`` = (device, host) bytes)."""
    def mem(r: int, f: float):
        """``rank_memory`` of this stage at ``r`` rows and ZeRO shard fraction ``f`` (bytes)."""
        return rank_memory(st, r, flight, f, opt)
    one, half, row = mem(0, 1.0), mem(0, 0.5), mem(1, 1.0)
    b, hb = 2 * (one.device_total - half.device_total), 2 * (one.host - half.host)
    extra = lanes / max(1, st.trainable_elements)  # whole elements: up to `lanes` more than the fraction
    e = float(st.trainable_elements)
    ring = technique_seconds(e, 0.0, lanes, opt, lane_bandwidth)
    flops = st.train_flops + (st.recompute_flops if opt.activation_checkpoint else 0.0)
    return Cell(rank, micro * max(flops, 1.0) / speed, ring, technique_seconds(e, 1.0, lanes, opt, lane_bandwidth)
                - ring, one.device_total - b + b * extra, b, row.device_total - one.device_total, capacity[0],
                one.host - hb + hb * extra, hb, capacity[1])


def _name(c: Cell, names: tuple[str, ...]) -> str:
    return f"rank {c.rank}" + (f" ({names[c.rank]})" if names else "")


def _row_bounds(cells: list[list[Cell]], rows: int, lo: list[int], names: tuple[str, ...]) -> list[int]:
    """Most rows each lane holds with no share of the sharded state (every stage it runs).

    Raises:
        InfeasiblePlanError: a rank cannot hold its fewest rows, its host bytes, or all lanes not the rows.
    """
    n = len(cells[0])
    hi = [rows] * n
    for stage in cells:
        for lane, c in enumerate(stage):
            if c.ha > c.hcap:
                raise InfeasiblePlanError(
                    f"{_name(c, names)} needs {format_bytes(c.ha)} of host memory, has {format_bytes(c.hcap)}, for "
                    "its offloaded state", c.rank, c.ha, c.hcap)
            hi[lane] = min(hi[lane], max_units(c.cap, c.a, c.p, rows))
            if hi[lane] < lo[lane]:
                need = c.a + lo[lane] * c.p
                raise InfeasiblePlanError(
                    f"{_name(c, names)} needs {format_bytes(need)} of device memory, has {format_bytes(c.cap)}, for "
                    f"its unsharded state and {lo[lane]} row(s) of a micro-batch", c.rank, need, c.cap)
    if sum(hi) < rows:
        lane = min(range(n), key=lambda i: hi[i])
        c = min((stage[lane] for stage in cells), key=lambda c: max_units(c.cap, c.a, c.p, rows))
        need = c.a + (hi[lane] + rows - sum(hi)) * c.p
        raise InfeasiblePlanError(
            f"{_name(c, names)} would need {format_bytes(need)} of device memory, has {format_bytes(c.cap)}, for "
            f"{hi[lane] + rows - sum(hi)} rows of a micro-batch: the lanes hold {sum(hi)} rows together ({hi}), a "
            f"micro-batch has {rows}", c.rank, need, c.cap)
    return hi


def _room_shares(stage: list[Cell], r: list[int], names: tuple[str, ...]) -> list[float]:
    """Shares of one stage's sharded state by the room each lane has left (no offload: shares cost no time).

    Raises:
        InfeasiblePlanError: the lanes together lack room for the state (names the fullest rank).
    """
    room = [c.cap - c.a - c.p * k for c, k in zip(stage, r, strict=True)]
    b = stage[0].b
    if sum(room) < b:
        c = min(stage, key=lambda c: room[stage.index(c)])
        need = c.cap - room[stage.index(c)] + b / len(stage)
        raise InfeasiblePlanError(
            f"{_name(c, names)} would need {format_bytes(need)} of device memory, has {format_bytes(c.cap)}, with an "
            f"even share of the sharded state ({format_bytes(b)}): the ranks {[x.rank for x in stage]} have "
            f"{format_bytes(sum(room))} left after their rows together", c.rank, need, c.cap)
    return [x / sum(room) for x in room] if sum(room) > 0 else [1.0 / len(stage)] * len(stage)


def _greedy(cells: list[list[Cell]], rows: int, lo: list[int], hi: list[int], limit: float) -> list[int] | None:
    """Rows (within ``lo``..``hi``) maximizing the shares every lane can take at step time ``limit``; ``None``
    when those shares cannot add up to 1 (or the rows do not fit)."""
    seen: dict[tuple[int, int], float] = {}

    def room(lane: int, k: int) -> float:
        """The largest ZeRO share lane ``lane`` can take at ``k`` rows on every stage (memoized)."""
        if (lane, k) not in seen:
            seen[lane, k] = min(stage[lane].share_room(k, limit) for stage in cells)
        return seen[lane, k]
    r = list(lo)
    if any(room(lane, k) < 0 for lane, k in enumerate(r)):
        return None
    heap = [(room(i, r[i]) - room(i, r[i] + 1), i) for i in range(len(r)) if r[i] < hi[i] and room(i, r[i] + 1) >= 0]
    heapq.heapify(heap)
    for _ in range(rows - sum(r)):
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        r[i] += 1
        if r[i] < hi[i] and room(i, r[i] + 1) >= 0:
            heapq.heappush(heap, (room(i, r[i]) - room(i, r[i] + 1), i))
    return r if sum(room(i, k) for i, k in enumerate(r)) >= 1.0 else None


def _coupled(cells: list[list[Cell]], rows: int, lo: list[int], hi: list[int],
             names: tuple[str, ...]) -> tuple[list[int], list[list[float]]]:
    """Rows and shares minimizing the step time when shares cost time (offload under ZeRO; module docstring).

    Raises:
        InfeasiblePlanError: no rows and shares fit memory (names the rank and bytes).
    """
    top = max(rows * c.t + c.ring + c.c for stage in cells for c in stage) * (1 + 1e-9)
    r = _greedy(cells, rows, lo, hi, top)
    if r is None:
        n = len(cells[0])
        need = [(c.a + c.b / n, c.cap, c, False) for stage in cells for c in stage] + \
            [(c.ha + c.hb / n, c.hcap, c, True) for stage in cells for c in stage]
        want, has, c, host = max(need, key=lambda x: x[0] / max(x[1], 1.0))
        raise InfeasiblePlanError(
            f"{_name(c, names)} would need {format_bytes(want)} of {'host' if host else 'device'} memory, has "
            f"{format_bytes(has)}, with an even share of the sharded, offloaded state: no rows and shares fit the "
            "device and host memory together", c.rank, want, has)
    low, high = 0.0, top
    while high - low > 1e-13 * high:
        mid = (low + high) / 2
        got = _greedy(cells, rows, lo, hi, mid)
        low, high, r = (low, mid, got) if got is not None else (mid, high, r)
    shares = []
    for stage in cells:
        room = [max(0.0, c.share_room(k, high)) for c, k in zip(stage, r, strict=True)]
        shares.append([x / sum(room) for x in room])
    return r, shares


def solve(cells: list[list[Cell]], rows: int, fixed_rows: list[int] | None = None,
          names: tuple[str, ...] = ()) -> tuple[list[int], list[list[float]]]:
    """Rows per lane and, per stage, each lane's share of the sharded state (module docstring).

    Args:
        cells: ``[stage][lane]`` the ranks of stages that share their lanes' rows.
        rows: rows of one micro-batch; fixed_rows: rows per lane kept as given (``Config.load_shares``).
        names: device name per rank (for messages).

    Raises:
        InfeasiblePlanError: nothing fits (names the rank, the bytes it needs and has).
    """
    n = len(cells[0])
    lo = list(fixed_rows) if fixed_rows else [1 if rows >= n else 0] * n
    hi = _row_bounds(cells, rows, lo, names)
    if fixed_rows:
        hi = list(fixed_rows)
    if any(c.c > 0 or c.hb > 0 for stage in cells for c in stage):
        return _coupled(cells, rows, lo, hi, names)
    unit = [max(stage[lane].t for stage in cells) for lane in range(n)]
    r = list(fixed_rows) if fixed_rows else min_max_shares(rows, unit, min_share=lo[0], max_share=hi)
    return r, [_room_shares(stage, r, names) if stage[0].b > 0 else [1.0 / n] * n for stage in cells]


def fit_shares(plan: Plan, stages: list[StageMemory], global_batch: int, options: MemoryOptions,
               capacity: list[float], host_capacity: list[float], speeds: list[float], lane_bandwidth: float,
               keep_lane_weights: bool = False) -> Plan:
    """A new plan: ``plan`` (devices ordered) with ``options``' ZeRO stage and offload recorded, its lane rows
    and ZeRO weights chosen together within memory (:func:`solve`), and its predicted utilization.

    Args:
        capacity / host_capacity: bytes per rank (host: its share of its node's memory; empty: unbounded).
        speeds: FLOP/s per rank; lane_bandwidth: bytes/s between a stage's lanes.
        keep_lane_weights: keep the plan's lane shares (``Config.load_shares``); only the ZeRO shares move.

    Raises:
        InfeasiblePlanError: nothing fits; PlanError: the batch does not divide into the plan's micro-batches.
    """
    groups = [list(range(plan.num_stages))] if plan.uniform_width else [[s] for s in range(plan.num_stages)]
    rows, zero, names = [], [None] * plan.num_stages, tuple(plan.devices)
    for group in groups:
        cells = []
        for s in group:
            flight = plan.in_flight(s)
            ranks = [plan.rank_of(s, lane) for lane in range(plan.lanes_of(s))]
            cells.append([cell(stages[s], r, flight, len(ranks), options, plan.num_micro_batch, speeds[r],
                               (capacity[r], host_capacity[r] if host_capacity else math.inf), lane_bandwidth)
                          for r in ranks])
        fixed = [b - a for a, b in (x[0] for x in plan.micro_batch_rows(global_batch, group[0]))] \
            if keep_lane_weights else None
        r, shares = solve(cells, global_batch // plan.num_micro_batch, fixed, names)
        rows.append(tuple(float(k) for k in r))
        for s, f in zip(group, shares, strict=True):
            zero[s] = tuple(x / max(f) for x in f)
    fields: dict = {"zero": options.zero, "offload": options.offload}
    if not keep_lane_weights:
        fields.update({"lane_weights": rows[0]} if plan.uniform_width else {"stage_lane_weights": tuple(rows)})
    if options.zero:
        fields["zero_weights"] = tuple(zero)
    out = dataclasses.replace(plan, **fields)
    return dataclasses.replace(out, predicted_utilization=predicted_utilization(out, speeds))
