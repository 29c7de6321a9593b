"""Intra-TaskGraph load balancing: hardware-aware, memory-constrained whole shares (Whale paper, Jia et al.,
USENIX ATC 2022, §3.3), made exact.

A TaskGraph's work is cut into whole units — samples of the global batch for ``replicate``, elements of the
sharded dimension for ``split`` — and device i gets L_i units. Device i then needs
``mem_fixed[i] + L_i * mem_per_unit`` bytes, which must not exceed ``mem_capacity[i]``, and spends
``L_i / FLOPS_i`` (relative) seconds on them.

The paper's Algorithm 1 starts from FLOPS-proportional shares and moves load off devices whose memory overflows.
Rounding those shares to whole units (largest remainder) can hand the spare unit to a slow device (3 x P100 + 1 x H100
with 12 samples: [2, 1, 1, 8] instead of [1, 1, 1, 9], 1.4x slower). Here the shares are the exact optimum of the same
problem: minimize the slowest device, ``max_i L_i / FLOPS_i``, subject to ``sum L_i = total``, ``min_share <= L_i`` and
each device's memory (:func:`~whale.plan.shares.min_max_shares`: give each next unit to the device that finishes it
first, which is exact for a min-max of rising per-device times). If the memory of all devices together cannot hold the
work, the plan is infeasible: :class:`InfeasiblePlanError` names the device and the bytes. Deterministic. The exact rule
itself (weights -> whole units, no memory) is the contract's (:func:`whale.plan.shares.min_max_shares`,
:func:`whale.plan.shares.whole_shares`); this module adds memory.
"""

from __future__ import annotations

import math

from whale.plan.plan import PlanError
from whale.plan.shares import min_max_shares
from whale.units import format_bytes


class InfeasiblePlanError(PlanError):
    """No assignment fits the devices' memory.

    Attributes:
        device: index (in the given device order) of the device that lacks memory.
        need_bytes: bytes that device would need.
        capacity_bytes: bytes it has.
        lacking_bytes: ``need_bytes - capacity_bytes``.
    """

    def __init__(self, message: str, device: int, need_bytes: float, capacity_bytes: float) -> None:
        super().__init__(message)
        self.device = device
        self.need_bytes = need_bytes
        self.capacity_bytes = capacity_bytes
        self.lacking_bytes = need_bytes - capacity_bytes


def max_units(capacity: float, fixed: float, per_unit: float, cap: int) -> int:
    """Largest L <= ``cap`` with ``fixed + L * per_unit <= capacity`` (bytes); -1 if even L = 0 does not fit."""
    if fixed > capacity:
        return -1
    if per_unit <= 0:
        return cap
    q = (capacity - fixed) / per_unit
    n = cap if q >= cap else math.floor(q)  # q may overflow to inf for tiny per_unit
    while n < cap and fixed + (n + 1) * per_unit <= capacity:
        n += 1
    while n >= 0 and fixed + n * per_unit > capacity:
        n -= 1
    return n


def _validate(total: int, flops: list[float], cap: list[float], fixed: list[float], per: float) -> None:
    n = len(flops)
    if n == 0 or len(cap) != n or len(fixed) != n:
        raise ValueError(f"flops, mem_capacity and mem_fixed need one entry per device; got lengths "
                         f"{len(flops)}, {len(cap)}, {len(fixed)}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"the amount to share must be an int >= 0, got {total!r}")
    if any(not (f > 0 and math.isfinite(f)) for f in flops):
        raise ValueError(f"flops must hold finite numbers > 0 (FLOP/s), got {flops}")
    for name, xs in (("mem_capacity", cap), ("mem_fixed", fixed)):
        if any(not (x >= 0 and math.isfinite(x)) for x in xs):
            raise ValueError(f"{name} must hold finite numbers >= 0 (bytes), got {xs}")
    if not (per >= 0 and math.isfinite(per)):
        raise ValueError(f"memory per unit must be a finite number >= 0 (bytes), got {per}")


def _limits_text(limits: list[int], cap: list[float], unit: str) -> str:
    """``device i holds L unit(s) in B`` for up to 8 devices (the rest counted)."""
    parts = [f"device {i} holds {lim} in {format_bytes(c)}" for i, (lim, c) in enumerate(zip(limits, cap, strict=True))]
    more = f", and {len(parts) - 8} more" if len(parts) > 8 else ""
    return f"{unit}s per device: " + ", ".join(parts[:8]) + more


def _balance(total: int, flops: list[float], cap: list[float], fixed: list[float], per: float,
             min_share: int, unit: str) -> list[int]:
    """Exact min-max shares within memory (module docs); ``unit`` names the units in error messages.

    Raises:
        InfeasiblePlanError: a device cannot hold ``min_share`` units, or all together cannot hold ``total``.
    """
    _validate(total, flops, cap, fixed, per)
    n = len(flops)
    limits = [max_units(cap[i], fixed[i], per, total) for i in range(n)]
    for i in range(n):
        if limits[i] < min_share:
            need = fixed[i] + min_share * per
            raise InfeasiblePlanError(
                f"device {i} needs {format_bytes(need)} ({format_bytes(fixed[i])} fixed + {min_share} {unit}(s) x "
                f"{format_bytes(per)}) but has {format_bytes(cap[i])}; it lacks {format_bytes(need - cap[i])}",
                i, need, cap[i])
    seconds = [1.0 / f for f in flops]
    if sum(limits) < total:  # name the device the unbounded optimum overloads most
        free = min_max_shares(total, seconds, min_share=min_share)
        worst = max(range(n), key=lambda i: (fixed[i] + free[i] * per - cap[i], -i))
        left = total - sum(limits)
        need = fixed[worst] + (limits[worst] + left) * per
        total_need = sum(fixed) + total * per
        raise InfeasiblePlanError(
            f"device {worst} would need {format_bytes(need)} for {limits[worst] + left} {unit}(s) but has "
            f"{format_bytes(cap[worst])}; it lacks {format_bytes(need - cap[worst])} and every other device is "
            f"full (all devices together need {format_bytes(total_need)}, have {format_bytes(sum(cap))}; "
            f"{_limits_text(limits, cap, unit)}). Use more devices, devices with more memory or a smaller batch",
            worst, need, cap[worst])
    return min_max_shares(total, seconds, min_share=min_share, max_share=limits)


def balance_batch(global_batch: int, flops: list[float], mem_capacity: list[float], mem_fixed: list[float],
                  mem_per_sample: float, min_share: int = 1) -> list[int]:
    """Per-device batch shares for a replicate TaskGraph (paper §3.3): the whole shares minimizing the slowest
    device's time ``max_i L_i / flops_i`` exactly within each device's memory (module docs).

    Args:
        global_batch: samples per step (all devices together).
        flops: peak FLOP/s of each device (or any positive speed; only ratios matter).
        mem_capacity: bytes each device may use.
        mem_fixed: bytes each device needs whatever its share (params, grads, optimizer state, buffers).
        mem_per_sample: activation bytes one sample adds on any device.
        min_share: fewest samples a device may get (default 1, so every rank has work).

    Returns:
        Whole samples per device, adding up to ``global_batch`` exactly, each device within its memory, the
        slowest device as fast as any such assignment allows.

    Raises:
        InfeasiblePlanError: no assignment fits; names the device and the bytes it lacks.
        ValueError: bad lengths or values, or ``global_batch < len(flops) * min_share``.
    """
    if global_batch < len(flops) * min_share:
        raise ValueError(f"global batch {global_batch} is too small for {len(flops)} devices with at least "
                         f"{min_share} sample(s) each; raise the batch or use fewer data-parallel devices")
    return _balance(global_batch, flops, mem_capacity, mem_fixed, mem_per_sample, min_share, "sample")


def balance_shards(dim_size: int, flops: list[float], mem_capacity: list[float], mem_fixed: list[float],
                   mem_per_unit: float) -> list[int]:
    """Per-device shard sizes of a split TaskGraph's sharded dimension (paper §3.3): minimizing the slowest
    device's time ``max_i L_i / flops_i`` exactly within each device's memory (module docs).

    Args:
        dim_size: length of the sharded dimension (elements, e.g. output features or classes).
        flops: peak FLOP/s of each device.
        mem_capacity: bytes each device may use.
        mem_fixed: bytes each device needs whatever its shard (unsharded state, buffers, activations).
        mem_per_unit: bytes one element of the dimension adds (its slice of params, grads, optimizer state
            and activations).

    Returns:
        Shard sizes, each >= 1, adding up to ``dim_size`` exactly, each device within its memory, the slowest
        device as fast as any such assignment allows.

    Raises:
        InfeasiblePlanError: no assignment fits; names the device and the bytes it lacks.
        ValueError: ``dim_size`` smaller than the number of devices, or bad lengths/values.
    """
    if dim_size < len(flops):
        raise ValueError(f"cannot split a dimension of size {dim_size} over {len(flops)} devices "
                         f"(each shard needs >= 1 element); use at most {dim_size} devices")
    return _balance(dim_size, flops, mem_capacity, mem_fixed, mem_per_unit, 1, "element")
