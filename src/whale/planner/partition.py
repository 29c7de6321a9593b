"""Inter-TaskGraph (pipeline) balancing: device order and contiguous stage cuts (Whale paper, Jia et al.,
USENIX ATC 2022, §3.3: pipeline stages cut by device memory and speed).

Stage s of S takes a contiguous run of layers (at least one). Its time is (sum of its layers' FLOPs) /
``stage_flops[s]``; its memory is (sum of its layers' static bytes) + ``in_flight[s]`` x (sum of its layers'
activation bytes per micro-batch), which must not exceed ``stage_mem_capacity[s]``. Under 1F1B stage s holds up
to S - s micro-batches, so the paper orders devices by memory, largest first (choosing the order too, jointly
with the cut, is :func:`whale.planner.placement.place_stages`). :func:`partition_layers` finds the
cut that minimizes the slowest stage's time exactly, by a min-max dynamic program over (stage, layer prefix),
vectorized with numpy: O(S x n^2) time, O(n^2) memory per stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from whale.plan.schedule import in_flight_micro_batches
from whale.planner.balance import InfeasiblePlanError
from whale.units import format_bytes


def order_devices_by_memory(mem: Sequence[float]) -> list[int]:
    """Device indices by memory (bytes), largest first; equal memory keeps the given order (stable)."""
    return sorted(range(len(mem)), key=lambda i: -mem[i])


def uniform_partition(n_layers: int, n_stages: int) -> list[int]:
    """Layer counts per stage as even as possible; the first ``n_layers % n_stages`` stages get one more
    (``numpy.array_split`` convention). Raises ValueError unless 1 <= n_stages <= n_layers."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} non-empty stages")
    q, r = divmod(n_layers, n_stages)
    return [q + (1 if s < r else 0) for s in range(n_stages)]


def _one_f_one_b_in_flight(num_stages: int) -> list[int]:
    """Micro-batches each stage holds under 1F1B with enough micro-batches to fill it: S - s on stage s."""
    return [in_flight_micro_batches(s, num_stages, num_stages) for s in range(num_stages)]


def _bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for c in counts:
        out.append((a, a + c))
        a += c
    return out


def stage_times(counts: Sequence[int], layer_flops: Sequence[float], stage_flops: Sequence[float]) -> list[float]:
    """Seconds per stage at peak: sum of the stage's layer FLOPs / its device's FLOP/s."""
    return [sum(layer_flops[a:b]) / f for (a, b), f in zip(_bounds(counts), stage_flops, strict=True)]


def stage_memory(counts: Sequence[int], layer_mem: Sequence[float], layer_act_mem: Sequence[float] | None = None,
                 in_flight: Sequence[int] | None = None) -> list[float]:
    """Bytes per stage: static layer bytes + in-flight micro-batches x activation bytes per micro-batch.

    ``in_flight`` defaults to 1F1B's S - s; ``layer_act_mem`` to zeros."""
    S = len(counts)
    act = layer_act_mem if layer_act_mem is not None else [0.0] * len(layer_mem)
    fl = in_flight if in_flight is not None else _one_f_one_b_in_flight(S)
    return [sum(layer_mem[a:b]) + fl[s] * sum(act[a:b]) for s, (a, b) in enumerate(_bounds(counts))]


def _minmax_cut(n: int, S: int, stage_cost: Callable[[int], np.ndarray]) -> tuple[float, list[int]]:
    """Exact min over contiguous cuts of max over stages of ``stage_cost(s)[i, j]`` (layers i..j-1 on stage
    s; ``inf`` = not allowed). Returns (best value, layer counts); value ``inf`` when nothing is allowed."""
    dp = np.full(n + 1, np.inf)
    dp[0] = 0.0
    back = np.zeros((S, n + 1), dtype=np.int64)
    empty = np.tril(np.ones((n + 1, n + 1), dtype=bool))  # [i, j] with j <= i: empty stage
    for s in range(S):
        cand = np.maximum(dp[:, None], stage_cost(s))
        cand[empty] = np.inf
        back[s] = cand.argmin(axis=0)
        dp = cand[back[s], np.arange(n + 1)]
    best = float(dp[n])
    if not math.isfinite(best):
        return best, []
    counts, j = [], n
    for s in range(S - 1, -1, -1):
        i = int(back[s, j])
        counts.append(j - i)
        j = i
    return best, counts[::-1]


def _check_inputs(layer_flops, layer_mem, stage_flops, stage_mem_capacity, layer_act_mem, in_flight) -> None:
    n, S = len(layer_flops), len(stage_flops)
    if len(layer_mem) != n or (layer_act_mem is not None and len(layer_act_mem) != n):
        raise ValueError(f"layer_flops, layer_mem and layer_act_mem need one entry per layer ({n})")
    if len(stage_mem_capacity) != S or (in_flight is not None and len(in_flight) != S):
        raise ValueError(f"stage_flops, stage_mem_capacity and in_flight need one entry per stage ({S})")
    if S < 1 or n < S:
        raise ValueError(f"cannot cut {n} layers into {S} non-empty stages; use at most {n} stages")
    for name, xs in (("layer_flops", layer_flops), ("layer_mem", layer_mem), ("layer_act_mem", layer_act_mem or []),
                     ("stage_mem_capacity", stage_mem_capacity)):
        if any(not (x >= 0 and math.isfinite(x)) for x in xs):
            raise ValueError(f"{name} must hold finite numbers >= 0, got {list(xs)}")
    if any(not (f > 0 and math.isfinite(f)) for f in stage_flops):
        raise ValueError(f"stage_flops must hold finite numbers > 0 (FLOP/s), got {list(stage_flops)}")


def partition_layers(layer_flops: Sequence[float], layer_mem: Sequence[float], stage_flops: Sequence[float],
                     stage_mem_capacity: Sequence[float], layer_act_mem: Sequence[float] | None = None,
                     in_flight: Sequence[int] | None = None) -> list[int]:
    """Contiguous layer counts per stage minimizing the slowest stage within memory (paper §3.3).

    Args:
        layer_flops: work per layer (FLOPs per micro-batch, forward + backward; any consistent unit).
        layer_mem: static bytes per layer (params + grads + optimizer state + buffers).
        stage_flops: FLOP/s of the device running each stage, in stage order (see
            :func:`order_devices_by_memory`).
        stage_mem_capacity: bytes each stage's device may use, in stage order.
        layer_act_mem: activation bytes per layer per micro-batch (default zeros).
        in_flight: micro-batches each stage holds at once (default 1F1B's S - s for stage s; see
            :func:`whale.plan.schedule.in_flight_micro_batches`).

    Returns:
        Layer counts per stage (each >= 1, adding up to the number of layers), minimizing
        max_s stage_time[s] exactly over all contiguous cuts that fit memory; ties go to the cut whose
        earlier stages are shortest.

    Raises:
        InfeasiblePlanError: no contiguous cut fits; names the stage and the bytes it lacks in the cut that
            comes closest (least worst overflow).
        ValueError: mismatched lengths, negative values, fewer layers than stages.
    """
    _check_inputs(layer_flops, layer_mem, stage_flops, stage_mem_capacity, layer_act_mem, in_flight)
    n, S = len(layer_flops), len(stage_flops)
    fl = list(in_flight) if in_flight is not None else _one_f_one_b_in_flight(S)
    P = np.concatenate([[0.0], np.cumsum(np.asarray(layer_flops, dtype=np.float64))])
    M = np.concatenate([[0.0], np.cumsum(np.asarray(layer_mem, dtype=np.float64))])
    A = np.concatenate([[0.0], np.cumsum(np.asarray(layer_act_mem or [0.0] * n, dtype=np.float64))])
    dP, dM, dA = (X[None, :] - X[:, None] for X in (P, M, A))  # [i, j] = sum over layers i..j-1

    def overflow(s: int) -> np.ndarray:
        """Bytes over capacity for every cut of stage s."""
        return dM + fl[s] * dA - stage_mem_capacity[s]

    def time_cost(s: int) -> np.ndarray:
        """Stage time for every cut of stage s."""
        return np.where(overflow(s) <= 0, dP / stage_flops[s], np.inf)

    best, counts = _minmax_cut(n, S, time_cost)
    if counts:
        return counts
    _, closest = _minmax_cut(n, S, overflow)
    need = stage_memory(closest, layer_mem, layer_act_mem, fl)
    s = max(range(S), key=lambda k: need[k] - stage_mem_capacity[k])
    raise InfeasiblePlanError(
        f"no contiguous cut of {n} layers into {S} stages fits memory; the closest cut {closest} still needs "
        f"{format_bytes(need[s])} on stage {s} (capacity {format_bytes(stage_mem_capacity[s])}), lacking "
        f"{format_bytes(need[s] - stage_mem_capacity[s])} (all stages together have "
        f"{format_bytes(sum(stage_mem_capacity))} for {format_bytes(sum(layer_mem))} of static memory plus "
        "activations)", s, need[s], stage_mem_capacity[s])
