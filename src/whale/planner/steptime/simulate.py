"""Whole-step time model: a plan's step simulated event by event, on a cluster, from calibrated stage costs.

:func:`predict` is a pure function of a :class:`~whale.plan.plan.Plan`, per-stage or per-chunk costs
(:class:`StageCost`, measured seconds on the calibration machine, see :mod:`whale.frontend.simcost`), a cluster
spec and a :class:`~whale.planner.calibration_cache.Calibration`. It returns a :class:`Prediction`: step seconds,
per stage the forward/backward seconds of one micro-batch, per rank busy and idle seconds, communication seconds by
kind and (given the stages' memory) per-rank peak bytes from :func:`whale.planner.memory.plan_memory`.

The step, as the runtime runs it:

1. the schedule (GPipe/1F1B/ZB-H1/interleaved 1F1B, :func:`whale.plan.schedule_chunks.schedule_for`) over every
   (stage, lane) rank (:func:`whale.plan.schedule_sim.simulate_lanes`): compute =
   :func:`whale.planner.steptime.segments.segment_seconds` per model chunk (a split stage's lanes at the pace of
   their replica's slowest, plus its collectives), an interleaved stage's chunks summed and each chunk's share
   passed as ``chunk_shares``; transfers = :func:`whale.planner.steptime.cost.p2p_time` between chunks on
   different stages (hand-offs on one stage are free); ZeRO-3 all-gathers before every segment;
2. data-parallel gradient sync overlapped with the last backward: buckets (1 MiB, then 25 MiB) ready in turn
   and reduced in order (:func:`whale.planner.steptime.cost.bucketed_allreduce_finish`; ZeRO-2/3 reduce-scatter);
3. the optimizer step on the rank's share (after offload's copies), then ZeRO's all-gather of the parameters.

Speed factors and links: :mod:`whale.planner.steptime.segments`. On a real cluster the optimizer is a
memory-bound pass (28 bytes per element over HBM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from whale.cluster import ClusterSpec
from whale.plan.plan import Plan
from whale.plan.schedule_chunks import schedule_for
from whale.plan.schedule_sim import simulate_lanes
from whale.planner.calibration_cache import Calibration
from whale.planner.memory import MemoryOptions, StageMemory, plan_memory
from whale.planner.memory_types import merge_chunks
from whale.planner.steptime import cost
from whale.planner.steptime.memory_time import PCIE_BANDWIDTH
from whale.planner.steptime.segments import (
    StageCost,
    compute,
    link,
    merge,
    segment_seconds,
    speed_factors,
    zero3_gathers,
)

__all__ = ["Prediction", "StageCost", "link", "options_of", "predict", "segment_seconds", "speed_factors",
           "update_seconds"]

FIRST_BUCKET, BUCKET = 2**20, 25 * 2**20
"""Gradient bucket caps, bytes (:class:`whale.parallel.data.GradientSync` defaults)."""
LOCAL_COPY_BANDWIDTH = 5e9
"""bytes/s of a "device <-> host" copy under emulation (both are CPU memory: a memcpy)."""
ADAM_BYTES_PER_ELEMENT = 28
"""Bytes AdamW moves per parameter element on a GPU: reads param, grad, 2 moments; writes param, 2 moments (fp32)."""


@dataclass(frozen=True)
class Prediction:
    """The predicted step. Seconds and bytes; ranks are global ranks.

    Attributes:
        step: seconds per step (the last rank to finish its optimizer step).
        schedule: seconds of the forward/backward schedule alone (the runtime's ``schedule_time``).
        stage_fwd, stage_bwd: per stage, seconds of one micro-batch's forward / backward on its slowest lane.
        rank_busy, rank_idle: per rank, compute seconds and the rest of the step.
        comm: seconds by kind (``p2p`` per transfer summed over a lane's path, ``allreduce``/``reduce_scatter``
            exposed after the last backward on the slowest group, ``allgather`` (ZeRO), ``offload``).
        optimizer: per rank, optimizer-step seconds.
        peak_bytes: per rank, predicted peak device bytes (empty without stage memories).
        timeline: ``(rank, kind, label, start, end)`` boxes: kind ``F``, ``B``, ``sync``, ``optim``.
        emulated: the cluster was emulated (compute stretched, communication local gloo).
    """

    step: float
    schedule: float
    stage_fwd: tuple[float, ...]
    stage_bwd: tuple[float, ...]
    rank_busy: tuple[float, ...]
    rank_idle: tuple[float, ...]
    comm: dict[str, float] = field(default_factory=dict)
    optimizer: tuple[float, ...] = ()
    peak_bytes: tuple[float, ...] = ()
    timeline: tuple[tuple, ...] = ()
    emulated: bool = False

    def to_dict(self) -> dict:
        """JSON-ready dict (the timeline left out)."""
        return {"step_s": self.step, "schedule_s": self.schedule, "stage_fwd_s": list(self.stage_fwd),
                "stage_bwd_s": list(self.stage_bwd), "rank_busy_s": list(self.rank_busy),
                "rank_idle_s": list(self.rank_idle), "comm_s": dict(self.comm), "optimizer_s": list(self.optimizer),
                "peak_bytes": list(self.peak_bytes), "emulated": self.emulated}


def _rows(plan: Plan, global_batch: int) -> list[list[list[int]]]:
    """``[stage][lane][micro-batch]`` rows."""
    return [[[b - a for a, b in lane] for lane in plan.micro_batch_rows(global_batch, s)]
            for s in range(plan.num_stages)]


def _crossings(plan: Plan, stages: list[StageCost]) -> list[list[tuple[float, int]]]:
    """Per stage, ``(bytes per sample, stage sent to)`` of every hand-off from one of its model chunks to the next
    chunk on another stage (an interleaved plan's wrap-around included; hand-offs on one stage are free). With one
    cost per stage (``len(stages) == num_stages``) each such hand-off sends the stage's ``boundary_bytes``."""
    per_chunk, last = len(stages) == plan.num_chunks, plan.num_chunks - 1
    return [[(stages[c if per_chunk else s].boundary_bytes, plan.position_of(c + 1)) for c in plan.chunks_of(s)
             if c < last and plan.position_of(c + 1) != s] for s in range(plan.num_stages)]


def _transfers(plan: Plan, crossings: list[list[tuple[float, int]]], rows, cluster,
               calib: Calibration) -> list[list[float]]:
    """``[stage][lane]`` seconds of one transfer (largest micro-batch) out of that rank: the slowest of its
    stage's ``crossings`` (:func:`_crossings`), :func:`whale.planner.steptime.cost.p2p_time` over the link to the
    receiving stage's rank of the same lane (its last lane when it has fewer); 0 without a crossing."""
    out = []
    for s, sends in enumerate(crossings):
        row = []
        for lane, mbs in enumerate(rows[s]):
            a, t = plan.rank_of(s, lane), 0.0
            for nbytes, to in sends:
                bw, lat = link(cluster, calib, [a, plan.rank_of(to, min(lane, plan.lanes_of(to) - 1))], "p2p")
                t = max(t, cost.p2p_time(max(mbs) * nbytes, bw, lat))
            row.append(t)
        out.append(row)
    return out


def _peers(plan: Plan) -> list[list[list[int]]] | None:
    """Lanes of stage + 1 each lane exchanges rows with: the same lane on stages of one width, every lane
    otherwise (the batch bridge; an upper bound on the waits)."""
    if plan.uniform_width:
        return None
    return [[list(range(plan.lanes_of(s + 1))) if s + 1 < plan.num_stages else [] for _ in range(plan.lanes_of(s))]
            for s in range(plan.num_stages)]


def _buckets(nbytes: float) -> list[float]:
    """Gradient bucket sizes, bytes, in reduction order (first bucket capped at 1 MiB)."""
    out, left, cap = [], nbytes, FIRST_BUCKET
    while left > 0:
        out.append(min(cap, left))
        left -= out[-1]
        cap = BUCKET
    return out


def options_of(plan: Plan) -> MemoryOptions:
    """The memory techniques a plan runs with."""
    return MemoryOptions(bool(plan.activation_checkpoint), plan.zero, plan.offload)


def _grad_sync(plan: Plan, s: int, st: StageCost, last_b: list[tuple[float, float]], cluster, calib) -> float:
    """When stage ``s``'s gradient sync ends (every lane), given each lane's last backward ``(start, end)``."""
    n, done = plan.lanes_of(s), max(e for _, e in last_b)
    if n < 2 or st.trainable_elements == 0:
        return done
    nbytes = 4.0 * st.trainable_elements
    bw, lat = link(cluster, calib, plan.stage_ranks(s), "allreduce")
    if plan.zero >= 2:  # gradients reduce-scattered once backward is done
        return done + cost.ring_reduce_scatter_time(nbytes, n, bw, lat)
    sizes, ready, acc = _buckets(nbytes), [], 0.0
    for size in sizes:  # bucket k is complete once the last backward has produced its share of the gradients
        acc += size
        ready.append(max(a + acc / nbytes * (e - a) for a, e in last_b))
    return max(done, cost.bucketed_allreduce_finish(ready, sizes, n, bw, lat))


def _update(plan: Plan, s: int, lane: int, st: StageCost, cluster, calib: Calibration) -> dict[str, float]:
    """Seconds after the gradient sync on one rank: offload copies, the optimizer step, ZeRO's parameter
    all-gather."""
    local = cluster is None or cluster.emulate
    bw, lat = link(cluster, calib, plan.stage_ranks(s), "allreduce")
    mem_bw = 0.0 if local else cluster.devices()[plan.rank_of(s, lane)].mem_bandwidth
    return update_seconds(st.trainable_elements, plan.lanes_of(s), plan.zero, plan.offload, calib, mem_bw, bw, lat)


def update_seconds(elements: float, lanes: int, zero: int, offload: str, calib: Calibration, mem_bandwidth: float,
                   bandwidth: float, latency: float) -> dict[str, float]:
    """Seconds of one rank's work after the gradient sync of a stage with ``elements`` trainable parameter
    elements over ``lanes`` data-parallel lanes: ``offload`` (device -> host copies of 8 bytes per element of
    the rank's share, plus the parameters under ``"optimizer+params"``), ``optim`` (AdamW on the rank's share,
    ZeRO >= 1 shards it: measured seconds per element on the host or under emulation, else
    :data:`ADAM_BYTES_PER_ELEMENT` over ``mem_bandwidth`` bytes/s) and ``allgather`` (ZeRO's gather of the
    updated fp32 parameters over a ring of ``bandwidth`` bytes/s, ``latency`` s per step).
    ``mem_bandwidth`` = 0 means local (the calibration machine or an emulated cluster)."""
    e = float(elements)
    mine = e / lanes if zero >= 1 else e
    local = mem_bandwidth <= 0
    out = {"offload": 0.0, "optim": 0.0, "allgather": 0.0}
    if offload != "none":
        moved = 8 * mine + (8 * e if offload == "optimizer+params" else 0.0)
        out["offload"] = cost.offload_time(moved, LOCAL_COPY_BANDWIDTH if local else PCIE_BANDWIDTH)
    if local or offload != "none":
        out["optim"] = mine * calib.optimizer_seconds_per_element
    else:
        out["optim"] = ADAM_BYTES_PER_ELEMENT * mine / mem_bandwidth
    if zero >= 1 and lanes > 1:
        out["allgather"] = cost.ring_allgather_time(4 * e, lanes, bandwidth, latency)
    return out


def predict(plan: Plan, stages: list[StageCost], cluster: ClusterSpec | None, calib: Calibration,
            global_batch: int, memory: list[StageMemory] | None = None, cores: float = 1.0,
            factors: list[float] | None = None) -> Prediction:
    """Predicted step of ``plan`` on ``cluster`` at ``global_batch`` samples (see the module docstring).

    Args:
        stages: one :class:`StageCost` per pipeline stage, or per model chunk (``plan.num_chunks``, in model order:
            an interleaved plan's stage cuts, chunk c on stage ``plan.position_of(c)``); a stage's chunks are
            summed and each one's share of its stage's time goes to the schedule simulation.
        cluster: the cluster (``None``: the calibration machine itself, one thread per rank).
        calib: measured costs (:mod:`whale.planner.calibration_cache`).
        memory: per stage or per model chunk (as ``stages``), :class:`whale.planner.memory.StageMemory` for the
            per-rank peak bytes (optional; a stage's chunks merged by
            :func:`whale.planner.memory_types.merge_chunks`).
        cores: CPU cores the emulated ranks share (emulated clusters only).
        factors: per rank, seconds there per measured second, overriding :func:`speed_factors` (e.g. an
            emulated run's actual ``1 + engine.slowdown``, which the runtime calibrates to each core's speed).

    Raises:
        ValueError: ``stages`` (or ``memory``) does not hold one entry per stage or per chunk; a cluster of
            another size.
        PlanError: the batch does not divide into the plan's micro-batches and lanes.
    """
    groups = _by_stage(plan, stages, "stage costs")
    merged = [merge(g) for g in groups]
    rows = _rows(plan, global_batch)
    factor = factors or speed_factors(cluster, calib, plan.world_size, cores, plan.precision)
    if len(factor) != plan.world_size:
        raise ValueError(f"factors has {len(factor)} entries for {plan.world_size} ranks; give one per rank")
    fwd, bwd, shares = compute(plan, groups, rows, factor, calib, options_of(plan), cluster)
    busy = [[sum(f) + sum(b) for f, b in zip(fs, bs, strict=True)] for fs, bs in zip(fwd, bwd, strict=True)]
    gathers = zero3_gathers(plan, merged, fwd, bwd, cluster, calib, factor)
    crossings = _crossings(plan, stages)
    comm = _transfers(plan, crossings, rows, cluster, calib)
    chunked = len(stages) == plan.num_chunks and plan.num_chunks > plan.num_stages
    sim = simulate_lanes(schedule_for(plan.schedule, plan.num_stages, plan.num_micro_batch, plan.virtual_stages,
                                      plan.chunk_positions), fwd, bwd, comm, _peers(plan),
                         chunk_shares=shares if chunked else None, positions=plan.chunk_positions or None)
    kinds = {"p2p": 2 * plan.num_micro_batch * max(sum(len(x) * c[min(j, len(c) - 1)] for x, c in
                                                       zip(crossings, comm, strict=True))
                                                   for j in range(plan.max_lanes)),
             "allreduce": 0.0, "allgather": gathers, "offload": 0.0}
    ends, optim, timeline = _after_schedule(plan, merged, sim, cluster, calib, kinds, gathers)
    timeline += [(plan.rank_of(s, lane), kind, f"{kind}{mb}", a, e) for s, lane, kind, mb, a, e in sim["events"]]
    kinds["optimizer"] = max(optim)
    if memory is not None:
        memory = [merge_chunks(g) for g in _by_stage(plan, memory, "stage memories")]
    return _prediction(plan, fwd, bwd, busy, sim, (ends, optim), kinds, timeline, memory, global_batch, cluster)


def _by_stage(plan: Plan, items: list, what: str) -> list[list]:
    """Per stage, its entries of ``items``: one per stage as given, or one per model chunk grouped by
    :meth:`whale.plan.plan.Plan.chunks_of` (model order).

    Raises:
        ValueError: neither one entry per stage nor one per chunk."""
    if len(items) == plan.num_stages:
        return [[x] for x in items]
    if len(items) == plan.num_chunks:
        return [[items[c] for c in plan.chunks_of(s)] for s in range(plan.num_stages)]
    raise ValueError(f"predict got {len(items)} {what} for {plan.num_stages} stages ({plan.num_chunks} model "
                     "chunks); give one per stage or one per chunk")


def _after_schedule(plan: Plan, merged: list[StageCost], sim: dict, cluster, calib: Calibration, kinds: dict,
                    gathers: float) -> tuple[list[float], list[float], list[tuple]]:
    """Per rank, when its step ends and its optimizer seconds, and the ``sync``/``optim`` timeline boxes: each
    stage's gradient sync after its last backwards, then every lane's update (:func:`_update`); fills
    ``kinds``' ``allreduce``, ``offload`` and ``allgather`` seconds in place."""
    last_b: dict[tuple[int, int], tuple[float, float]] = {}
    for s, lane, kind, _, a, e in sim["events"]:
        if kind.startswith("B"):
            last_b[(s, lane)] = (a, e)
    ends, optim, timeline = [0.0] * plan.world_size, [0.0] * plan.world_size, []
    for s, st in enumerate(merged):
        sync = _grad_sync(plan, s, st, [last_b[(s, j)] for j in range(plan.lanes_of(s))], cluster, calib)
        kinds["allreduce"] = max(kinds["allreduce"], sync - max(sim["end"][s]))
        for lane in range(plan.lanes_of(s)):
            r, up = plan.rank_of(s, lane), _update(plan, s, lane, st, cluster, calib)
            t = max(sync, sim["end"][s][lane])
            timeline.append((r, "sync", "sync", max(sim["end"][s]), t))  # before it: waiting for the other lanes
            timeline.append((r, "optim", "optim", t, t + up["offload"] + up["optim"]))
            ends[r], optim[r] = t + sum(up.values()) + calib.step_overhead, up["optim"]
            kinds["offload"] = max(kinds["offload"], up["offload"])
            kinds["allgather"] = max(kinds["allgather"], gathers + up["allgather"])
    return ends, optim, timeline


def _prediction(plan, fwd, bwd, busy, sim, ends_optim, kinds, timeline, memory, global_batch, cluster) -> Prediction:
    """Assemble the :class:`Prediction` (per-stage slowest lane, per-rank busy/idle, memory)."""
    ends, optim = ends_optim
    step = max(ends)
    rank_busy = [0.0] * plan.world_size
    for s in range(plan.num_stages):
        for lane in range(plan.lanes_of(s)):
            rank_busy[plan.rank_of(s, lane)] = busy[s][lane]
    peak: tuple[float, ...] = ()
    if memory is not None:
        if len(memory) != plan.num_stages:
            raise ValueError(f"predict got {len(memory)} stage memories for {plan.num_stages} stages")
        peak = tuple(m.device_total for m in plan_memory(plan, memory, global_batch, options_of(plan)))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return Prediction(
        step=step, schedule=max(max(e) for e in sim["end"]),
        stage_fwd=tuple(max(mean(f) for f in fs) for fs in fwd),
        stage_bwd=tuple(max(mean(b) for b in bs) for bs in bwd),
        rank_busy=tuple(rank_busy), rank_idle=tuple(step - b for b in rank_busy), comm=kinds,
        optimizer=tuple(optim), peak_bytes=peak, timeline=tuple(timeline),
        emulated=bool(cluster is not None and cluster.emulate))
