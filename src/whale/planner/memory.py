"""Per-rank memory under each memory option, and the cheapest options that fit (pure functions of plain data).

The Whale paper (Jia et al., USENIX ATC 2022) trains models far larger than one device by combining its parallel
strategies with recomputation, sharded optimizer state, offloading and mixed precision. This module predicts,
for a plan, every rank's peak *device* bytes and its *host* bytes under a combination of

- activation checkpointing (every repeated layer recomputes in backward: only its input stays in flight, and
  the largest layer's activations live once while it is recomputed);
- ZeRO stage 0-3 over each pipeline stage's data-parallel lanes (Rajbhandari et al., SC 2020), with the lane's
  share of the sharded state from the plan's ``zero_weights`` (hardware-aware: by free memory);
- offload (ZeRO-Offload, Ren et al., USENIX ATC 2021): ``"optimizer"`` keeps the optimizer state, an fp32
  master copy of the lane's parameters and a gradient copy on the host and steps there; ``"optimizer+params"``
  also keeps the parameters on the host (``zero=0``: the whole stage, brought to the device for the step;
  ``zero=3``: the lane's parameter and gradient shards, one unit gathered on the device at a time),

and :func:`choose_memory_options` picks, among the combinations the user allows, the one with the smallest
predicted step time whose every rank fits its device and its node's host memory.

What each option holds at a rank's peak, per parameter element of its stage (fp32; ``f`` = the lane's share
of the stage's sharded state, ``E`` = the stage's trainable elements, ``G`` = those ZeRO-3 holds gathered at
once):

========================  ==========  =================  ===============  ==================
option                    parameters  gradients          optimizer state  host
========================  ==========  =================  ===============  ==================
none                      4E          4E                 8E               0
ZeRO-1                    4E          4E                 8fE              0
ZeRO-2                    4E          4E + 4fE (below)   8fE              0
ZeRO-3                    4fE + 4G    4fE + 4G           8fE              0
offload optimizer         as above    as above           0                (4 + 4 + 8)·fE
offload optimizer+params  4E          4E                 0                (4 + 4 + 8)·E
ZeRO-3 + optimizer+params 4G          4G                 0                (4 + 4 + 8)·fE
========================  ==========  =================  ===============  ==================

ZeRO-2 reduce-scatters once per step after the last micro-batch's backward (gradient accumulation keeps whole
gradients until then, :mod:`whale.parallel.zero`) into the lane's persistent slice: its *peak* holds both (it
saves memory between steps and during the optimizer step, not at the peak). ZeRO-3 reduce-scatters each
unit's gradients after its backward. The offloaded host keeps fp32 masters, gradient copies and the optimizer
state of the lane's slice (:mod:`whale.runtime.offload`); ``"optimizer+params"`` with ``zero=0`` also keeps the
parameters on the host between steps, but brings the whole stage to the device for the step, so it does not
lower the step's peak; with ``zero=3`` the lane's parameter shard *is* the fp32 master on the host and its
gradient shard is the host gradient buffer (each unit's reduce-scatter lands there), so the device holds only
what is gathered (and weights tied across pipeline stages, whole). Not with ZeRO-1/2.

Step time per option: :mod:`whale.planner.steptime.memory_time` (the step-time model's home).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from whale.config import FORBIDDEN
from whale.plan.plan import OFFLOADS, Plan
from whale.plan.shares import whole_shares
from whale.planner.advice import Shortfall, infeasible_message, worst_rank
from whale.planner.balance import InfeasiblePlanError
from whale.planner.memory_types import MemoryOptions, StageMemory
from whale.planner.steptime.memory_time import step_seconds
from whale.planner.zero import zero_shard_weights
from whale.units import format_bytes


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes of one rank at its peak: on the device by category, and on the host."""

    device: dict[str, float] = field(default_factory=dict)
    host: float = 0.0

    @property
    def device_total(self) -> float:
        """Sum of the device categories, bytes."""
        return sum(self.device.values())


def rank_memory(stage: StageMemory, rows: int, in_flight: int, share: float, options: MemoryOptions) -> RankMemory:
    """Peak bytes of one rank running ``stage`` with ``rows`` samples per micro-batch, ``in_flight`` micro-batches
    alive at once (the schedule's), and ``share`` (0-1] of the stage's sharded state (ZeRO and offload).

    Raises:
        ValueError: an unknown offload or ZeRO stage, or a share outside (0, 1].
    """
    if options.offload not in OFFLOADS or options.zero not in (0, 1, 2, 3) or not 0 < share <= 1:
        raise ValueError(f"bad memory options {options} or share {share} (offload in {OFFLOADS}, zero 0-3, "
                         "share in (0, 1])")
    e, g = float(stage.trainable_elements), float(min(stage.gather_elements, stage.trainable_elements))
    f = share if options.zero else 1.0
    fe = f * (e - stage.tied_elements + stage.tied_elements / max(1, stage.tie_stages)) if options.zero else e
    params, grads = 4 * e, {2: 4 * e + 4 * fe}.get(options.zero, 4 * e)
    if options.zero == 3:  # owned shard + tied weights (whole) + what is gathered; a stage's gradients are
        held = 4 * f * (e - stage.tied_elements) + 4 * stage.tied_elements  # reduce-scattered as its backward ends
        if options.offload == "optimizer+params":  # the shards live on the host (the masters and gradients)
            held = 4 * stage.tied_elements
        params, grads = held + 4 * g, held + (0.0 if stage.pipelined else 4 * g)
    host = 0.0
    if options.offload == "none":
        optim = 8 * fe
    else:
        optim, host = 0.0, 16 * fe
    act, peak = stage_activation(stage, options)
    temporaries = rows * max(0.0, peak - act)
    if options.zero == 3:  # a layer's flat gradient buffer waiting for its reduce-scatter
        temporaries += 4 * stage.reduce_elements
    device = {"parameters": params + stage.frozen_bytes, "gradients": grads, "optimizer_state": optim,
              "activations": rows * (act * in_flight + stage.p2p_bytes), "temporaries": temporaries}
    return RankMemory(device, host)


def stage_activation(stage: StageMemory, options: MemoryOptions) -> tuple[float, float]:
    """(bytes per sample a micro-batch in flight keeps, the most bytes per sample of the one in backward),
    with or without checkpointing; a rank holds ``rows * (kept * (in_flight - 1) + peak)`` at its peak."""
    if options.activation_checkpoint:
        return stage.checkpointed_bytes, max(stage.checkpointed_backward_bytes, stage.checkpointed_bytes)
    return stage.activation_bytes, max(stage.backward_bytes, stage.activation_bytes)


def lane_shares(plan: Plan, stage: int, elements: int, weights: tuple[float, ...] | None = None) -> list[float]:
    """Fraction of ``stage``'s sharded state each lane owns: whole elements by ``weights`` (default the plan's
    ZeRO weights; :func:`whole_shares`, what the runtime cuts)."""
    lanes = plan.lanes_of(stage)
    if elements <= 0:
        return [1.0 / lanes] * lanes
    return [n / elements for n in whole_shares(elements, weights or zero_shard_weights(plan, stage))]


def plan_memory(plan: Plan, stages: list[StageMemory], global_batch: int, options: MemoryOptions,
                zero_weights: tuple[tuple[float, ...], ...] = ()) -> list[RankMemory]:
    """Per rank (by global rank), predicted peak memory at ``global_batch`` samples per step under ``options``,
    the lanes' state shares by ``zero_weights`` (per stage; default the plan's).

    Raises:
        ValueError: ``stages`` does not hold one entry per pipeline stage.
        PlanError: the batch does not divide into the plan's micro-batches and lanes.
    """
    if len(stages) != plan.num_stages:
        raise ValueError(f"plan_memory got {len(stages)} stage memories for {plan.num_stages} stages")
    out: list[RankMemory] = [RankMemory()] * plan.world_size
    for s, st in enumerate(stages):
        flight = plan.in_flight(s)
        shares = lane_shares(plan, s, st.trainable_elements, zero_weights[s] if zero_weights else None)
        for lane, ranges in enumerate(plan.micro_batch_rows(global_batch, s)):
            rows = max(b - a for a, b in ranges)
            out[plan.rank_of(s, lane)] = rank_memory(st, rows, flight, max(shares[lane], 1e-12), options)
    return out


def candidates(floor: MemoryOptions, forbid: tuple[str, ...] = ()) -> list[MemoryOptions]:
    """Every combination at least ``floor`` (what the user set is kept) that ``forbid`` allows (offloading
    the parameters runs with ``zero=0`` or ``3``).

    ``forbid`` names (:data:`FORBIDDEN`) techniques the planner must not add: ``"activation_checkpoint"``,
    ``"zero"`` (any higher ZeRO stage), ``"zero3"``, ``"offload"``, ``"offload_params"``.

    Raises:
        ValueError: an unknown name in ``forbid``.
    """
    unknown = [f for f in forbid if f not in FORBIDDEN]
    if unknown:
        raise ValueError(f"cannot forbid {unknown}: choose among {FORBIDDEN}")
    out = []
    for ckpt, zero, off in itertools.product((False, True), (0, 1, 2, 3), OFFLOADS):
        lower = ckpt < floor.activation_checkpoint or zero < floor.zero or \
            OFFLOADS.index(off) < OFFLOADS.index(floor.offload) or (off == "optimizer+params" and zero in (1, 2))
        banned = (ckpt and not floor.activation_checkpoint and "activation_checkpoint" in forbid) or \
            (zero > floor.zero and "zero" in forbid) or (zero == 3 > floor.zero and "zero3" in forbid) or \
            (off != floor.offload and "offload" in forbid) or \
            (off == "optimizer+params" != floor.offload and "offload_params" in forbid)
        if not lower and not banned:
            out.append(MemoryOptions(ckpt, zero, off))
    return out


def shortfalls(ranks: list[RankMemory], capacity: list[float], host_capacity: list[float]) -> list[str]:
    """One line per rank whose device or host bytes exceed its capacity (``host_capacity``: per rank, its share
    of its node's host memory; empty: unbounded)."""
    out = []
    for r, m in enumerate(ranks):
        if m.device_total > capacity[r]:
            out.append(f"rank {r} needs {format_bytes(m.device_total)} of device memory, has "
                       f"{format_bytes(capacity[r])}")
        if host_capacity and m.host > host_capacity[r]:
            out.append(f"rank {r} needs {format_bytes(m.host)} of host memory, has {format_bytes(host_capacity[r])}")
    return out


@dataclass(frozen=True)
class MemoryChoice:
    """The chosen options, the plan placed for them, their predicted per-rank memory and step seconds, and
    why (printable lines)."""

    options: MemoryOptions
    plan: Plan
    ranks: tuple[RankMemory, ...]
    step_seconds: float
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class _Tried:
    """One combination tried: its step seconds (``inf``: not placed), plan, per-rank memory, shortfall lines,
    and the worst rank's :class:`~whale.planner.advice.Shortfall` with its ratio of need to capacity."""

    cost: float
    opt: MemoryOptions
    plan: Plan | None
    ranks: list[RankMemory] | None
    short: list[str]
    worst: Shortfall

    @property
    def ratio(self) -> float:
        """Bytes needed over bytes available on the worst rank (> 1: does not fit)."""
        return self.worst.need_bytes / max(self.worst.has_bytes, 1.0)


def _try(opt: MemoryOptions, place, stages, global_batch, capacity, host_capacity, speeds, lane_bandwidth,
         names) -> _Tried:
    """Place ``opt`` and predict its memory and step seconds (``inf`` and the error when it cannot be placed)."""
    try:
        plan = place(opt)
    except InfeasiblePlanError as e:
        on_host = " of host memory" in str(e).split(":")[0]
        short = Shortfall(opt.describe(), e.device, names[e.device] if names and e.device < len(names) else "",
                          on_host, e.need_bytes, e.capacity_bytes, 1.0, str(e))
        return _Tried(float("inf"), opt, None, None, [str(e)], short)
    ranks = plan_memory(plan, stages, global_batch, opt)
    cost = step_seconds(plan, stages, global_batch, opt, speeds, lane_bandwidth)
    return _Tried(cost, opt, plan, ranks, shortfalls(ranks, capacity, host_capacity),
                  worst_rank(opt.describe(), [(m.device_total, m.host, m.device.get("activations", 0.0) +
                                               m.device.get("temporaries", 0.0)) for m in ranks],
                             capacity, host_capacity, names))


def choose_memory_options(place: Callable[[MemoryOptions], Plan], stages: list[StageMemory], global_batch: int,
                          floor: MemoryOptions, forbid: tuple[str, ...], capacity: list[float],
                          host_capacity: list[float], speeds: list[float], lane_bandwidth: float,
                          names: tuple[str, ...] = (), micro_batches: int = 1) -> MemoryChoice:
    """The allowed combination (:func:`candidates`) with the least
    :func:`~whale.planner.steptime.memory_time.step_seconds` whose every rank fits (:func:`plan_memory` within
    ``capacity`` bytes per rank and ``host_capacity``); ties (1e-12 relative) go to fewer techniques. What the user set
    (``floor`` other than no techniques) is kept as is when it fits. With
    nothing set, the fastest fitting combination is chosen, so more memory never gives a slower plan (a
    combination relieving memory-bound shares can be faster than none). ``place(options)`` returns the plan
    balanced for those options (rows and ZeRO shares within memory, :func:`whale.planner.fit.fit_shares`) or
    raises ``InfeasiblePlanError``. Exhaustive over at most 24 combinations. ``names``: device name per rank and
    ``micro_batches``: the plan's, for the messages.

    Raises:
        InfeasiblePlanError: no allowed combination fits; names the closest one, its worst rank and device, the
            bytes it needs and has, and the fixes that apply (:func:`whale.planner.advice.infeasible_message`).
    """
    tried = [_try(o, place, stages, global_batch, capacity, host_capacity, speeds, lane_bandwidth, names)
             for o in candidates(floor, forbid)]
    if not tried:
        raise ValueError(f"{floor.describe()} is not a combination the runtime runs (offload of parameters needs "
                         "zero=0)")
    fits = [t for t in tried if not t.short]
    if not fits:
        best = min(tried, key=lambda t: (t.ratio, _count(t.opt), t.opt))
        rows = max(1, global_batch // max(1, micro_batches))
        raise InfeasiblePlanError(infeasible_message(best.worst, forbid, floor.offload, micro_batches, rows),
                                  best.worst.rank, best.worst.need_bytes, best.worst.has_bytes)
    fastest = min(t.cost for t in fits)
    as_set = [t for t in fits if t.opt == floor and floor != MemoryOptions()]  # what the user set fits
    chosen = as_set[0] if as_set else min((t for t in fits if t.cost <= fastest * (1 + 1e-12)),
                                          key=lambda t: (_count(t.opt), t.opt))
    return MemoryChoice(chosen.opt, chosen.plan, tuple(chosen.ranks), chosen.cost, _reasons(chosen, tried, floor))


def _reasons(chosen: _Tried, tried: list[_Tried], floor: MemoryOptions) -> tuple[str, ...]:
    """Printable lines: the choice, its predicted step time, and why not what the user set (or nothing)."""
    reasons = [f"memory: {chosen.opt.describe()} ({chosen.cost * 1e3:.2f} ms per step on the slowest rank, "
               "predicted compute and memory-technique costs)"]
    if chosen.opt != floor:
        base = next((t for t in tried if t.opt == floor), None)
        if base is None:
            why = "without it: the options set are not allowed"
        elif base.short:
            why = f"without it {base.short[0]}"
        else:
            why = (f"it is faster: {floor.describe()} fits but takes {base.cost * 1e3:.2f} ms per step (its rows "
                   "are bound by memory)")
        reasons.append(f"memory: chosen because {why}")
        for t in [t for t in tried if t.cost <= chosen.cost and t.short and t.opt not in (floor, chosen.opt)][:2]:
            reasons.append(f"memory: {t.opt.describe()} does not fit ({t.short[0]})")
    return tuple(reasons)


def _count(opt: MemoryOptions) -> int:
    return int(opt.activation_checkpoint) + int(opt.zero > 0) + int(opt.offload != "none")
