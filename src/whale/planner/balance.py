"""Intra-TaskGraph load balancing: hardware-aware, memory-constrained whole shares (Whale paper, Jia et al.,
USENIX ATC 2022, §3.3), made exact.

A TaskGraph's work is cut into whole units — samples of the global batch for ``replicate``, elements of the
sharded dimension for ``split`` — and device i gets L_i units. Device i then needs
``mem_fixed[i] + L_i * mem_per_unit`` bytes, which must not exceed ``mem_capacity[i]``, and spends
``L_i / FLOPS_i`` (relative) seconds on them.

The paper's Algorithm 1 starts from FLOPS-proportional shares and moves load off devices whose memory
overflows. Rounding those shares to whole units (largest remainder) can hand the spare unit to a slow device
(3 x P100 + 1 x H100 with 12 samples: [2, 1, 1, 8] instead of [1, 1, 1, 9], 1.4x slower). Here the shares are
the exact optimum of the same problem: minimize the slowest device, ``max_i L_i / FLOPS_i``, subject to
``sum L_i = total``, ``min_share <= L_i`` and each device's memory (:func:`min_max_shares`: give each next unit
to the device that finishes it first, which is exact for a min-max of rising per-device times). If the memory
of all devices together cannot hold the work, the plan is infeasible: :class:`InfeasiblePlanError` names the
device and the bytes. Deterministic.
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


def min_max_shares(total: int, unit_seconds: list[float], fixed_seconds: list[float] | None = None,
                   min_share: int = 0, max_share: list[int] | None = None) -> list[int]:
    """Whole shares ``b_i`` of ``total`` minimizing the slowest device, ``max_i fixed_i + b_i * unit_i``, exactly.

    Constraints: ``sum(b) = total`` and ``min_share <= b_i <= max_share[i]``. Every device first takes
    ``min_share``; each further unit k of device i finishes at ``fixed_i + k * unit_i`` (rising in k), and the
    ``total - n * min_share`` smallest of these finish times are taken (ties to the device with fewer units,
    then to the lower index). This greedy
    ("give the next unit to the device that finishes it first") is exact for the min-max objective: any
    assignment takes that many distinct finish times, so its slowest device is at least the largest one taken
    here. Done in bulk: a bisection on the finish time takes all units at or below a level, and a heap places
    the last few one at a time. Deterministic; O(n log(total)) arithmetic.

    Args:
        total: units to share (whole samples or elements of a dim), >= 0.
        unit_seconds: seconds one unit costs on each device (> 0; ``inf`` for a device that should only take
            units no other device can).
        fixed_seconds: seconds each device spends whatever its share (default 0; finite, >= 0).
        min_share: fewest units any device takes.
        max_share: most units each device may take (e.g. what its memory holds; default ``total``).

    Returns:
        ``b_i`` per device, adding up to ``total``.

    Raises:
        ValueError: no devices, bad values or lengths, ``min_share`` above some ``max_share``, or
            ``total`` outside ``[n * min_share, sum(max_share)]`` (the message names the values).
    """
    n = len(unit_seconds)
    fixed = [0.0] * n if fixed_seconds is None else [float(f) for f in fixed_seconds]
    hi = [total] * n if max_share is None else [min(int(m), total) for m in max_share]
    _check_min_max(total, unit_seconds, fixed, min_share, hi)
    lo = [min_share] * n

    def finish(i: int, k: int) -> float:
        """Seconds device i needs for its k-th unit (k >= 1)."""
        return fixed[i] + k * unit_seconds[i]

    def taken(i: int, level: float) -> int:
        """Units of device i (within its bounds) finishing at or below ``level``."""
        t = unit_seconds[i]
        if not math.isfinite(t):
            return lo[i]
        k = min(hi[i], max(lo[i], math.floor(min((level - fixed[i]) / t, 2.0 ** 62))))
        while k < hi[i] and finish(i, k + 1) <= level:
            k += 1
        while k > lo[i] and finish(i, k) > level:
            k -= 1
        return k

    want = total - n * min_share
    shares = _bulk(want, n, taken, finish, lo, hi, unit_seconds)
    heap = [(finish(i, shares[i] + 1), shares[i] + 1, i) for i in range(n) if shares[i] < hi[i]]
    heapq.heapify(heap)
    for _ in range(total - sum(shares)):
        _, _, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < hi[i]:
            heapq.heappush(heap, (finish(i, shares[i] + 1), shares[i] + 1, i))
    return shares


def _check_min_max(total: int, unit_seconds: list[float], fixed: list[float], min_share: int, hi: list[int]) -> None:
    n = len(unit_seconds)
    if n == 0 or len(fixed) != n or len(hi) != n:
        raise ValueError(f"unit_seconds, fixed_seconds and max_share need one entry per device; got lengths "
                         f"{n}, {len(fixed)}, {len(hi)}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0 or min_share < 0:
        raise ValueError(f"the amount to share and min_share must be ints >= 0, got {total!r}, {min_share!r}")
    if any(not t > 0 for t in unit_seconds) or any(not (f >= 0 and math.isfinite(f)) for f in fixed):
        raise ValueError(f"unit_seconds must be > 0 (inf allowed) and fixed_seconds finite >= 0, got "
                         f"{unit_seconds}, {fixed}")
    if min(hi) < min_share or not n * min_share <= total <= sum(hi):
        raise ValueError(f"cannot share {total} unit(s) over {n} devices with at least {min_share} and at most "
                         f"{hi} each; give a total in [{n * min_share}, {sum(hi)}] or more room")


def _bulk(want: int, n: int, taken, finish, lo: list[int], hi: list[int], unit_seconds: list[float]) -> list[int]:
    """Shares holding every unit that finishes at or below the highest level where fewer than ``want`` units
    (beyond ``lo``) do, found by bisection on the level; the rest (< ties + 1) is placed by the caller's heap."""
    finite = [i for i in range(n) if math.isfinite(unit_seconds[i]) and hi[i] > lo[i]]
    chosen = set(finite)
    if not finite or want == 0:
        return list(lo)
    if sum(hi[i] - lo[i] for i in finite) <= want:  # every finite device fills up; the rest go to inf ones
        return [hi[i] if i in chosen else lo[i] for i in range(n)]
    count = lambda level: sum(taken(i, level) - lo[i] for i in finite)  # noqa: E731
    low = math.nextafter(min(finish(i, lo[i] + 1) for i in finite), -math.inf)
    high = max(finish(i, min(hi[i], lo[i] + want)) for i in finite)
    for _ in range(200):
        mid = (low + high) / 2
        if not low < mid < high:
            break
        got = count(mid)
        if got == want:
            low = mid
            break
        low, high = (low, mid) if got > want else (mid, high)
    return [taken(i, low) if i in chosen else lo[i] for i in range(n)]


def whole_shares(total: int, weights: list[float] | tuple[float, ...], min_share: int = 0) -> list[int]:
    """Whole shares of ``total`` for devices of speed ``weights``: minimizes ``max_i shares_i / weights_i``
    exactly (:func:`min_max_shares` with ``unit_seconds = 1 / weight``), adding up to ``total``.

    This is Whale's one apportionment: batch shares (:meth:`Plan.micro_batch_rows`), shard sizes of ``split``,
    ZeRO shards and the speed part of :func:`balance_batch` / :func:`balance_shards` all come from here. Shares
    are near ``total * w_i / sum(w)``; where rounding leaves a unit over it goes to the device that finishes it
    first (a largest-remainder rounding can hand it to a slow device); with ``min_share = 0`` every share is at
    least the floor of its quota. A weight of 0 gets ``min_share``. Deterministic (ties to the device with fewer
    units, then to the lower index).

    Raises:
        ValueError: empty weights, a negative or non-finite weight, an all-zero sum, or
            ``total < len(weights) * min_share``.
    """
    w = [float(x) for x in weights]
    if not w or any(not (x >= 0 and math.isfinite(x)) for x in w) or not sum(w) > 0:
        raise ValueError(f"weights must be a non-empty list of finite numbers >= 0 with a positive sum, got {w}")
    if isinstance(total, bool) or not isinstance(total, int) or total < len(w) * min_share:
        raise ValueError(f"cannot give {len(w)} devices at least {min_share} each out of {total!r}")
    return min_max_shares(total, [1.0 / x if x > 0 else math.inf for x in w], min_share=min_share)


def proportional_shares(total: int, weights: list[float], min_share: int = 0) -> list[int]:
    """The same as :func:`whole_shares` (the name callers used before the apportionment became exact)."""
    return whole_shares(total, weights, min_share)


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
