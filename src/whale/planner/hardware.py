"""Hardware-aware planning (the Whale paper's §3.3, Jia et al., USENIX ATC 2022): a pure function that takes a
plan made for identical devices and a cluster spec, and gives each device work in proportion to what it can do,
within its memory.

- Device order (inter-TaskGraph): kept when the plan's stages were already placed with the cut
  (:mod:`whale.planner.placement`); otherwise, in each replica, devices with more memory take earlier pipeline
  slots (stage s of S holds up to S - s micro-batches of activations under 1F1B).
- Lane shares (intra-TaskGraph, replicate): a lane runs at the speed of its slowest stage device; shares
  minimize the slowest lane within every lane's memory (exact whole rows,
  :func:`whale.planner.balance.balance_batch`). Stages of different widths balance each stage's own lanes (each
  lane of a stage is one device; the batch bridge re-splits rows between stages).
- Shard sizes (intra-TaskGraph, split): weights = the speed of the devices at each shard position (whole
  elements by :func:`whale.plan.shares.whole_shares`).
- Predicted utilization per rank: its compute time relative to the slowest rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from whale.cluster import ClusterSpec, memory_capacity
from whale.plan.plan import Plan, PlanError
from whale.planner.balance import InfeasiblePlanError, balance_batch
from whale.planner.partition import order_devices_by_memory
from whale.planner.steptime.cost import utilization
from whale.units import format_bytes


@dataclass(frozen=True)
class MemoryModel:
    """Memory a stage needs, for memory-constrained shares.

    Attributes:
        global_batch: samples per step the shares are computed for (bytes scale with it).
        fixed_bytes: per stage, bytes a device needs whatever its share (params + grads + optimizer state).
        per_sample_bytes: per stage, activation bytes one sample keeps alive while in flight.
        recompute_bytes: per stage, activation bytes per sample of the largest checkpointed unit, alive once
            while it is recomputed in backward (empty: no activation checkpointing).
    """

    global_batch: int
    fixed_bytes: list[float]
    per_sample_bytes: list[float]
    recompute_bytes: list[float] = field(default_factory=list)


def is_heterogeneous(cluster: ClusterSpec) -> bool:
    """True when the spec mixes device types (different peak FLOPS or memory)."""
    kinds = {(d.fp32_flops, d.memory_bytes) for d in cluster.devices()}
    return len(kinds) > 1


def device_order(plan: Plan, cluster: ClusterSpec) -> tuple[int, ...]:
    """Slot -> rank. A pipeline whose devices were already placed (``plan.device_order`` set by the exact joint
    placement, :func:`whale.frontend.hwplan.hardware_cut`) keeps them. Otherwise (no profile: every stage counts
    as equal work, so the order cannot change the slowest stage) within each replica's D consecutive ranks,
    largest memory first (stable; the paper's order, since earlier 1F1B stages hold more micro-batches);
    ``()`` when that is the identity."""
    if not plan.is_pipeline:
        return ()
    if plan.device_order:
        return plan.device_order
    d = sum(plan.stage_widths)
    mem = [memory_capacity(cluster, r) for r in range(plan.world_size)]
    order: list[int] = []
    for k in range(plan.num_replicas):
        ranks = list(range(k * d, (k + 1) * d))
        order += [ranks[i] for i in order_devices_by_memory([mem[r] for r in ranks])]
    return tuple(order) if order != list(range(plan.world_size)) else ()


def _rank_limit(plan: Plan, cluster: ClusterSpec, memory: MemoryModel, s: int, rank: int) -> float:
    """Most samples ``rank`` can hold running stage ``s``: (capacity - fixed) / per-sample bytes, where the stage
    keeps ``in_flight / m`` of its lane's samples alive at once (1F1B: min(m, S - s); GPipe: all).

    Raises:
        InfeasiblePlanError: the device cannot hold even one sample; names the rank, its stage and the bytes.
    """
    m = plan.num_micro_batch
    per = memory.per_sample_bytes[s] * plan.in_flight(s) / m
    cap = memory_capacity(cluster, rank)
    need_one = memory.fixed_bytes[s] + per
    if need_one > cap:
        raise InfeasiblePlanError(
            f"rank {rank} ({cluster.devices()[rank].name}, stage {s}) needs {format_bytes(need_one)} for "
            f"its parameters, gradients, optimizer state and one sample but has {format_bytes(cap)}; it "
            f"lacks {format_bytes(need_one - cap)}. Use devices with more memory, more pipeline stages or "
            "split, or (emulation) a larger memory_scale", rank, need_one, cap)
    return (cap - memory.fixed_bytes[s]) / per if per > 0 else float("inf")


def _balanced(memory: MemoryModel, m: int, lane_speed: list[float], limits: list[float]) -> list[float]:
    """Whole rows of one micro-batch per lane, proportional to speed within each lane's sample limit.

    Raises:
        InfeasiblePlanError: the lanes' memory holds fewer rows than a micro-batch has (names the counts).
    """
    rows = max(1, memory.global_batch // m)
    caps = [float(rows) if lim == float("inf") else lim / m for lim in limits]
    try:
        shares = balance_batch(rows, lane_speed, caps, [0.0] * len(caps), 1.0, min(1, rows // len(caps)))
    except InfeasiblePlanError as e:
        raise InfeasiblePlanError(
            f"lane {e.device}'s memory holds {caps[e.device]:.2f} rows of a micro-batch and all lanes together "
            f"{sum(caps):.2f}, but a micro-batch of {rows} rows needs at least {min(1, rows // len(caps))} on "
            "every lane: use more micro-batches, a smaller batch or devices with more memory", e.device,
            float(rows), sum(caps)) from e
    return [float(x) for x in shares]


def lane_shares(plan: Plan, speeds: list[float], cluster: ClusterSpec, memory: MemoryModel | None) -> list[float]:
    """Relative load per lane (stages of one width): the lane's bottleneck speed (the runtime cuts rows by it,
    :func:`whale.plan.shares.whole_shares`); with a :class:`MemoryModel`, whole rows of one micro-batch
    (``memory.global_batch / num_micro_batch``), memory-constrained (exact min-max shares,
    :func:`whale.planner.balance.balance_batch`). Whole rows per micro-batch are what the runtime runs
    (:meth:`Plan.micro_batch_rows` cuts each micro-batch by these weights), so the shares the plan shows are the
    rows that run at that batch size.

    Raises:
        InfeasiblePlanError: no split of the batch fits the devices' memory (names the device and the bytes).
    """
    lane_speed = [min(speeds[plan.rank_of(s, lane)] for s in range(plan.num_stages))
                  for lane in range(plan.num_lanes)]
    if memory is None:
        return lane_speed
    limits = [min(_rank_limit(plan, cluster, memory, s, plan.rank_of(s, lane)) for s in range(plan.num_stages))
              for lane in range(plan.num_lanes)]
    return _balanced(memory, plan.num_micro_batch, lane_speed, limits)


def stage_lane_shares(plan: Plan, speeds: list[float], cluster: ClusterSpec,
                      memory: MemoryModel | None) -> tuple[tuple[float, ...], ...]:
    """Stages of different widths: per stage, the relative load of each of its lanes (one device each),
    proportional to that device's speed and, with a :class:`MemoryModel`, within its memory (as
    :func:`lane_shares`, stage by stage).

    Raises:
        InfeasiblePlanError: no split of a stage's rows fits its devices' memory.
    """
    out = []
    for s in range(plan.num_stages):
        ranks = plan.stage_ranks(s)
        lane_speed = [speeds[r] for r in ranks]
        if memory is not None:
            limits = [_rank_limit(plan, cluster, memory, s, r) for r in ranks]
            lane_speed = _balanced(memory, plan.num_micro_batch, lane_speed, limits)
        out.append(tuple(lane_speed))
    return tuple(out)


def shard_weights(plan: Plan, speeds: list[float], stage: int) -> tuple[float, ...]:
    """Relative shard size per position j of a split group: the slowest device at j over all replicas."""
    n = plan.stage_width
    return tuple(min(speeds[plan.rank_of(stage, k * n + j)] for k in range(plan.num_replicas)) for j in range(n))


def predicted_utilization(plan: Plan, speeds: list[float]) -> tuple[float, ...]:
    """Per rank: compute time (its lane's share of its stage x stage FLOPs / device speed) over the largest
    such time, in [0, 1]; stages count as equal work unless ``plan.stage_flops`` says otherwise."""
    work = plan.stage_flops or [1.0] * plan.num_stages
    times = [0.0] * plan.world_size
    for s in range(plan.num_stages):
        weights = plan.weights_of(s)
        total = sum(weights)
        for lane, w in enumerate(weights):
            r = plan.rank_of(s, lane)
            times[r] = (w / total) * work[s] / speeds[r]
    return tuple(utilization(times))


def _split_shares(plan: Plan, speeds: list[float]) -> tuple:
    """The plan's TaskGraphs with split shard weights sized by device speed (none in stages of different
    widths, where the plan refuses split)."""
    if not plan.uniform_width:
        return plan.task_graphs
    out = []
    for tg in plan.task_graphs:
        weights = shard_weights(plan, speeds, 0 if plan.colocated else plan.position_of(tg.index))  # chunk -> stage
        nested = tuple(dataclasses.replace(n, shard_weights=weights) if n.kind == "split" else n for n in tg.nested)
        out.append(dataclasses.replace(tg, nested=nested, shard_weights=weights if tg.kind == "split" else ()))
    return tuple(out)


def apply_hardware(plan: Plan, cluster: ClusterSpec, memory: MemoryModel | None = None,
                   dtype: str = "fp32", keep_lane_weights: bool = False) -> Plan:
    """A new plan: ``plan`` balanced for ``cluster`` (pure function; see the module docstring).
    ``keep_lane_weights`` keeps the plan's lane shares (the user's ``Config.load_shares``) instead of
    balancing them by device speed; the printout says so.

    Raises:
        ClusterError: the spec's device count differs from the plan's world size.
        InfeasiblePlanError: the memory model cannot fit the batch.
    """
    cluster.check_world_size(plan.world_size)
    speeds = [d.flops(dtype) for d in cluster.devices()]
    ordered = dataclasses.replace(plan, devices=tuple(d.name for d in cluster.devices()),
                                  device_order=device_order(plan, cluster))
    notes = plan.notes
    if cluster.emulate:
        notes += ("EMULATED cluster: CPU ranks imitate the declared devices' speed and memory "
                  f"(memory x {cluster.memory_scale:g}); timings are emulation, not real hardware",)
    shares: dict = {}
    if keep_lane_weights:
        notes += ("lane shares from Config.load_shares (as given, not balanced by device speed)",)
    elif ordered.uniform_width:
        shares = {"lane_weights": tuple(lane_shares(ordered, speeds, cluster, memory))}
    else:
        shares = {"stage_lane_weights": stage_lane_shares(ordered, speeds, cluster, memory)}
    out = dataclasses.replace(ordered, **shares, task_graphs=_split_shares(ordered, speeds), notes=notes)
    return dataclasses.replace(out, predicted_utilization=predicted_utilization(out, speeds))


def rebalance(plan: Plan, seconds_per_row: list) -> Plan:
    """A new plan whose lane shares follow measured speed (profile-guided balancing).

    ``seconds_per_row[lane]`` is the compute time per sample of the lane's slowest stage, measured over recent
    steps; for stages of different widths it is one list per stage, ``seconds_per_row[s][lane]`` (each lane of
    a stage is one rank). The new shares are proportional to ``1 / seconds_per_row``. Datasheet FLOPS miss
    what really sets a device's speed on a model (kernel efficiency, clocks, a slower core), so a plan made
    from them is corrected after a few steps. Memory limits are not re-checked: use it where the datasheet
    plan was not memory-bound.

    Raises:
        PlanError: a wrong number of measurements or a non-positive one.
    """
    per_stage = [list(seconds_per_row)] * plan.num_stages if plan.uniform_width else list(seconds_per_row)
    want = [plan.lanes_of(s) for s in range(plan.num_stages)]
    if len(per_stage) != plan.num_stages or any(
            not isinstance(row, list | tuple) or len(row) != n or any(not t > 0 for t in row)
            for row, n in zip(per_stage, want, strict=True)):
        wanted = want[0] if plan.uniform_width else f"{plan.num_stages} lists of {want}"
        raise PlanError(f"rebalance needs {wanted} positive seconds-per-row measurements, got {seconds_per_row}")
    weights = [tuple(1.0 / t for t in row) for row in per_stage]
    note = "lane shares re-balanced from measured step times"
    shares = {"lane_weights": weights[0]} if plan.uniform_width else {"stage_lane_weights": tuple(weights)}
    out = dataclasses.replace(plan, **shares, notes=plan.notes if note in plan.notes else plan.notes + (note,))
    if plan.devices:
        speeds = [0.0] * plan.world_size
        for s, row in enumerate(weights):
            for lane, speed in enumerate(row):
                speeds[plan.rank_of(s, lane)] = speed
        out = dataclasses.replace(out, predicted_utilization=predicted_utilization(out, speeds))
    return out
