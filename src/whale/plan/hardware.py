"""Hardware-aware planning (the Whale paper's §3.3, Jia et al., USENIX ATC 2022): a pure function that takes a
plan made for identical devices and a cluster spec, and gives each device work in proportion to what it can do,
within its memory.

- Device order (inter-TaskGraph): in each replica, devices with more memory take earlier pipeline slots
  (stage s of S holds up to S - s micro-batches of activations under 1F1B).
- Lane shares (intra-TaskGraph, replicate): a lane runs at the speed of its slowest stage device; shares
  start proportional to that speed and move off lanes whose memory would overflow (the paper's Algorithm 1,
  :func:`whale.plan.balance.balance_batch`).
- Shard sizes (intra-TaskGraph, split): proportional to the speed of the devices at each shard position.
- Predicted utilization per rank: its compute time relative to the slowest rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from whale.cluster import ClusterSpec, memory_capacity
from whale.plan.balance import InfeasiblePlanError, balance_batch
from whale.plan.cost import utilization
from whale.plan.partition import order_devices_by_memory
from whale.plan.plan import Plan, PlanError
from whale.plan.schedule import in_flight_micro_batches
from whale.units import format_bytes


@dataclass(frozen=True)
class MemoryModel:
    """Memory a stage needs, for memory-constrained shares.

    Attributes:
        global_batch: samples per step the shares are computed for (bytes scale with it).
        fixed_bytes: per stage, bytes a device needs whatever its share (params + grads + optimizer state).
        per_sample_bytes: per stage, activation bytes one sample keeps alive while in flight.
    """

    global_batch: int
    fixed_bytes: list[float]
    per_sample_bytes: list[float]


def is_heterogeneous(cluster: ClusterSpec) -> bool:
    """True when the spec mixes device types (different peak FLOPS or memory)."""
    kinds = {(d.fp32_flops, d.memory_bytes) for d in cluster.devices()}
    return len(kinds) > 1


def device_order(plan: Plan, cluster: ClusterSpec) -> tuple[int, ...]:
    """Slot -> rank: within each replica's D consecutive ranks, largest memory first (stable); ``()`` when that
    is the identity."""
    if not plan.is_pipeline:
        return ()
    d = plan.num_stages * plan.stage_width
    mem = [memory_capacity(cluster, r) for r in range(plan.world_size)]
    order: list[int] = []
    for k in range(plan.num_replicas):
        ranks = list(range(k * d, (k + 1) * d))
        order += [ranks[i] for i in order_devices_by_memory([mem[r] for r in ranks])]
    return tuple(order) if order != list(range(plan.world_size)) else ()


def _lane_limits(plan: Plan, cluster: ClusterSpec, memory: MemoryModel) -> list[float]:
    """Most samples each lane can hold: min over its stages of (capacity - fixed) / per-sample bytes, where a
    stage keeps ``in_flight / m`` of its lane's samples alive at once (1F1B: min(m, S - s); GPipe: all).

    Raises:
        InfeasiblePlanError: some device cannot hold even one sample; names the rank, its stage and the bytes.
    """
    m, s_count = plan.num_micro_batch, plan.num_stages
    limits = []
    for lane in range(plan.num_lanes):
        lim = float("inf")
        for s in range(s_count):
            per = memory.per_sample_bytes[s] * in_flight_micro_batches(s, s_count, m, plan.schedule) / m
            rank = plan.rank_of(s, lane)
            cap = memory_capacity(cluster, rank)
            need_one = memory.fixed_bytes[s] + per
            if need_one > cap:
                raise InfeasiblePlanError(
                    f"rank {rank} ({cluster.devices()[rank].name}, stage {s}) needs {format_bytes(need_one)} for "
                    f"its parameters, gradients, optimizer state and one sample but has {format_bytes(cap)}; it "
                    f"lacks {format_bytes(need_one - cap)}. Use devices with more memory, more pipeline stages or "
                    "split, or (emulation) a larger memory_scale", rank, need_one, cap)
            if per > 0:
                lim = min(lim, (cap - memory.fixed_bytes[s]) / per)
        limits.append(lim)
    return limits


def lane_shares(plan: Plan, speeds: list[float], cluster: ClusterSpec, memory: MemoryModel | None) -> list[float]:
    """Relative load per lane: proportional to the lane's bottleneck speed; with a :class:`MemoryModel`, whole
    rows of one micro-batch (``memory.global_batch / num_micro_batch``), memory-constrained (the paper's
    Algorithm 1). Whole rows per micro-batch are what the runtime runs (:meth:`Plan.micro_batch_rows` cuts each
    micro-batch by these weights), so the shares the plan shows are the rows that run at that batch size.

    Raises:
        InfeasiblePlanError: no split of the batch fits the devices' memory (names the device and the bytes).
    """
    lane_speed = [min(speeds[plan.rank_of(s, lane)] for s in range(plan.num_stages))
                  for lane in range(plan.num_lanes)]
    if memory is None:
        return lane_speed
    m = plan.num_micro_batch
    rows = max(1, memory.global_batch // m)
    caps = [float(rows) if lim == float("inf") else lim / m for lim in _lane_limits(plan, cluster, memory)]
    shares = balance_batch(rows, lane_speed, caps, [0.0] * len(caps), 1.0, min(1, rows // len(caps)))
    return [float(x) for x in shares]


def shard_weights(plan: Plan, speeds: list[float], stage: int) -> tuple[float, ...]:
    """Relative shard size per position j of a split group: the slowest device at j over all replicas."""
    n = plan.stage_width
    return tuple(min(speeds[plan.rank_of(stage, k * n + j)] for k in range(plan.num_replicas)) for j in range(n))


def predicted_utilization(plan: Plan, speeds: list[float]) -> tuple[float, ...]:
    """Per rank: compute time (lane share x stage FLOPs / device speed) over the largest such time, in
    [0, 1]; stages count as equal work unless ``plan.stage_flops`` says otherwise."""
    total = sum(plan.lane_weights)
    work = plan.stage_flops or [1.0] * plan.num_stages
    times = [0.0] * plan.world_size
    for lane, w in enumerate(plan.lane_weights):
        for s in range(plan.num_stages):
            r = plan.rank_of(s, lane)
            times[r] = (w / total) * work[s] / speeds[r]
    return tuple(utilization(times))


def _split_shares(plan: Plan, speeds: list[float]) -> tuple:
    """The plan's TaskGraphs with split shard weights sized by device speed."""
    out = []
    for tg in plan.task_graphs:
        weights = shard_weights(plan, speeds, 0 if plan.colocated else tg.index)
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
    if keep_lane_weights:
        weights = plan.lane_weights
        notes += ("lane shares from Config.load_shares (as given, not balanced by device speed)",)
    else:
        weights = tuple(lane_shares(ordered, speeds, cluster, memory))
    out = dataclasses.replace(ordered, lane_weights=weights, task_graphs=_split_shares(ordered, speeds), notes=notes)
    return dataclasses.replace(out, predicted_utilization=predicted_utilization(out, speeds))


def rebalance(plan: Plan, seconds_per_row: list[float]) -> Plan:
    """A new plan whose lane shares follow measured speed (profile-guided balancing).

    ``seconds_per_row[lane]`` is the compute time per sample of the lane's slowest stage, measured over recent
    steps; the new shares are proportional to ``1 / seconds_per_row``. Datasheet FLOPS miss what really sets a
    device's speed on a model (kernel efficiency, clocks, a slower core), so a plan made from them is corrected
    after a few steps. Memory limits are not re-checked: use it where the datasheet plan was not memory-bound.

    Raises:
        PlanError: a wrong number of measurements or a non-positive one.
    """
    if len(seconds_per_row) != plan.num_lanes or any(not t > 0 for t in seconds_per_row):
        raise PlanError(f"rebalance needs {plan.num_lanes} positive seconds-per-row measurements, "
                        f"got {seconds_per_row}")
    note = "lane shares re-balanced from measured step times"
    out = dataclasses.replace(plan, lane_weights=tuple(1.0 / t for t in seconds_per_row),
                              notes=plan.notes if note in plan.notes else plan.notes + (note,))
    if plan.devices:
        speeds = [0.0] * plan.world_size
        for lane, t in enumerate(seconds_per_row):
            for s in range(plan.num_stages):
                speeds[plan.rank_of(s, lane)] = 1.0 / t
        out = dataclasses.replace(out, predicted_utilization=predicted_utilization(out, speeds))
    return out
