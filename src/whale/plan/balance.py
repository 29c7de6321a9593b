"""Intra-TaskGraph load balancing: hardware-aware, memory-constrained shares (Whale paper, Jia et al., USENIX ATC
2022, §3.3, Algorithm 1).

A TaskGraph's work is cut into whole units — samples of the global batch for ``replicate``, elements of the
sharded dimension for ``split`` — and device i gets L_i units. Device i then needs
``mem_fixed[i] + L_i * mem_per_unit`` bytes, which must not exceed ``mem_capacity[i]``.

Algorithm (the paper's Algorithm 1 on whole units):
  1. start from shares proportional to peak FLOP/s (largest remainder, ties to the lower index), raised to
     ``min_share`` where needed;
  2. while some device is over its memory, move load from the most overloaded device to the device with the
     lowest max(compute utilization, memory utilization) that still has room, where compute utilization is
     L_j / (its FLOPS-proportional quota) and memory utilization is used bytes / capacity — measured after
     taking the unit, which keeps the slowest receiver as fast as possible;
  3. if load remains that no device can take, the plan is infeasible: :class:`InfeasiblePlanError`.
Moving from several overloaded devices ends in the same state as moving from the most overloaded one first,
so step 2 clamps every overloaded device to its limit and hands the excess out greedily. Deterministic.
"""

from __future__ import annotations

import heapq
import math

from whale.plan.plan import PlanError
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


def proportional_shares(total: int, weights: list[float], min_share: int = 0) -> list[int]:
    """Whole shares of ``total`` proportional to ``weights``, adding up to ``total`` exactly.

    Largest-remainder (Hamilton) method: every share first gets the floor of its quota ``total * w_i / sum(w)``,
    then the units left go to the largest fractional parts (ties to the lower index). Every share below
    ``min_share`` is then raised one unit at a time, each unit taken from the share furthest above its quota
    (ties to the lower index). Deterministic. This is Whale's one apportionment: batch shares, shard sizes and
    the starting point of :func:`balance_batch` / :func:`balance_shards` all come from here.

    Args:
        total: units to share (whole samples, elements of a dim), >= 0.
        weights: one finite number >= 0 per share, with a positive sum (e.g. device FLOP/s); a zero weight
            gets ``min_share``.
        min_share: fewest units any share may get.

    Raises:
        ValueError: empty weights, a negative or non-finite weight, an all-zero sum, or
            ``total < len(weights) * min_share``.
    """
    n = len(weights)
    if n == 0 or any(not (w >= 0 and math.isfinite(w)) for w in weights) or not sum(weights) > 0:
        raise ValueError(f"weights must be a non-empty list of finite numbers >= 0 with a positive sum, "
                         f"got {weights}")
    if total < n * min_share:
        raise ValueError(f"cannot give {n} devices at least {min_share} each out of {total}")
    s = sum(weights)
    quota = [total * w / s for w in weights]
    shares = [math.floor(q) for q in quota]
    order = sorted(range(n), key=lambda i: (-(quota[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    for i in range(n):
        while shares[i] < min_share:
            donor = max((j for j in range(n) if shares[j] > min_share), key=lambda j: (shares[j] - quota[j], -j))
            shares[donor] -= 1
            shares[i] += 1
    return shares


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


def _fill(shares: list[int], limits: list[int], quota: list[float], excess: int,
          util_mem: list[tuple[float, float]]) -> int:
    """Hand ``excess`` units, one at a time, each to the device with room whose max(compute, memory)
    utilization after taking it is lowest (ties to the lower index); changes ``shares`` in place.

    Compute utilization is L_j / quota_j; memory utilization is ``a_j + b_j * L_j`` with
    ``util_mem[j] = (a_j, b_j) = (fixed_j / cap_j, per_unit / cap_j)``. Done as water-filling: a bisection on
    the utilization level finds the bulk, then a heap places the last few units exactly. Returns the units no
    device could take."""
    n = len(shares)

    def util(j: int, load: int) -> float:
        """Utilization of device j at a load."""
        a, b = util_mem[j]
        return max(load / quota[j], a + b * load)

    def load_at(j: int, level: float) -> int:  # largest load in [shares_j, limits_j] with util <= level
        """Largest load of device j with utilization <= level."""
        a, b = util_mem[j]
        x = min(level * quota[j], (level - a) / b if b > 0 else math.inf)
        return max(shares[j], min(limits[j], math.floor(x) if math.isfinite(x) else limits[j]))

    def gained(level: float) -> int:
        """Units placed at a level."""
        return sum(load_at(j, level) - shares[j] for j in range(n))

    room = sum(max(0, limits[j] - shares[j]) for j in range(n))
    if room <= excess:
        for j in range(n):
            shares[j] = max(shares[j], limits[j])
        return excess - room
    lo, hi = 0.0, 1.0
    while gained(hi) < excess:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        lo, hi = (lo, mid) if gained(mid) >= excess else (mid, hi)
    bulk = [load_at(j, lo) for j in range(n)]
    excess -= sum(bulk) - sum(shares)
    shares[:] = bulk
    heap = [(util(j, shares[j] + 1), j) for j in range(n) if shares[j] < limits[j]]
    heapq.heapify(heap)
    while excess > 0:
        _, j = heapq.heappop(heap)
        shares[j] += 1
        excess -= 1
        if shares[j] < limits[j]:
            heapq.heappush(heap, (util(j, shares[j] + 1), j))
    return 0


def _balance(total: int, flops: list[float], cap: list[float], fixed: list[float], per: float,
             min_share: int, unit: str) -> list[int]:
    """Algorithm 1 on whole units (module docs); ``unit`` names them in error messages."""
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
    shares = proportional_shares(total, flops, min_share)
    s = sum(flops)
    quota = [total * f / s for f in flops]
    over = [(fixed[i] + shares[i] * per - cap[i], -i) for i in range(n) if shares[i] > limits[i]]
    excess = sum(max(0, shares[i] - limits[i]) for i in range(n))
    if excess == 0:
        return shares
    worst = -max(over)[1]
    shares = [min(shares[i], limits[i]) for i in range(n)]
    util_mem = [(fixed[i] / cap[i], per / cap[i]) if cap[i] > 0 else (0.0, 0.0) for i in range(n)]  # 0 B of 0 B
    left = _fill(shares, limits, quota, excess, util_mem)
    if left:
        need = fixed[worst] + (shares[worst] + left) * per
        total_need = sum(fixed) + total * per
        raise InfeasiblePlanError(
            f"device {worst} would need {format_bytes(need)} for {shares[worst] + left} {unit}(s) but has "
            f"{format_bytes(cap[worst])}; it lacks {format_bytes(need - cap[worst])} and every other device is "
            f"full (all devices together need {format_bytes(total_need)}, have {format_bytes(sum(cap))})",
            worst, need, cap[worst])
    return shares


def balance_batch(global_batch: int, flops: list[float], mem_capacity: list[float], mem_fixed: list[float],
                  mem_per_sample: float, min_share: int = 1) -> list[int]:
    """Per-device batch shares for a replicate TaskGraph (paper §3.3, Algorithm 1).

    Args:
        global_batch: samples per step (all devices together).
        flops: peak FLOP/s of each device (or any positive speed; only ratios matter).
        mem_capacity: bytes each device may use.
        mem_fixed: bytes each device needs whatever its share (params, grads, optimizer state, buffers).
        mem_per_sample: activation bytes one sample adds on any device.
        min_share: fewest samples a device may get (default 1, so every rank has work).

    Returns:
        Whole samples per device, adding up to ``global_batch`` exactly, each device within its memory.

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
    """Per-device shard sizes of a split TaskGraph's sharded dimension (paper §3.3, Algorithm 1).

    Args:
        dim_size: length of the sharded dimension (elements, e.g. output features or classes).
        flops: peak FLOP/s of each device.
        mem_capacity: bytes each device may use.
        mem_fixed: bytes each device needs whatever its shard (unsharded state, buffers, activations).
        mem_per_unit: bytes one element of the dimension adds (its slice of params, grads, optimizer state
            and activations).

    Returns:
        Shard sizes, each >= 1, adding up to ``dim_size`` exactly, each device within its memory.

    Raises:
        InfeasiblePlanError: no assignment fits; names the device and the bytes it lacks.
        ValueError: ``dim_size`` smaller than the number of devices, or bad lengths/values.
    """
    if dim_size < len(flops):
        raise ValueError(f"cannot split a dimension of size {dim_size} over {len(flops)} devices "
                         f"(each shard needs >= 1 element); use at most {dim_size} devices")
    return _balance(dim_size, flops, mem_capacity, mem_fixed, mem_per_unit, 1, "element")
