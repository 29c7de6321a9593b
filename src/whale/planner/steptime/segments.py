"""Per-stage compute of the step-time model (:mod:`whale.planner.steptime.simulate`): what one stage costs
(:class:`StageCost`), each rank's speed factor, the links, and the forward/backward seconds of every micro-batch
on every (stage, lane) rank with a split stage's collectives and ZeRO-3's gathers (seconds).

Speed factor of a rank (seconds there per measured second here): under emulation (``cluster.emulate``) what
:mod:`whale.runtime.emulation` stretches compute to, ``max(1, world/cores) x s_max/s_i``; communication there is
real gloo on localhost, so it costs the calibration's measured local latency and bandwidth, not the declared
links. On a real cluster: ``1 / (best measured seconds per FLOP x peak FLOP/s x gpu_efficiency)`` (per-type
efficiency relative to the best type as measured here) and the declared links' bandwidth and latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from whale.cluster import ClusterSpec, emulation_delays
from whale.plan.plan import Plan
from whale.planner.calibration_cache import Calibration
from whale.planner.memory import MemoryOptions
from whale.planner.steptime import cost


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage's work as measured on the calibration machine (seconds on one CPU thread).

    Attributes:
        fwd_per_row, bwd_per_row: forward / backward seconds per sample (summed over the stage's units).
        fwd_overhead, bwd_overhead: fixed seconds per micro-batch (the units' per-call costs).
        fwd_flops, bwd_flops: FLOPs per sample (for reports).
        boundary_bytes: bytes per sample the stage sends to the next (activations; their gradients come back).
        trainable_elements: parameter elements with gradients (what is all-reduced and updated).
        recompute_per_row: forward seconds per sample of the checkpointable layers (activation checkpointing).
        split_bytes, split_in_bytes, split_modules: output / input bytes per sample summed over the stage's split
            modules, and their count (:func:`whale.planner.steptime.cost.split_module_comm_time`, per micro-batch and
            way).
        zero3_units: units ZeRO-3 gathers and frees around every call of the stage (its repeated layers; 1 for a
            pipeline stage), for :func:`whale.planner.steptime.cost.zero3_collective_calls`.
    """

    fwd_per_row: float
    bwd_per_row: float
    fwd_overhead: float = 0.0
    bwd_overhead: float = 0.0
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    boundary_bytes: float = 0.0
    trainable_elements: int = 0
    recompute_per_row: float = 0.0
    split_bytes: float = 0.0
    split_in_bytes: float = 0.0
    split_modules: int = 0
    zero3_units: int = 0


def speed_factors(cluster: ClusterSpec | None, calib: Calibration, world: int, cores: float = 1.0,
                  dtype: str = "fp32") -> list[float]:
    """Per rank, seconds there per second measured on the calibration machine (see the module docstring).

    Args:
        cores: CPU cores emulated ranks share (:func:`whale.cluster.emulation_cores`).

    Raises:
        ValueError: ``cores`` below 0.1 or a cluster of another size than ``world``.
    """
    if cores < 0.1:
        raise ValueError(f"cores must be >= 0.1, got {cores}")
    if cluster is None:
        return [1.0] * world
    cluster.check_world_size(world)
    if cluster.emulate:
        base = max(1.0, world / cores)
        return [base * (1.0 + d) for d in emulation_delays(cluster)]
    spf = calib.best_seconds_per_flop() or 1e-10
    return [1.0 / (spf * d.flops(dtype) * calib.gpu_efficiency) for d in cluster.devices()]


def link(cluster: ClusterSpec | None, calib: Calibration, ranks: list[int], kind: str) -> tuple[float, float]:
    """(bandwidth, latency) of the slowest link among ``ranks``: measured local gloo under emulation or
    without a cluster, else the declared links."""
    if cluster is None or cluster.emulate or len(ranks) < 2:
        if kind == "p2p":
            return calib.p2p_bandwidth, calib.p2p_latency
        return calib.allreduce_bandwidth, calib.allreduce_latency
    pairs = [(a, b) for a in ranks for b in ranks if a < b]
    return (min(cluster.link_bandwidth(a, b) for a, b in pairs), max(cluster.link_latency(a, b) for a, b in pairs))


def _add_split_comm(plan: Plan, s: int, st: StageCost, rows, fwd, bwd, cluster, calib: Calibration,
                    factor) -> None:
    """Add a split stage's collectives in place (:func:`whale.planner.steptime.cost.split_module_comm_time` per split
    module, micro-batch and direction, over each replica's ``width`` lanes). Under emulation they are waits off the CPU
    that the stretch absorbs (:mod:`whale.runtime.emulation`): ``max(stretched, CPU seconds + collectives)``."""
    n = plan.width_of(s)
    if n < 2 or st.split_modules == 0:
        return
    emulated, calls = cluster is not None and cluster.emulate, st.split_modules
    for lane in range(len(fwd)):
        group = [plan.rank_of(s, j) for j in range(lane - lane % n, lane - lane % n + n)]
        bw, lat = link(cluster, calib, group, "allreduce")
        k = max(factor[r] for r in group)
        for mb in range(len(fwd[lane])):
            got = [rows[j][mb] for j in range(lane - lane % n, lane - lane % n + n)]
            times = cost.split_module_comm_time(sum(got), max(got), st.split_in_bytes / calls,
                                                st.split_bytes / calls, n, bw, lat)
            for arr, t in zip((fwd, bwd), times, strict=True):
                seg = arr[lane][mb]
                arr[lane][mb] = max(seg, seg / k + calls * t) if emulated else seg + calls * t


def segment_seconds(st: StageCost, rows: float, factor: float, calib: Calibration,
                    checkpoint: bool = False, calls: tuple[int, int] = (0, 0), ranks: int = 0) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one micro-batch of ``rows`` samples through stage ``st`` on a rank of
    speed factor ``factor`` (seconds there per measured second). X = the units' overheads + rows x seconds per
    row (+ the recomputed forward under activation checkpointing); ``factor x (engine seconds(X) + C) +
    micro-batch overhead / 2`` with the engine fit (:class:`whale.planner.calibration_cache.EngineTiming`), else
    ``factor x (segment overhead + X + C)``; C = ``calls`` (forward, backward collective calls inside the
    segment, e.g. :func:`whale.planner.steptime.cost.zero3_collective_calls`) x the calling thread's CPU seconds
    per call (``calib.collective_cpu_seconds``): CPU work of the segment, stretched like the rest under
    emulation. ``ranks``: how many ranks share this machine (emulated or local runs; 0 otherwise), for the
    engine fit's crowding (:meth:`whale.planner.calibration_cache.EngineTiming.crowding`). The one home of the
    calibrated compute formula (also :mod:`whale.planner.steptime.calibrated`)."""
    extra = st.recompute_per_row if checkpoint else 0.0
    f = st.fwd_overhead + rows * st.fwd_per_row
    b = st.bwd_overhead + rows * (st.bwd_per_row + extra)
    cf, cb = (n * calib.collective_cpu_seconds for n in calls)
    if calib.engine is None:
        return factor * (calib.segment_overhead + f + cf), factor * (calib.segment_overhead + b + cb)
    f, b = calib.engine.segment(f, b, factor, st.split_modules, ranks)
    half = calib.engine.micro_batch_overhead / 2
    return factor * (f + cf) + half, factor * (b + cb) + half


def merge(chunks: list[StageCost]) -> StageCost:
    """One stage's cost from those of the model chunks it runs (an interleaved plan): every field summed, the
    boundary bytes the largest chunk's (transfers are priced per chunk, see
    :func:`whale.planner.steptime.simulate.predict`)."""
    if len(chunks) == 1:
        return chunks[0]
    total = {f: sum(getattr(c, f) for c in chunks) for f in StageCost.__dataclass_fields__}
    return StageCost(**{**total, "boundary_bytes": max(c.boundary_bytes for c in chunks)})


def compute(plan: Plan, groups: list[list[StageCost]], rows, factor, calib: Calibration, options: MemoryOptions,
            cluster=None) -> tuple[list, list, list[list[tuple[float, float]]]]:
    """``(fwd, bwd, shares)`` of every micro-batch on every rank.

    Args:
        groups: per stage, the costs of the model chunks it runs in model order (one entry for a stage that is one
            chunk, or one cost for the whole stage); each chunk is one segment (:func:`segment_seconds`).
        rows: ``[stage][lane][micro-batch]`` samples.
        factor: per global rank, seconds there per measured second.

    Returns:
        fwd, bwd: ``[stage][lane][micro-batch]`` seconds through all of the stage's chunks (a split stage's
        collectives added, its lanes in lockstep); shares: ``[stage][local chunk]`` (forward, backward) share of
        the stage's seconds each chunk takes (on lane 0's first micro-batch), as
        :func:`whale.plan.schedule_sim.simulate_lanes` takes ``chunk_shares``.
    """
    fwd, bwd, shares = [], [], []
    ranks = plan.world_size if cluster is None or cluster.emulate else 0
    for s, chunks in enumerate(groups):
        f_s, b_s = [], []
        calls = [_zero3_calls(plan, s, st, rows[s]) for st in chunks]
        for lane, mbs in enumerate(rows[s]):
            k = factor[plan.rank_of(s, lane)]
            per = [[segment_seconds(st, r, k, calib, options.activation_checkpoint, c, ranks)
                    for st, c in zip(chunks, calls, strict=True)] for r in mbs]
            f_s.append([sum(f for f, _ in t) for t in per])
            b_s.append([sum(b for _, b in t) for t in per])
            if lane == 0:
                shares.append(_shares(per[0]))
        if any(tg.has_split for tg in plan.stage_task_graphs(s)):
            f_s, b_s = _lockstep(f_s, plan.width_of(s)), _lockstep(b_s, plan.width_of(s))
            _add_split_comm(plan, s, merge(chunks), rows[s], f_s, b_s, cluster, calib, factor)
        fwd.append(f_s)
        bwd.append(b_s)
    return fwd, bwd, shares


def _shares(times: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each chunk's (forward, backward) share of its stage from its ``(forward, backward)`` seconds (equal
    shares where a column is all zero)."""
    tf, tb = sum(f for f, _ in times), sum(b for _, b in times)
    even = 1.0 / len(times)
    return [(f / tf if tf > 0 else even, b / tb if tb > 0 else even) for f, b in times]


def _zero3_calls(plan: Plan, s: int, st: StageCost, lanes_rows: list[list[int]]) -> tuple[int, int]:
    """ZeRO-3's collective calls per segment of stage ``s`` (:func:`whale.planner.steptime.cost.zero3_collective_calls`;
    the lanes' shares are even when every lane holds as many rows)."""
    if plan.zero < 3 or st.zero3_units == 0:
        return 0, 0
    even = len({sum(r) for r in lanes_rows}) == 1
    return cost.zero3_collective_calls(st.zero3_units, plan.lanes_of(s), even)


def _lockstep(times: list[list[float]], width: int) -> list[list[float]]:
    """A split stage's lanes of one replica meet in the split layers' collectives every micro-batch: each runs
    at the pace of the slowest of its ``width`` lanes."""
    out = []
    for lane in range(len(times)):
        group = times[lane - lane % width: lane - lane % width + width]
        out.append([max(col) for col in zip(*group, strict=True)])
    return out


def zero3_gathers(plan: Plan, stages: list[StageCost], fwd, bwd, cluster, calib, factor) -> float:
    """ZeRO-3: add one all-gather of the stage's parameters to every forward and backward (in place): a wait off
    the CPU, which under emulation the stretch absorbs (``max(stretched, CPU seconds + gather)``, as split
    collectives); returns the seconds one rank spends in them per step (the most over stages)."""
    worst, emulated = 0.0, cluster is not None and cluster.emulate
    for s, st in enumerate(stages):
        n = plan.lanes_of(s)
        if plan.zero < 3 or n < 2:
            continue
        bw, lat = link(cluster, calib, plan.stage_ranks(s), "allreduce")
        g = cost.ring_allgather_time(4.0 * st.trainable_elements, n, bw, lat)
        for arr in (fwd[s], bwd[s]):
            for lane, times in enumerate(arr):
                k = factor[plan.rank_of(s, lane)]
                times[:] = [max(t, t / k + g) if emulated else t + g for t in times]
        worst = max(worst, 2 * g * plan.num_micro_batch)
    return worst
