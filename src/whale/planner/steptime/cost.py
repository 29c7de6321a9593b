"""Analytic cost model: compute, communication and memory.

Pure functions of numbers. Units: FLOPs (floating-point operations), FLOP/s, bytes, bytes/s, seconds.
Pipeline step times come from the event simulator (:func:`whale.plan.schedule_sim.simulate`), not from here; this
module gives its per-event costs. What a schedule implies (micro-batches in flight, the bubble) lives with the
schedules in :mod:`whale.plan.schedule`.
"""

from __future__ import annotations

import math

from whale.cluster import DeviceType


def _check(value: float, what: str, positive: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{what} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def compute_time(flops: float, device: DeviceType | float, efficiency: float = 1.0, dtype: str = "fp32") -> float:
    """Seconds to run ``flops`` FLOPs: flops / (peak x efficiency), efficiency calibrated per device type.

    Args:
        flops: work, FLOPs (>= 0).
        device: a :class:`~whale.cluster.DeviceType` (its ``dtype`` peak is used) or a peak in FLOP/s.
        efficiency: achieved fraction of peak, in (0, 1] normally; calibrated per device type.
        dtype: ``"fp32"`` or ``"bf16"``/``"fp16"`` (only used with a DeviceType).

    Raises:
        ValueError: negative flops, non-positive peak or efficiency.
    """
    peak = device.flops(dtype) if isinstance(device, DeviceType) else _check(device, "peak FLOP/s", positive=True)
    return _check(flops, "flops") / (peak * _check(efficiency, "efficiency", positive=True))


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n-1)/n x S (0 for n = 1)."""
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    return 2.0 * (n - 1) / n * _check(nbytes, "bytes")


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` bytes over ``n`` ranks.

    Each rank sends 2(n-1)/n x S bytes over its slowest link (``bandwidth``, bytes/s), in 2(n-1) steps that
    each pay ``latency`` seconds. Raises ValueError on n < 1, negative sizes or non-positive bandwidth.
    """
    sent = ring_allreduce_bytes(nbytes, n)
    return sent / _check(bandwidth, "bandwidth", positive=True) + 2 * (n - 1) * _check(latency, "latency")


def ring_allgather_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds for a ring all-gather (or reduce-scatter) whose full result is ``nbytes`` bytes over ``n`` ranks:
    each rank sends (n-1)/n x S bytes in n-1 steps. Raises ValueError like :func:`ring_allreduce_time`."""
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    sent = (n - 1) / n * _check(nbytes, "bytes")
    return sent / _check(bandwidth, "bandwidth", positive=True) + (n - 1) * _check(latency, "latency")


def p2p_time(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds to send ``nbytes`` bytes point to point: latency + bytes / bandwidth (bytes/s).

    Raises ValueError on negative bytes/latency or non-positive bandwidth."""
    return _check(latency, "latency") + _check(nbytes, "bytes") / _check(bandwidth, "bandwidth", positive=True)


def memory_per_device(
    param_bytes: float,
    grad_bytes: float,
    optimizer_state_bytes: float,
    activation_bytes: float = 0.0,
    in_flight: int = 1,
    buffer_bytes: float = 0.0,
    zero_degree: int = 1,
    zero_stage: int = 1,
) -> float:
    """Bytes one device needs: params + grads + optimizer state + activations in flight + buffers.

    Args:
        param_bytes, grad_bytes, optimizer_state_bytes: the device's (unsharded) model state, bytes.
        activation_bytes: activation bytes saved for backward by one micro-batch on this device.
        in_flight: micro-batches whose activations are held at once (see
            :func:`whale.plan.schedule.in_flight_micro_batches`).
        buffer_bytes: module buffers plus any fixed workspace, bytes.
        zero_degree: ranks the ZeRO sharding spreads state over (1 = none).
        zero_stage: what ZeRO shards (Rajbhandari et al. 2020): 1 optimizer state, 2 also grads, 3 also params.

    Raises:
        ValueError: negative bytes, zero_degree or in_flight < 1, zero_stage not in 1..3.
    """
    if zero_degree < 1 or in_flight < 1 or zero_stage not in (1, 2, 3):
        raise ValueError(f"need zero_degree >= 1, in_flight >= 1, zero_stage in 1..3; got "
                         f"{zero_degree}, {in_flight}, {zero_stage}")
    p, g, o = (_check(x, "bytes") for x in (param_bytes, grad_bytes, optimizer_state_bytes))
    o /= zero_degree
    g /= zero_degree if zero_stage >= 2 else 1
    p /= zero_degree if zero_stage >= 3 else 1
    return p + g + o + in_flight * _check(activation_bytes, "activation bytes") + _check(buffer_bytes, "buffer bytes")


def utilization(times: list[float]) -> list[float]:
    """Predicted busy fraction of each device when all wait for the slowest: t_i / max t (1.0 if all are 0)."""
    top = max((_check(t, "time") for t in times), default=0.0)
    return [t / top if top > 0 else 1.0 for t in times]


def ring_reduce_scatter_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds for a ring reduce-scatter of ``nbytes`` bytes (the full, unreduced tensor) over ``n`` ranks: the
    same traffic as an all-gather, (n-1)/n x S per rank in n-1 steps (ZeRO-2/3 gradients). Raises ValueError."""
    return ring_allgather_time(nbytes, n, bandwidth, latency)


def all_to_all_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds for an all-to-all where each rank holds ``nbytes`` bytes and keeps 1/n of them: it sends
    (n-1)/n x S bytes as n-1 messages (pairwise exchange; MoE token dispatch). Raises ValueError."""
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    sent = (n - 1) / n * _check(nbytes, "bytes")
    return sent / _check(bandwidth, "bandwidth", positive=True) + (n - 1) * _check(latency, "latency")


def bucketed_allreduce_finish(ready: list[float], sizes: list[float], n: int, bandwidth: float,
                              latency: float = 0.0) -> float:
    """Time the last of several gradient buckets finishes its ring all-reduce when bucket k (``sizes[k]``
    bytes) becomes ready at ``ready[k]`` seconds and buckets are reduced one after another in order (as
    :mod:`whale.parallel.data` launches them): ``f_k = max(ready_k, f_{k-1}) + ring_allreduce_time(S_k)``.
    Returns ``max(ready)`` (or 0.0) when there is nothing to reduce. Raises ValueError on mismatched lists."""
    if len(ready) != len(sizes):
        raise ValueError(f"got {len(ready)} ready times for {len(sizes)} buckets; give one per bucket")
    done = 0.0
    for t, s in zip(ready, sizes, strict=True):
        done = max(done, _check(t, "ready time")) + ring_allreduce_time(s, n, bandwidth, latency)
    return done


def offload_time(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds to move ``nbytes`` bytes between device and host memory over a ``bandwidth`` (bytes/s) link
    (PCIe for a GPU): the same form as :func:`p2p_time`. Raises ValueError like it."""
    return p2p_time(nbytes, bandwidth, latency)


def split_module_comm_time(group_rows: float, max_rows: float, in_bytes: float, out_bytes: float, n: int,
                           bandwidth: float, latency: float = 0.0) -> tuple[float, float]:
    """``(forward, backward)`` seconds of the collectives of one split (sharded) module call, Megatron-style
    column -> row sharding behind Whale's bridges (:mod:`whale.parallel.bridge`, :mod:`whale.parallel.split_ops`),
    over a split group of ``n`` ranks holding ``group_rows`` rows in all (at most ``max_rows`` on one rank):

    - forward: the bridge-in all-gather of the rows (``n x max_rows x in_bytes``, padded to equal sizes) and the
      row-parallel layer's all-reduce of the output (``group_rows x out_bytes``);
    - backward: the bridge-out all-gather of the output's row gradients (``n x max_rows x out_bytes``) and the
      column-parallel layer's all-reduce of the input gradient (``group_rows x in_bytes``).

    ``in_bytes``/``out_bytes``: bytes per sample of the module's input / output. 0 for ``n = 1`` (elided).
    Raises ValueError like :func:`ring_allreduce_time`.
    """
    if n == 1:
        return 0.0, 0.0
    fwd = ring_allgather_time(n * max_rows * in_bytes, n, bandwidth, latency) + \
        ring_allreduce_time(group_rows * out_bytes, n, bandwidth, latency)
    bwd = ring_allgather_time(n * max_rows * out_bytes, n, bandwidth, latency) + \
        ring_allreduce_time(group_rows * in_bytes, n, bandwidth, latency)
    return fwd, bwd


def zero3_collective_calls(units: int, lanes: int, even: bool) -> tuple[int, int]:
    """``(forward, backward)`` collective calls ZeRO-3 (:mod:`whale.parallel.zero3`) makes on one lane in one
    micro-batch's segments over ``lanes`` data-parallel lanes: each of the ``units`` gathered per call (the
    repeated layers; a pipeline stage's one unit) is gathered before its forward and again before its backward
    (one all-gather when the lanes' shares are ``even``, else one broadcast per lane: gloo's all-gather refuses
    uneven sizes) and its gradients reduce-scattered after its backward (one call). ``(0, 0)`` for one lane.
    Each call costs the calling thread :attr:`whale.planner.calibration_cache.Calibration.collective_cpu_seconds`
    of CPU inside the segment. Raises ValueError on negative ``units`` or ``lanes`` < 1."""
    if units < 0 or lanes < 1:
        raise ValueError(f"need units >= 0 and lanes >= 1, got {units}, {lanes}")
    if lanes == 1:
        return 0, 0
    gather = 1 if even else lanes
    return units * gather, units * (gather + 1)
