"""The default estimator of the search: predicted step seconds and per-device peak bytes of a
:class:`whale.planner.search.Candidate`, from the cost model (:mod:`whale.planner.steptime.cost`), the event simulator
(:func:`whale.plan.schedule_sim.simulate`) and the memory model (:mod:`whale.planner.memory`). Formulas live there;
this module only decides what each device of a candidate does.

Per stage s (layers ``stage_layers[s]``) on ``d`` lanes of ``t`` devices, a micro-batch of R = B / m rows:

- rows: each lane gets rows in proportion to its speed (hardware-aware shares, the Whale paper's §3.3; the
  exact integer shares are :mod:`whale.planner.balance`'s), so every lane computes a micro-batch in
  R x F / (sum of the stage's FLOP/s x efficiency), F the stage's FLOPs per sample on one device: split layers
  (dense, attention, MoE) count F / t, the others (embeddings, head) whole on every device of a split group;
- split communication per micro-batch: a dense or attention layer all-reduces its output forward and its
  input gradient backward over the t devices (Megatron-LM); an MoE layer sends every token to ``top_k``
  experts and back (dispatch + combine), forward and backward, as all-to-alls: each device sends (t-1)/t of
  its bytes, which costs what a ring all-gather of the same bytes costs (:func:`ring_allgather_time`);
- the pipeline: stage forward/backward seconds per micro-batch (backward = training minus forward FLOPs, plus
  the forward again under activation checkpointing) and the point-to-point send of a stage's output, through
  the schedule's event simulation;
- after the last micro-batch, per stage: the gradient all-reduce over the d lanes
  (:func:`ring_allreduce_time`), the optimizer step (32 bytes of device memory traffic per element: read
  parameter, gradient and two moments, write three) and what the memory options add
  (:func:`whale.planner.steptime.memory_time.technique_seconds`); the step ends when the slowest stage is done
  (no overlap);
- memory: :func:`whale.planner.memory.rank_memory` of the stage's per-device share (split layers' parameters
  and activations / t), the lane's rows and the schedule's micro-batches in flight.

Links: a group that fits in one node (``devices_per_node``) uses the nodes' slowest intra-node link, else the
inter-node link; every message pays ``latency`` seconds per step of its algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from whale.cluster import ClusterSpec, DeviceType, memory_capacity
from whale.memory.host import host_memory_capacity
from whale.plan.schedule import in_flight_micro_batches, make_schedule
from whale.plan.schedule_sim import simulate
from whale.plan.shares import proportional_shares
from whale.planner.memory import MemoryOptions, StageMemory, rank_memory
from whale.planner.model_desc import ModelDesc
from whale.planner.partition import partition_layers, uniform_partition
from whale.planner.search import Bound, Candidate, Constraints, Estimate, enumerate_candidates, search
from whale.planner.steptime.cost import compute_time, p2p_time, ring_allgather_time, ring_allreduce_time
from whale.planner.steptime.memory_time import HOST_MEMORY_BANDWIDTH, PCIE_BANDWIDTH, technique_seconds

DEFAULT_LATENCY = 1e-5
"""Seconds per message step of a collective or a send when the cluster spec gives none (NCCL-class, ~10 us)."""
OPTIMIZER_BYTES_PER_ELEMENT = 32.0
"""Device memory traffic of one AdamW update per parameter element, bytes (7 fp32 accesses, rounded up)."""


@dataclass(frozen=True)
class DevicePool:
    """The devices a search places work on, by type: counts, capacities, links.

    Attributes:
        types: distinct device types; counts: devices of each.
        capacity / host_capacity: bytes of device memory / host memory per device of each type.
        devices_per_node: the smallest node's device count (a group up to this size shares a node).
        intra_bandwidth / inter_bandwidth: bytes/s within a node (the slowest node's) and between nodes.
        latency: seconds per message step.
        efficiency: achieved fraction of peak FLOP/s per type (calibrated elsewhere; 1.0 = datasheet peak).
        dtype: ``"fp32"`` or ``"bf16"`` (which peak counts).
        rank_types: the type index of every rank in rank order (empty: unknown).
    """

    types: tuple[DeviceType, ...]
    counts: tuple[int, ...]
    capacity: tuple[float, ...]
    host_capacity: tuple[float, ...]
    devices_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    latency: float = 0.0
    efficiency: tuple[float, ...] = ()
    dtype: str = "fp32"
    rank_types: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """Number of devices."""
        return sum(self.counts)

    def speed(self, k: int) -> float:
        """Achieved FLOP/s of one device of type k."""
        eff = self.efficiency[k] if self.efficiency else 1.0
        return self.types[k].flops(self.dtype) * eff


def pool_from_cluster(spec: ClusterSpec, dtype: str = "fp32", latency: float = DEFAULT_LATENCY) -> DevicePool:
    """A :class:`DevicePool` of a cluster spec (capacities as :func:`whale.cluster.memory_capacity` and
    :func:`whale.memory.host.host_memory_capacity` give them, so emulated scales apply); ``latency``: seconds per
    message step (the spec has no latency field yet)."""
    devs = spec.devices()
    names = list(dict.fromkeys(d.name for d in devs))
    first = {n: next(r for r, d in enumerate(devs) if d.name == n) for n in names}
    return DevicePool(tuple(devs[first[n]] for n in names), tuple(sum(d.name == n for d in devs) for n in names),
                      tuple(memory_capacity(spec, first[n]) for n in names),
                      tuple(host_memory_capacity(spec, first[n]) for n in names),
                      min(len(n.devices) for n in spec.nodes), min(n.bandwidth() for n in spec.nodes),
                      spec.inter_node_bandwidth if len(spec.nodes) > 1 else min(n.bandwidth() for n in spec.nodes),
                      latency, (), dtype, tuple(names.index(d.name) for d in devs))


@dataclass(frozen=True)
class _Stage:
    """One stage's per-device costs at split degree t, per sample."""

    fwd: float          # forward FLOPs per sample on one device
    train: float        # forward + backward FLOPs
    elements: float     # trainable parameter elements per device
    act: float          # activation bytes per sample per device
    ckpt_act: float     # kept with checkpointing (layer inputs)
    peak_layer: float   # largest layer's activation bytes per sample per device
    out: float          # bytes per sample sent to the next stage
    allreduce: float    # bytes per sample all-reduced per direction (dense/attention layers), summed
    alltoall: float     # bytes per sample through all-to-all per direction (MoE), summed


def _stage_memory(st: _Stage) -> StageMemory:
    """The memory model's view of one device of a stage (ZeRO-3 gathers the whole stage, as the runtime does in
    a pipeline; checkpointing keeps each layer's input and recomputes the largest layer at once)."""
    return StageMemory(trainable_elements=int(np.ceil(st.elements)), activation_bytes=st.act,
                       checkpointed_bytes=st.ckpt_act, backward_bytes=st.act,
                       checkpointed_backward_bytes=st.ckpt_act + st.peak_layer,
                       gather_elements=int(np.ceil(st.elements)), recompute_flops=st.fwd, train_flops=st.train)


class DefaultEstimator:
    """Estimator for :func:`whale.planner.search.search` (see the module docstring): ``est(c) -> Estimate``, with
    ``bound(c)`` (exact memory and a lower bound on the step: the bottleneck stage's m x (forward + backward)
    plus the post-step work) and ``monotone_options`` (checkpointing only adds seconds here, and offload does
    when the host path is slower per element than the device's optimizer step). Compute, links and the
    post-sync work go through ``_seconds``, ``_link`` and ``_update``, which
    :class:`whale.planner.steptime.calibrated.CalibratedEstimator` overrides with the measured costs."""

    def __init__(self, model: ModelDesc, pool: DevicePool, global_batch: int, cross_nodes: bool = False) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch} must be >= 1")
        self.model, self.pool, self.batch, self.cross_nodes = model, pool, global_batch, cross_nodes
        host_path = 8 / PCIE_BANDWIDTH + 32 / HOST_MEMORY_BANDWIDTH  # seconds per element, technique_seconds
        slower = all(OPTIMIZER_BYTES_PER_ELEMENT / t.mem_bandwidth <= host_path for t in pool.types)
        self.monotone_options = ("activation_checkpoint",) + (("offload",) if slower else ())
        L = model.layers
        arr = lambda f: np.concatenate([[0.0], np.cumsum([float(f(x)) for x in L])])  # noqa: E731
        self._cum = {k: arr(f) for k, f in {
            "fwd_s": lambda x: x.forward_flops * x.splittable, "fwd_o": lambda x: x.forward_flops * (not x.splittable),
            "tr_s": lambda x: x.flops * x.splittable, "tr_o": lambda x: x.flops * (not x.splittable),
            "p_s": lambda x: x.params * x.splittable, "p_o": lambda x: x.params * (not x.splittable),
            "a_s": lambda x: x.activation_bytes * x.splittable,
            "a_o": lambda x: x.activation_bytes * (not x.splittable),
            "out": lambda x: x.output_bytes, "ar": lambda x: x.output_bytes * (x.kind in ("dense", "attention")),
            "a2a": lambda x: x.output_bytes * x.top_k * x.capacity_factor * (x.kind == "moe")}.items()}
        self._stage = lru_cache(maxsize=None)(self._stage_costs)
        self._sim = lru_cache(maxsize=None)(self._simulate)
        self._coef = lru_cache(maxsize=None)(self._coeffs)
        self._labels = lru_cache(maxsize=None)(self._labels_uncached)
        self._lane_rows = lru_cache(maxsize=None)(self._lane_rows_uncached)
        self._coef_cache = lru_cache(maxsize=None)(self._coef_arrays)
        self._rows_cache = lru_cache(maxsize=None)(self._rows_matrix)
        self._flight = lru_cache(maxsize=None)(self._flights)
        self._pipe_cache = lru_cache(maxsize=None)(self._pipe_uncached)
        self._post_cache = lru_cache(maxsize=None)(self._post_uncached)

    def split_ok(self, t: int) -> bool:
        """Every MoE layer's experts divide over t devices (or t divides them), ``t`` divides every layer's
        ``split_dims`` (heads, width, vocabulary), and a group of ``t`` stays inside one node
        (``devices_per_node % t == 0``) unless ``cross_nodes`` is set (then it is costed on the inter-node link)."""
        if not self.cross_nodes and (t > self.pool.devices_per_node or self.pool.devices_per_node % t):
            return False
        return all(x.experts % t == 0 or t % x.experts == 0 for x in self.model.layers if x.kind == "moe") and \
            all(n % t == 0 for x in self.model.layers if x.splittable for n in x.split_dims)

    def _stage_costs(self, a: int, b: int, t: int) -> _Stage:
        c = {k: v[b] - v[a] for k, v in self._cum.items()}
        peak = max(x.activation_bytes / (t if x.splittable else 1) for x in self.model.layers[a:b])
        ckpt = sum(x.output_bytes for x in self.model.layers[a:b])
        return _Stage(c["fwd_s"] / t + c["fwd_o"], c["tr_s"] / t + c["tr_o"], c["p_s"] / t + c["p_o"],
                      c["a_s"] / t + c["a_o"], ckpt, peak, self.model.layers[b - 1].output_bytes,
                      c["ar"], c["a2a"])

    def _bw(self, group: int) -> float:
        return self.pool.intra_bandwidth if group <= self.pool.devices_per_node else self.pool.inter_bandwidth

    def _lanes(self, c: Candidate, s: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """(stage FLOP/s, ((type, rows per micro-batch of one lane of that type), ...))."""
        return self._lane_rows(c.stage_devices[s], c.num_micro_batch, c.split)

    def _lane_rows_uncached(self, mix: tuple[int, ...], m: int, t: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """Whole rows per lane of one micro-batch, proportional to lane speed (largest remainder,
        :func:`whale.plan.shares.proportional_shares`); per type the most rows any of its lanes gets."""
        total = sum(n * self.pool.speed(k) for k, n in enumerate(mix))
        lanes = [k for k, n in enumerate(mix) for _ in range(n // t)]
        shares = proportional_shares(max(1, self.batch // m), [self.pool.speed(k) for k in lanes])
        most: dict[int, int] = {}
        for k, r in zip(lanes, shares, strict=True):
            most[k] = max(most.get(k, 0), r)
        return total, tuple(sorted(most.items()))

    def _pipe_costs(self, c: Candidate) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        """Forward and backward seconds per micro-batch per stage, and the p2p seconds per transfer."""
        return self._pipe_cache(c.stage_layers, c.stage_devices, c.split, c.data_parallel, c.num_micro_batch,
                                c.options.activation_checkpoint)

    def _pipe_uncached(self, layers: tuple, mix: tuple, t: int, d: int, m: int,
                       ckpt: bool) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        fwd, bwd, comm = [], [], 0.0
        edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
        for s in range(len(layers)):
            a, b = int(edges[s]), int(edges[s + 1])
            st = self._stage(a, b, t)
            _, lanes = self._lane_rows(mix[s], m, t)
            f, bw_ = max((self._seconds(a, b, t, k, r, ckpt) for k, r in lanes), key=lambda x: (sum(x), x))
            r_most = max(x[1] for x in lanes)
            split_comm = 0.0
            if t > 1:
                bw, lat = self._link(t, "allreduce")
                split_comm = ring_allreduce_time(r_most * st.allreduce, t, bw, lat) + \
                    2 * ring_allgather_time(r_most * st.alltoall, t, bw, lat)
            fwd.append(f + split_comm)
            bwd.append(bw_ + split_comm)
            if s < len(layers) - 1:
                bw, lat = self._link(2 * d * t, "p2p")
                comm = max(comm, p2p_time(r_most * st.out, bw, lat))
        return tuple(fwd), tuple(bwd), comm

    def _seconds(self, a: int, b: int, t: int, k: int, rows: float, ckpt: bool) -> tuple[float, float]:
        """``(forward, backward)`` compute seconds of one micro-batch of ``rows`` samples through layers
        ``[a, b)`` at split degree ``t`` on a device of type ``k``: FLOPs at the type's achieved speed
        (:func:`whale.planner.steptime.cost.compute_time`); backward adds the forward again under checkpointing."""
        st, speed = self._stage(a, b, t), self.pool.speed(k)
        recompute = st.fwd if ckpt else 0.0
        return compute_time(rows * st.fwd, speed), compute_time(rows * (st.train - st.fwd + recompute), speed)

    def _link(self, group: int, kind: str) -> tuple[float, float]:
        """``(bytes/s, seconds per message step)`` of a ``group`` of devices' collectives (``kind``
        ``"allreduce"``) or sends (``"p2p"``): the pool's intra- or inter-node link."""
        return self._bw(group), self.pool.latency

    def _update(self, elements: float, mix: tuple[int, ...], d: int, options: MemoryOptions, bw: float,
                lat: float) -> float:
        """Seconds of one device's optimizer step and memory techniques after the gradient sync of a stage
        of ``elements`` parameter elements per device on the device types ``mix``."""
        share = 1.0 / d if options.zero else 1.0
        mem_bw = min(self.pool.types[k].mem_bandwidth for k, n in enumerate(mix) if n)
        opt = 0.0 if options.offload != "none" else OPTIMIZER_BYTES_PER_ELEMENT * share * elements / mem_bw
        return opt + technique_seconds(elements, share, d, options, bw)

    def _post(self, c: Candidate) -> float:
        """Seconds after the pipeline drains: gradient sync, optimizer step, memory techniques; slowest stage."""
        return self._post_cache(c.stage_layers, c.stage_devices, c.split, c.data_parallel, c.options)

    def _post_uncached(self, layers: tuple, mix: tuple, t: int, d: int, options: MemoryOptions) -> float:
        worst = 0.0
        bw, lat = self._link(d * t, "allreduce")
        edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
        for s in range(len(layers)):
            st = self._stage(int(edges[s]), int(edges[s + 1]), t)
            sync = ring_allreduce_time(4 * st.elements, d, bw, lat) if d > 1 else 0.0
            worst = max(worst, sync + self._update(st.elements, mix[s], d, options, bw, lat))
        return worst

    def _simulate(self, sched: str, p: int, m: int, fwd: tuple, bwd: tuple, comm: float) -> float:
        return simulate(make_schedule(sched, p, m), list(fwd), list(bwd), comm)["step"]

    def _coeffs(self, a: int, b: int, t: int, d: int, options: MemoryOptions) -> tuple[float, float, float, float]:
        """``(fixed, per row in flight, per row once, host)`` bytes of one device of a stage, read off
        :func:`rank_memory` (affine in rows and rows x in-flight micro-batches), so a candidate's memory is a
        few multiply-adds per stage."""
        sm = _stage_memory(self._stage(a, b, t))
        one = lambda rows, flight: rank_memory(sm, rows, flight, 1.0 / d, options)  # noqa: E731
        base, r11, r12 = one(0, 1), one(1, 1).device_total, one(1, 2).device_total
        per_flight = r12 - r11
        return base.device_total, per_flight, r11 - base.device_total - per_flight, base.host

    def breakdown(self, c: Candidate, stage: int, rows: int) -> dict[str, float]:
        """Device bytes by category (:class:`whale.planner.memory.RankMemory`) of one device of ``stage`` holding
        ``rows`` rows per micro-batch."""
        a = int(sum(c.stage_layers[:stage]))
        sm = _stage_memory(self._stage(a, a + c.stage_layers[stage], c.split))
        flight = in_flight_micro_batches(stage, c.stages, c.num_micro_batch, c.schedule)
        rm = rank_memory(sm, rows, flight, 1.0 / c.data_parallel, c.options)
        return {**rm.device, "host": rm.host}

    def _labels_uncached(self, mix: tuple) -> tuple[str, ...]:
        return tuple(f"stage {s} {self.pool.types[k].name}" for s, m in enumerate(mix) for k, n in enumerate(m) if n)

    def memory(self, c: Candidate) -> Estimate:
        """Exact per-group peak memory of ``c`` (``step_seconds`` = inf)."""
        peak, cap, host, hcap = [], [], [], []
        a = 0
        for s, n_layers in enumerate(c.stage_layers):
            fixed, per_flight, once, h = self._coef(a, a + n_layers, c.split, c.data_parallel, c.options)
            a += n_layers
            flight = in_flight_micro_batches(s, c.stages, c.num_micro_batch, c.schedule)
            for k, rows in self._lanes(c, s)[1]:
                r = math.ceil(rows)
                peak.append(fixed + r * (flight * per_flight + once))
                cap.append(self.pool.capacity[k])
                host.append(h)
                hcap.append(self.pool.host_capacity[k])
        return Estimate(float("inf"), self._labels(c.stage_devices), tuple(peak), tuple(cap), tuple(host),
                        tuple(hcap))

    def _coef_arrays(self, layers: tuple[int, ...], t: int, d: int, options: MemoryOptions) -> np.ndarray:
        """[4, stages]: :meth:`_coeffs` of every stage of a cut."""
        edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
        return np.array([self._coef(int(edges[s]), int(edges[s + 1]), t, d, options) for s in range(len(layers))]).T

    def _rows_matrix(self, mix: tuple, m: int, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """[stages, types] rows of the fullest lane of each type (0 where absent), its presence mask, and the
        types' device and host capacities."""
        rows = np.zeros((len(mix), len(self.pool.types)))
        for s, stage in enumerate(mix):
            for k, r in self._lane_rows(stage, m, t)[1]:
                rows[s, k] = r
        present = np.array([[n > 0 for n in stage] for stage in mix])
        return rows, present, np.array(self.pool.capacity), np.array(self.pool.host_capacity)

    def overflow(self, c: Candidate) -> float:
        """Bytes by which the fullest device of ``c`` overflows its device or host memory (<= 0: fits); the
        same numbers as :meth:`memory`, vectorized over stages."""
        fixed, per_flight, once, host = self._coef_cache(c.stage_layers, c.split, c.data_parallel, c.options)
        flight = self._flight(c.stages, c.num_micro_batch, c.schedule)
        rows, present, cap, hcap = self._rows_cache(c.stage_devices, c.num_micro_batch, c.split)
        dev = fixed[:, None] + np.ceil(rows) * (flight * per_flight + once)[:, None] - cap[None, :]
        over = np.where(present, np.maximum(dev, host[:, None] - hcap[None, :]), -np.inf)
        return float(over.max())

    def _flights(self, p: int, m: int, sched: str) -> np.ndarray:
        return np.array([in_flight_micro_batches(s, p, m, sched) for s in range(p)], dtype=float)

    def bound(self, c: Candidate) -> Bound:
        """Exact memory overflow and a step-time lower bound (no simulation)."""
        over = self.overflow(c)
        if over > 0:
            return Bound(float("inf"), over)
        fwd, bwd, _ = self._pipe_costs(c)
        return Bound(c.num_micro_batch * max(f + b for f, b in zip(fwd, bwd, strict=True)) + self._post(c), over)

    def __call__(self, c: Candidate) -> Estimate:
        """Predicted step seconds (event simulation of the schedule + post-step work) and memory."""
        mem = self.memory(c)
        fwd, bwd, comm = self._pipe_costs(c)
        pipe = self._sim(c.schedule, c.stages, c.num_micro_batch, fwd, bwd, comm)
        post = self._post(c)
        detail = {"pipeline_seconds": pipe, "post_seconds": post, "stage_forward_seconds": fwd,
                  "stage_backward_seconds": bwd, "p2p_seconds": comm}
        return Estimate(pipe + post, mem.groups, mem.peak_bytes, mem.capacity, mem.host_bytes, mem.host_capacity,
                        detail)

    def cuts(self, p: int, mix: tuple) -> list[tuple[int, ...]]:
        """Cuts to try for ``p`` stages on device mix ``mix``: the min-max cut by stage speed
        (:func:`whale.planner.partition.partition_layers`, memory left to the estimate) and the uniform cut."""
        n = len(self.model.layers)
        if p > n:
            return []
        speeds = [sum(cnt * self.pool.speed(k) for k, cnt in enumerate(s)) for s in mix]
        flops = [x.flops for x in self.model.layers]
        best = partition_layers(flops, [0.0] * n, speeds, [1e300] * p)
        return [tuple(best), tuple(uniform_partition(n, p))]


def plan_search(model: ModelDesc, pool: DevicePool, global_batch: int, constraints=None, keep: int = 5,
                all_cuts_below: int = 0, estimator=None, cross_nodes: bool = False):
    """Search ``model`` on ``pool`` at ``global_batch`` samples per step (see :mod:`whale.planner.search`); the
    default estimator unless one is given (``cross_nodes``: split groups may span nodes, costed on the
    inter-node link). Returns a :class:`whale.planner.search.SearchResult`.

    Raises:
        NoFeasiblePlanError: nothing fits; ValueError: an empty space."""
    est = estimator or DefaultEstimator(model, pool, global_batch, cross_nodes)
    base = est if isinstance(est, DefaultEstimator) else DefaultEstimator(model, pool, global_batch, cross_nodes)
    cands = enumerate_candidates(len(model.layers), pool.counts, global_batch, constraints or Constraints(),
                                 base.cuts, base.split_ok, [d.memory_bytes for d in pool.types], all_cuts_below,
                                 pool.rank_types)
    return search(cands, est, keep)
