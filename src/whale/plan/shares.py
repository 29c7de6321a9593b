"""Whale's one apportionment: how the plan's relative weights become whole units (rows of a micro-batch, elements
of a sharded dim, experts, ZeRO shard elements).

The plan stores weights (``lane_weights``, ``stage_lane_weights``, ``shard_weights``, ``zero_weights``), never
the whole units: those depend on sizes known only at run time (the global batch, each tensor's dim). So the
rule that turns weights into units is part of the contract: the layout (:meth:`Plan.micro_batch_rows`), the
printout (experts per device), the runtime's shard sizes and the planner all call :func:`whole_shares`, and
agree because there is one home for it. The shares are exact: :func:`min_max_shares` minimizes the slowest
device, ``max_i fixed_i + b_i * unit_i``, and a largest-remainder rounding of proportional shares is not used
(3 x P100 + 1 x H100 with 12 samples: largest remainder gives [2, 1, 1, 8], 1.4x slower than [1, 1, 1, 9]).
Memory-constrained balancing on top of this rule is the planner's (:mod:`whale.planner.balance`).

Source: the Whale paper's intra-TaskGraph balancing (Jia et al., USENIX ATC 2022, §3.3), made exact.
Deterministic; pure arithmetic, no torch.
"""

from __future__ import annotations

import heapq
import math


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

    This is Whale's one apportionment: batch shares (:meth:`Plan.micro_batch_rows`), shard sizes of ``split``, ZeRO
    shards and the speed part of :func:`whale.planner.balance.balance_batch` / ``balance_shards`` all come from here.
    Shares are near ``total * w_i / sum(w)``; where rounding leaves a unit over it goes to the device that finishes it
    first (a largest-remainder rounding can hand it to a slow device); with ``min_share = 0`` every share is at least
    the floor of its quota. A weight of 0 gets ``min_share``. Deterministic (ties to the device with fewer units, then
    to the lower index).

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
