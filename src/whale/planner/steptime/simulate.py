"""Whole-step time model: a plan's step simulated event by event, on a cluster, from calibrated stage costs.

:func:`predict` is a pure function of a :class:`~whale.plan.plan.Plan`, per-stage costs (:class:`StageCost`,
measured seconds on the calibration machine, see :mod:`whale.frontend.simcost`), a cluster spec and a
:class:`~whale.planner.calibration_cache.Calibration`. It returns a :class:`Prediction`: step seconds, per stage the
forward/backward seconds of one micro-batch, per rank busy and idle seconds, communication seconds by kind and
(given the stages' memory) per-rank peak bytes from :func:`whale.planner.memory.plan_memory`.

The step, as the runtime runs it:

1. the schedule (1F1B/GPipe) over every (stage, lane) rank (:func:`whale.plan.schedule_sim.simulate_lanes`):
   compute = :func:`segment_seconds` (a split stage's lanes at the pace of their replica's slowest, plus its
   collectives); transfers = :func:`whale.planner.steptime.cost.p2p_time`; ZeRO-3 all-gathers before every segment;
2. data-parallel gradient sync overlapped with the last backward: buckets (1 MiB, then 25 MiB) ready in turn
   and reduced in order (:func:`whale.planner.steptime.cost.bucketed_allreduce_finish`; ZeRO-2/3 reduce-scatter);
3. the optimizer step on the rank's share (after offload's copies), then ZeRO's all-gather of the parameters.

Speed factor of a rank (seconds there per measured second here): under emulation (``cluster.emulate``) what
:mod:`whale.runtime.emulation` stretches compute to, ``max(1, world/cores) x s_max/s_i``; communication there is
real gloo on localhost, so it costs the calibration's measured local latency and bandwidth, not the declared
links. On a real cluster: ``1 / (best measured seconds per FLOP x peak FLOP/s x gpu_efficiency)`` (per-type
efficiency relative to the best type as measured here), the declared links' bandwidth and latency, and the
optimizer as a memory-bound pass (28 bytes per element over HBM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from whale.cluster import ClusterSpec, emulation_delays
from whale.plan.plan import Plan
from whale.plan.schedule_chunks import schedule_for
from whale.plan.schedule_sim import simulate_lanes
from whale.planner.calibration_cache import Calibration
from whale.planner.memory import MemoryOptions, StageMemory, plan_memory
from whale.planner.steptime import cost
from whale.planner.steptime.memory_time import PCIE_BANDWIDTH

FIRST_BUCKET, BUCKET = 2**20, 25 * 2**20
"""Gradient bucket caps, bytes (:class:`whale.parallel.data.GradientSync` defaults)."""
LOCAL_COPY_BANDWIDTH = 5e9
"""bytes/s of a "device <-> host" copy under emulation (both are CPU memory: a memcpy)."""
ADAM_BYTES_PER_ELEMENT = 28
"""Bytes AdamW moves per parameter element on a GPU: reads param, grad, 2 moments; writes param, 2 moments (fp32)."""


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


def _rows(plan: Plan, global_batch: int) -> list[list[list[int]]]:
    """``[stage][lane][micro-batch]`` rows."""
    return [[[b - a for a, b in lane] for lane in plan.micro_batch_rows(global_batch, s)]
            for s in range(plan.num_stages)]


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


def _compute(plan: Plan, stages: list[StageCost], rows, factor, calib: Calibration, options: MemoryOptions,
             cluster=None):
    """``(fwd, bwd)`` seconds ``[stage][lane][micro-batch]``."""
    fwd, bwd = [], []
    ranks = plan.world_size if cluster is None or cluster.emulate else 0
    for s, st in enumerate(stages):
        f_s, b_s = [], []
        calls = _zero3_calls(plan, s, st, rows[s])
        for lane, mbs in enumerate(rows[s]):
            k = factor[plan.rank_of(s, lane)]
            times = [segment_seconds(st, r, k, calib, options.activation_checkpoint, calls, ranks) for r in mbs]
            f_s.append([f for f, _ in times])
            b_s.append([b for _, b in times])
        if any(tg.has_split for tg in plan.stage_task_graphs(s)):
            f_s, b_s = _lockstep(f_s, plan.width_of(s)), _lockstep(b_s, plan.width_of(s))
            _add_split_comm(plan, s, st, rows[s], f_s, b_s, cluster, calib, factor)
        fwd.append(f_s)
        bwd.append(b_s)
    return fwd, bwd


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


def _transfers(plan: Plan, stages: list[StageCost], rows, cluster, calib: Calibration) -> list[list[float]]:
    """``[stage][lane]`` seconds of one boundary transfer (largest micro-batch) to stage + 1."""
    out = []
    for s, st in enumerate(stages):
        row = []
        for lane, mbs in enumerate(rows[s]):
            if s == len(stages) - 1:
                row.append(0.0)
                continue
            a = plan.rank_of(s, lane)
            b = plan.rank_of(s + 1, min(lane, plan.lanes_of(s + 1) - 1))
            bw, lat = link(cluster, calib, [a, b], "p2p")
            row.append(cost.p2p_time(max(mbs) * st.boundary_bytes, bw, lat))
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


def _zero3_gathers(plan: Plan, stages: list[StageCost], fwd, bwd, cluster, calib, factor) -> float:
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


def predict(plan: Plan, stages: list[StageCost], cluster: ClusterSpec | None, calib: Calibration,
            global_batch: int, memory: list[StageMemory] | None = None, cores: float = 1.0,
            factors: list[float] | None = None) -> Prediction:
    """Predicted step of ``plan`` on ``cluster`` at ``global_batch`` samples (see the module docstring).

    Args:
        stages: one :class:`StageCost` per pipeline stage.
        cluster: the cluster (``None``: the calibration machine itself, one thread per rank).
        calib: measured costs (:mod:`whale.planner.calibration_cache`).
        memory: per stage, :class:`whale.planner.memory.StageMemory` for the per-rank peak bytes (optional).
        cores: CPU cores the emulated ranks share (emulated clusters only).
        factors: per rank, seconds there per measured second, overriding :func:`speed_factors` (e.g. an
            emulated run's actual ``1 + engine.slowdown``, which the runtime calibrates to each core's speed).

    Raises:
        ValueError: ``stages`` (or ``memory``) does not hold one entry per stage; a cluster of another size.
        PlanError: the batch does not divide into the plan's micro-batches and lanes.
    """
    if len(stages) != plan.num_stages:
        raise ValueError(f"predict got {len(stages)} stage costs for {plan.num_stages} stages; give one per stage")
    rows = _rows(plan, global_batch)
    factor = factors or speed_factors(cluster, calib, plan.world_size, cores, plan.precision)
    if len(factor) != plan.world_size:
        raise ValueError(f"factors has {len(factor)} entries for {plan.world_size} ranks; give one per rank")
    fwd, bwd = _compute(plan, stages, rows, factor, calib, options_of(plan), cluster)
    busy = [[sum(f) + sum(b) for f, b in zip(fs, bs, strict=True)] for fs, bs in zip(fwd, bwd, strict=True)]
    gathers = _zero3_gathers(plan, stages, fwd, bwd, cluster, calib, factor)
    comm = _transfers(plan, stages, rows, cluster, calib)
    sim = simulate_lanes(schedule_for(plan.schedule, plan.num_stages, plan.num_micro_batch, plan.virtual_stages,
                                      plan.chunk_positions), fwd, bwd, comm, _peers(plan),
                         positions=plan.chunk_positions or None)
    last_b: dict[tuple[int, int], tuple[float, float]] = {}
    for s, lane, kind, _, a, e in sim["events"]:
        if kind == "B":
            last_b[(s, lane)] = (a, e)
    ends, optim, timeline = [0.0] * plan.world_size, [0.0] * plan.world_size, []
    kinds = {"p2p": 2 * plan.num_micro_batch * max(sum(c[min(j, len(c) - 1)] for c in comm)
                                                   for j in range(plan.max_lanes)),
             "allreduce": 0.0, "allgather": gathers, "offload": 0.0}
    for s, st in enumerate(stages):
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
    timeline += [(plan.rank_of(s, lane), kind, f"{kind}{mb}", a, e) for s, lane, kind, mb, a, e in sim["events"]]
    kinds["optimizer"] = max(optim)
    return _prediction(plan, fwd, bwd, busy, sim, (ends, optim), kinds, timeline, memory, global_batch, cluster)


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
