"""Hardware-aware ZeRO shard sizes (a pure function of the plan and the cluster spec).

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020)
partitions training state over the data-parallel ranks that hold the same parameters: stage 1 the optimizer
state, stage 2 also the gradients. In Whale those ranks are one pipeline stage's data-parallel lanes, and each
stage shards over its own lanes. ZeRO cuts the state evenly; on a cluster that mixes devices an even cut lets
the smallest device run out of memory first. Here each lane's shard follows its device's *free* memory, in the
spirit of the Whale paper's Algorithm 1 (Jia et al., USENIX ATC 2022, §3.3) applied to memory: shares
proportional to ``capacity_i - unsharded_i`` (:func:`free_memory_shares`, as
:func:`whale.plan.shares.whole_shares` makes batch shares follow speed), which minimizes the
largest fraction of any device's free memory the state takes. With little unsharded the shares follow
capacity: a 32 GB device holds about twice the state of a 16 GB one.

Bytes assumed per parameter element (fp32): 4 for the parameter, 4 for its gradient, 8 of optimizer state
(Adam/AdamW: two moments; the optimizer is not known when planning). Under stage 1 parameters and gradients
stay whole on every lane; under stage 2 only parameters do; under stage 3 nothing does (the units gathered for
one forward or backward at a time are left out). With a memory model (a sample batch was profiled) each lane
also keeps the activations of its batch share in flight.
"""

from __future__ import annotations

import dataclasses

from whale.plan.plan import Plan

PARAM_BYTES, GRAD_BYTES, OPTIM_BYTES = 4, 4, 8  # per fp32 parameter element (Adam: exp_avg + exp_avg_sq)


def free_memory_shares(capacity: list[float], unsharded: list[float], total: float) -> list[float]:
    """Shares of ``total`` bytes proportional to each device's free memory ``capacity_i - unsharded_i``.

    They minimize ``max_i share_i / free_i``, the largest fraction of a device's free memory the sharded state
    takes (every device takes the same fraction), so the state fits wherever any split fits; it also spreads
    the optimizer's work over every device. Devices with no free memory get nothing; when none has any, the
    shares follow capacity (the plan cannot fit; the memory checks say so).

    Args:
        capacity: bytes per device, each > 0.
        unsharded: bytes each device holds whatever its share, each >= 0.
        total: bytes to share, >= 0.

    Returns:
        One share (bytes) per device, summing to ``total`` (proportional to capacity when ``total`` is 0).

    Raises:
        ValueError: lists of different lengths, empty, a capacity <= 0 or a negative byte count.
    """
    n = len(capacity)
    if n == 0 or len(unsharded) != n or any(not c > 0 for c in capacity) or any(u < 0 for u in unsharded) \
            or total < 0:
        raise ValueError(f"free_memory_shares needs capacities > 0 and byte counts >= 0 of one length, got "
                         f"capacity={capacity}, unsharded={unsharded}, total={total}")
    free = [max(0.0, c - u) for c, u in zip(capacity, unsharded, strict=True)]
    weights = free if sum(free) > 0 else [float(c) for c in capacity]
    return [w * (total if total > 0 else 1.0) / sum(weights) for w in weights]


def worst_fraction(capacity: list[float], unsharded: list[float], shares: list[float]) -> float:
    """The largest ``shares_i / (capacity_i - unsharded_i)``, what :func:`free_memory_shares` minimizes
    (``inf`` when a device with no free memory gets a share)."""
    out = 0.0
    for c, u, x in zip(capacity, unsharded, shares, strict=True):
        free = c - u
        out = max(out, x / free if free > 0 else (float("inf") if x > 0 else 0.0))
    return out


def stage_param_elements(plan: Plan, stage: int) -> int:
    """Parameter elements one lane of ``stage`` holds (its TaskGraphs' ``num_params``; all when colocated)."""
    return sum(tg.num_params for tg in plan.stage_task_graphs(stage))


def stage_zero_weights(plan: Plan, stage: int, capacity: list[float], activation: list[float] | None = None,
                       zero: int | None = None) -> tuple[float, ...]:
    """Relative ZeRO shard size of each lane of ``stage`` (by lane index), from each lane device's capacity
    (bytes), the bytes of activations it keeps (``activation``, default none) and the ZeRO stage.

    Raises:
        ValueError: a capacity <= 0, or lists that do not hold one entry per lane.
    """
    zero = plan.zero if zero is None else zero
    psi = stage_param_elements(plan, stage)
    whole = psi * ((PARAM_BYTES if zero <= 2 else 0) + (GRAD_BYTES if zero == 1 else 0))
    sharded = psi * (OPTIM_BYTES + (GRAD_BYTES if zero >= 2 else 0) + (PARAM_BYTES if zero >= 3 else 0))
    act = activation or [0.0] * len(capacity)
    if len(capacity) != plan.lanes_of(stage) or len(act) != len(capacity):
        raise ValueError(f"stage {stage} has {plan.lanes_of(stage)} lanes; got {len(capacity)} capacities and "
                         f"{len(act)} activation sizes")
    shares = free_memory_shares(capacity, [whole + a for a in act], float(sharded))
    top = max(shares)
    return tuple(s / top if top > 0 else 1.0 for s in shares)


def with_zero_weights(plan: Plan, capacity: list[float], activation: list[list[float]] | None = None) -> Plan:
    """A new plan whose ``zero_weights`` follow each lane device's free memory (:func:`stage_zero_weights`
    per stage); ``plan`` itself when it does not shard (``zero = 0``) or no stage has several lanes.

    Args:
        plan: the plan (device order already applied).
        capacity: bytes per rank (the cluster spec's memory, times ``memory_scale`` when emulating).
        activation: per stage, per lane, activation bytes kept in flight (``None``: not profiled, zero).

    Raises:
        ValueError: ``capacity`` does not hold one entry per rank.
    """
    if plan.zero == 0 or all(plan.lanes_of(s) == 1 for s in range(plan.num_stages)):
        return plan
    if len(capacity) != plan.world_size:
        raise ValueError(f"capacity lists {len(capacity)} ranks, the plan has {plan.world_size}")
    weights = []
    for s in range(plan.num_stages):
        caps = [capacity[plan.rank_of(s, lane)] for lane in range(plan.lanes_of(s))]
        weights.append(stage_zero_weights(plan, s, caps, activation[s] if activation else None))
    return dataclasses.replace(plan, zero_weights=tuple(weights))


def zero_shard_weights(plan: Plan, stage: int) -> tuple[float, ...]:
    """Relative ZeRO shard size of each lane of ``stage`` (the plan's ``zero_weights``, or equal)."""
    return plan.zero_weights[stage] if plan.zero_weights else (1.0,) * plan.lanes_of(stage)
