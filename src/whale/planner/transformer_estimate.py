"""The search's estimator for described GPT models: Whale's step-time model (lanes, the 1F1B event simulation,
gradient sync, optimizer step, memory check) with a roofline per device type for compute and the
Korthikanti et al. memory accounting (issue 28).

:class:`TransformerEstimator` keeps :class:`whale.planner.steptime.estimate.DefaultEstimator`'s structure and replaces,
for a :class:`whale.planner.gpt.GPTShape` (layers ``embed``, ``h.i.attn``, ``h.i.mlp``, ``head``):

- compute of a micro-batch: :mod:`whale.planner.roofline` per unit (the embedding and LM head vocab-parallel);
  activation checkpointing (the candidate's option) is full recompute: every transformer layer's forward again
  in backward;
- split communication: per attention and FFN half one all-reduce of s·b·h 16-bit bytes forward, one backward
  and one more in the recompute; the embedding one forward, the head one backward (Megatron-LM); the ring over
  the intra-node link when the group fits a node, else the inter-node one;
- stage-to-stage sends: each device of a split group sends its 1/t of the boundary (Megatron-LM's
  scatter/gather), over the inter-node link;
- interleaved 1F1B with ``virtual`` chunks per device (Narayanan et al. §2.2.2): step = m·max_s(F+B) +
  (Σ_s(F+B) − max)/v + 2·(p−1 + m·(v−1))·send (the bubble shrinks v-fold; the extra sends are not overlapped);
  v = 1 uses the event simulation;
- after the pipeline: the data-parallel all-reduce of the stage's gradients at ``grad_bytes`` per element
  (with ``overlap_grad_sync`` hidden behind the last micro-batch's backward, as PyTorch DDP's buckets do), then
  the optimizer step;
- memory: :func:`whale.planner.transformer_memory.stage_peak` (16 or 18 bytes per element, activations by
  recompute mode and schedule, the tied word embedding on both the first and the last stage) times
  :data:`~whale.planner.transformer_memory.ALLOCATOR_OVERHEAD`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from whale.plan.schedule import make_schedule
from whale.plan.schedule_sim import simulate
from whale.planner.gpt import GPTShape
from whale.planner.legality import split_legal
from whale.planner.roofline import Roofline, attention_seconds, embedding_seconds, ffn_seconds, head_seconds
from whale.planner.search import Bound, Candidate, Estimate
from whale.planner.steptime.cost import p2p_time, ring_allgather_time, ring_allreduce_time, ring_reduce_scatter_time
from whale.planner.steptime.estimate import DefaultEstimator, DevicePool
from whale.planner.transformer_memory import ALLOCATOR_OVERHEAD, in_flight_layers, stage_peak


class TransformerEstimator(DefaultEstimator):
    """See the module docstring. The candidate says the schedule, ``virtual`` and ``sequence_parallel``.

    Args:
        shape: the model; pool: the devices (``intra_bandwidth`` / ``inter_bandwidth``: bytes/s per device and
            direction); global_batch: samples per step; rooflines: one per device type of the pool.
        recompute: activations without checkpointing, ``"none"`` or ``"selective"``.
        precision / fp32_grads: model-state bytes (:func:`~whale.planner.transformer_memory.model_state_bytes`).
        grad_bytes: bytes per element of the data-parallel all-reduce (2: 16-bit gradients).
        cross_nodes: split groups may span nodes (costed on the inter-node link).

    Raises:
        ValueError: rooflines do not match the pool's types.
    """

    def __init__(self, shape: GPTShape, pool: DevicePool, global_batch: int, rooflines: tuple[Roofline, ...],
                 recompute: str = "none", precision: str = "mixed", fp32_grads: bool = False,
                 grad_bytes: float = 2.0, overlap_grad_sync: bool = False, cross_nodes: bool = False,
                 _sequence_parallel: bool = False) -> None:
        if len(rooflines) != len(pool.types):
            raise ValueError(f"need one roofline per device type ({len(pool.types)}, got {len(rooflines)})")
        self.shape, self.roofs, self.recompute, self.seqpar = shape, tuple(rooflines), recompute, _sequence_parallel
        self.precision, self.fp32_grads, self.grad_bytes = precision, fp32_grads, grad_bytes
        self.overlap = overlap_grad_sync
        self._args = (shape, pool, global_batch, tuple(rooflines), recompute, precision, fp32_grads, grad_bytes,
                      overlap_grad_sync, cross_nodes)
        self._other: TransformerEstimator | None = None
        super().__init__(shape.model_desc(), pool, global_batch, cross_nodes)
        self.monotone_options = ("activation_checkpoint",)
        self._passes_cache = lru_cache(maxsize=None)(self._passes_uncached)

    def _view(self, c: Candidate) -> TransformerEstimator:
        """The estimator of ``c``'s sequence-parallel setting: this one or its twin (caches are per setting)."""
        if c.sequence_parallel == self.seqpar:
            return self
        if self._other is None:
            self._other = TransformerEstimator(*self._args, _sequence_parallel=c.sequence_parallel)
            self._other._other = self
        return self._other

    def split_ok(self, t: int) -> bool:
        """``t`` divides heads, kv heads, hidden, FFN and vocab, and fits a node unless ``cross_nodes``."""
        return split_legal(self.shape, t, self.pool.devices_per_node, self.cross_nodes)

    def _units(self, a: int, b: int) -> tuple[bool, int, int, bool]:
        """(embedding in [a, b), attention halves, FFN halves, head in [a, b))."""
        n = len(self.model.layers)
        body = range(max(a, 1), min(b, n - 1))
        return a == 0, sum(i % 2 == 1 for i in body), sum(i % 2 == 0 for i in body), b == n

    def _seconds(self, a: int, b: int, t: int, k: int, rows: float, ckpt: bool) -> tuple[float, float]:
        return self._unit_passes(a, b, t, k, rows, ckpt)[:2]

    def _unit_passes(self, a: int, b: int, t: int, k: int, rows: float, ckpt: bool) -> tuple[float, float, float]:
        """``(forward, backward, weight-gradient part of backward)`` compute seconds of one micro-batch of
        ``rows`` samples through units [a, b) on a device of type k (the recomputed forward in backward)."""
        sh, roof, r = self.shape, self.roofs[k], max(1, int(np.ceil(rows)))
        emb, n_att, n_ffn, head = self._units(a, b)
        att = attention_seconds(roof, sh.seq, r, sh.hidden, sh.heads, t, self.seqpar)
        ffn = ffn_seconds(roof, sh.seq, r, sh.hidden, sh.ffn, t, self.seqpar)
        fwd = n_att * att.forward + n_ffn * ffn.forward
        bwd = n_att * att.backward + n_ffn * ffn.backward + (fwd if ckpt else 0.0)
        wgt = n_att * att.weight + n_ffn * ffn.weight
        for on, unit in ((emb, embedding_seconds(roof, sh.seq, r, sh.hidden, sh.vocab, t)),
                         (head, head_seconds(roof, sh.seq, r, sh.hidden, sh.vocab, t))):
            if on:
                fwd, bwd, wgt = fwd + unit.forward, bwd + unit.backward, wgt + unit.weight
        return fwd, bwd, wgt

    def _link(self, group: int, kind: str) -> tuple[float, float]:
        inter = group > self.pool.devices_per_node if kind != "p2p" else True
        return (self.pool.inter_bandwidth if inter else self.pool.intra_bandwidth), self.pool.latency

    def _split_comm(self, a: int, b: int, t: int, rows: float, ckpt: bool) -> tuple[float, float]:
        """``(forward, backward)`` seconds of units [a, b)'s split collectives for one micro-batch of ``rows``:
        per attention / FFN half one all-reduce of s·rows·h 16-bit bytes each way (one more in the recompute);
        with sequence parallelism an all-gather and a reduce-scatter of the same bytes instead (the same ring
        time); the embedding's forward all-reduce (a reduce-scatter), the head's backward all-reduce (with
        sequence parallelism a forward all-gather and a backward reduce-scatter)."""
        if t < 2:
            return 0.0, 0.0
        emb, n_att, n_ffn, head = self._units(a, b)
        n = rows * 2.0 * self.shape.seq * self.shape.hidden
        bw, lat = self._link(t, "allreduce")
        ag, ar = ring_allgather_time(n, t, bw, lat), ring_allreduce_time(n, t, bw, lat)
        one = ag + ring_reduce_scatter_time(n, t, bw, lat) if self.seqpar else ar
        halves, again = n_att + n_ffn, 2 if ckpt else 1
        if self.seqpar:
            return one * halves + ag * (emb + head), one * halves * again + ag * (emb + head)
        return ar * (halves + emb), ar * (halves * again + head)

    def _chunk_ranges(self, layers: tuple[int, ...], v: int) -> list[list[tuple[int, int]]]:
        """Unit ranges [a, b) of each rank's chunks: the stage cut when v = 1; with v chunks Megatron-LM's
        layout (virtual stage j = c·p + r of l/(p·v) blocks, the embedding on j = 0, the head on the last)."""
        p, n = len(layers), len(self.model.layers)
        if v == 1:
            edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
            return [[(int(edges[s]), int(edges[s + 1]))] for s in range(p)]
        k = 2 * self.shape.layers // (p * v)  # units (halves) per chunk
        span = lambda j: (0 if j == 0 else 1 + k * j, n if j == p * v - 1 else 1 + k * (j + 1))  # noqa: E731
        return [[span(c * p + r) for c in range(v)] for r in range(p)]

    def _passes(self, c: Candidate) -> tuple:
        """``(fwd, bwd, comm, wgt, shares)`` of ``c`` (:meth:`_passes_uncached`)."""
        return self._passes_cache(c.stage_layers, c.stage_devices, c.split, c.data_parallel, c.num_micro_batch,
                                  c.options.activation_checkpoint, c.virtual, c.schedule == "ZB-H1")

    def _passes_uncached(self, layers: tuple, mix: tuple, t: int, d: int, m: int, ckpt: bool, v: int,
                         zb: bool) -> tuple:
        """Per stage (rank position): forward and backward seconds of one micro-batch through all its chunks,
        the W pass's seconds (zero-bubble: the runtime's W walks the input-gradient chain again, so W = the
        plain backward and B = the plain backward less its weight-gradient products; else 0) and each chunk's
        (forward, backward) share; the seconds of one stage-to-stage transfer."""
        fwd, bwd, wgt, shares, comm = [], [], [], [], 0.0
        msg = 2.0 * self.shape.seq * self.shape.hidden  # 16-bit bytes per sample of one layer's output
        ranges = self._chunk_ranges(layers, v)
        for s in range(len(layers)):
            _, lanes = self._lane_rows(mix[s], m, t)
            r_most = max(x[1] for x in lanes)
            per = []
            for a, b in ranges[s]:
                f, bw_, w = max((self._unit_passes(a, b, t, k, r, ckpt) for k, r in lanes),
                                key=lambda x: (x[0] + x[1], x))
                cf, cb = self._split_comm(a, b, t, r_most, ckpt)
                per.append((f + cf, bw_ + cb - (w if zb else 0.0), bw_ + cb if zb else 0.0))
            tot = [sum(x[i] for x in per) for i in range(3)]
            fwd.append(tot[0])
            bwd.append(tot[1])
            wgt.append(tot[2])
            shares.append(tuple((x[0] / tot[0] if tot[0] else 1 / v, (x[1] + x[2]) / (tot[1] + tot[2])
                                 if tot[1] + tot[2] else 1 / v) for x in per))
            if s < len(layers) - 1 or v > 1:
                gather = 0.0 if self.seqpar or t < 2 else ring_allgather_time(r_most * msg, t,
                                                                            *self._link(t, "allreduce"))
                comm = max(comm, p2p_time(r_most * msg / t, *self._link(2 * d * t, "p2p")) + gather)
        return tuple(fwd), tuple(bwd), comm, tuple(wgt), tuple(shares)

    def _pipe_costs(self, c: Candidate) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        """Forward and backward (B + W under zero-bubble) seconds per micro-batch per stage, and the seconds of
        one transfer (each device of a split group sends its 1/t, then the group all-gathers; with sequence
        parallelism the shards stay sharded)."""
        fwd, bwd, comm, wgt, _ = self._view(c)._passes(c)
        return fwd, tuple(b + w for b, w in zip(bwd, wgt, strict=True)), comm

    def _post(self, c: Candidate) -> float:
        """Seconds after the pipeline: per stage the exposed data-parallel gradient all-reduce (less the last
        micro-batch's backward under ``overlap_grad_sync``) plus the optimizer step; the slowest stage."""
        bwd = self._pipe_costs(c)[1] if self.overlap else (0.0,) * c.stages
        return self._post_cache(c.stage_layers, c.stage_devices, c.split, c.data_parallel, c.options, bwd)

    def _post_uncached(self, layers: tuple, mix: tuple, t: int, d: int, options,
                       hide: tuple[float, ...] = ()) -> float:
        worst = 0.0
        bw, lat = self._link(d * t, "allreduce")
        edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
        for s in range(len(layers)):
            st = self._stage(int(edges[s]), int(edges[s + 1]), t)
            sync = ring_allreduce_time(self.grad_bytes * st.elements, d, bw, lat) if d > 1 else 0.0
            sync = max(0.0, sync - (hide[s] if hide else 0.0))
            worst = max(worst, sync + self._update(st.elements, mix[s], d, options, bw, lat))
        return worst

    def pipeline_seconds(self, c: Candidate) -> float:
        """Seconds from the first forward to the last backward of ``c``, in closed form (the fast path; the module
        docstring), within 2% of :meth:`simulated_pipeline_seconds` (the event path) on Megatron-LM's cuts."""
        view = self._view(c)
        fwd, bwd, comm, wgt, _ = view._passes(c)
        return pipeline_closed_form(c.schedule, c.num_micro_batch, fwd, bwd, wgt, comm, c.virtual)

    def simulated_pipeline_seconds(self, c: Candidate) -> float:
        """The same through :func:`whale.plan.schedule_sim.simulate` (the event path): the schedule of
        :func:`whale.plan.schedule.make_schedule` (1F1B, GPipe, interleaved with ``c.virtual`` chunks, ZB-H1),
        each chunk at its own share of its rank's seconds, the W passes at their own seconds."""
        fwd, bwd, comm, wgt, shares = self._view(c)._passes(c)
        sched = make_schedule(c.schedule, c.stages, c.num_micro_batch, c.virtual)
        return simulate(sched, list(fwd), list(bwd), comm, [list(x) for x in shares] if c.virtual > 1 else None,
                        list(wgt) if c.schedule == "ZB-H1" else None)["step"]

    def _lane_rows_uncached(self, mix: tuple[int, ...], m: int, t: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """One device type: every lane gets ⌈(B/m) / lanes⌉ rows at most (what the largest-remainder shares of
        equal lanes give); mixed types as the default estimator."""
        if len(self.pool.types) > 1:
            return super()._lane_rows_uncached(mix, m, t)
        lanes = mix[0] // t
        return mix[0] * self.pool.speed(0), ((0, -(-max(1, self.batch // m) // lanes)),)

    def _coeffs(self, a: int, b: int, t: int, d: int, options) -> tuple[float, float, float, float]:
        """``(fixed, per row per in-flight micro-batch, per row once, host)`` bytes of one device of stage
        [a, b) (see :meth:`whale.planner.steptime.estimate.DefaultEstimator._coeffs`), from :func:`stage_peak`."""
        sh = self.shape
        emb, n_att, n_ffn, head = self._units(a, b)
        elems = self._stage(a, b, t).elements + (sh.vocab * sh.hidden / t if head and a > 0 else 0.0)
        nl = (n_att + n_ffn) / 2
        rec = "full" if options.activation_checkpoint else self.recompute

        def peak(rows: int, flight: float):
            """The stage's peak memory breakdown (bytes) at ``rows`` per micro-batch with ``flight`` in flight."""
            return stage_peak(sh.seq, rows, sh.hidden, sh.heads, sh.vocab, elems, int(np.ceil(nl)), flight * nl,
                              flight, emb, head, t, self.seqpar, rec, True, self.precision, options.zero, d,
                              self.fp32_grads)

        base = peak(1, 0.0)
        state = base.state
        optim_host = state.optimizer if options.offload != "none" else 0.0
        per_flight = peak(1, 2.0).total - peak(1, 1.0).total
        once = base.total - state.total
        fixed = state.total - optim_host + self._runtime_extra(elems, d, options)
        return (fixed * ALLOCATOR_OVERHEAD, per_flight * ALLOCATOR_OVERHEAD, once * ALLOCATOR_OVERHEAD, optim_host)

    def _runtime_extra(self, elems: float, d: int, options) -> float:
        """Bytes the runtime holds beyond :func:`model_state_bytes`' ZeRO rule (:mod:`whale.planner.memory`):
        ZeRO-2 keeps whole gradients until the last micro-batch's backward (so its peak holds them beside the
        slice), ZeRO-3 gathers a pipelined stage's 16-bit weights whole."""
        g = 4.0 if self.fp32_grads or self.precision == "fp32" else 2.0
        w = 4.0 if self.precision == "fp32" else 2.0
        return {2: g * elems, 3: w * elems}.get(options.zero, 0.0)

    def _flights(self, p: int, m: int, sched: str, v: int = 1) -> np.ndarray:
        """Micro-batches' worth of activations each stage holds: 1F1B and interleaving :func:`in_flight_layers`
        over the stage's layers; GPipe m; ZB-H1 min(p, m) on every stage (the runtime's B keeps each
        micro-batch's autograd graph, with the activations the W pass needs, until its W; the schedule's H1 limit
        bounds F-done-W-not micro-batches by p; under checkpointing that is the layer inputs, the W pass
        recomputing the rest). Not counted: the output gradients of the weight-bearing ops that B also keeps
        for W (:mod:`whale.parallel.weight_grad`), about one activation per linear layer per micro-batch."""
        if sched == "GPipe":
            return np.full(p, float(m))
        if sched == "ZB-H1":
            return np.full(p, float(min(p, m)))
        return np.array([in_flight_layers(s, p, m, 1, v) for s in range(p)], dtype=float)

    def bound(self, c: Candidate) -> Bound:
        """Exact memory overflow and a step-time lower bound of ``c`` (the default estimator's, on ``c``'s
        sequence-parallel setting)."""
        view = self._view(c)
        return DefaultEstimator.bound(view, c) if view is self else view.bound(c)

    def overflow(self, c: Candidate) -> float:
        """Bytes by which the fullest device of ``c`` overflows (<= 0: fits); the numbers of :meth:`memory`."""
        view = self._view(c)
        if view is not self:
            return view.overflow(c)
        fixed, per_flight, once, host = self._coef_cache(c.stage_layers, c.split, c.data_parallel, c.options)
        flight = self._flight(c.stages, c.num_micro_batch, c.schedule, c.virtual)
        rows, present, cap, hcap = self._rows_cache(c.stage_devices, c.num_micro_batch, c.split)
        dev = fixed[:, None] + np.ceil(rows) * (flight * per_flight + once)[:, None] - cap[None, :]
        over = np.where(present, np.maximum(dev, host[:, None] - hcap[None, :]), -np.inf)
        return float(over.max())

    def memory(self, c: Candidate) -> Estimate:
        """Candidate ``c``'s predicted peak device bytes and host bytes (offloaded optimizer state) per pipeline
        stage's worst device, beside its capacity, by the Korthikanti accounting of
        :mod:`whale.planner.transformer_memory` times :data:`ALLOCATOR_OVERHEAD` (``step_seconds`` is ``inf``:
        memory only)."""
        view = self._view(c)
        if view is not self:
            return view.memory(c)
        peak, cap, host, hcap = [], [], [], []
        flight = self._flight(c.stages, c.num_micro_batch, c.schedule, c.virtual)
        a = 0
        for s, n_layers in enumerate(c.stage_layers):
            fixed, per_flight, once, h = self._coef(a, a + n_layers, c.split, c.data_parallel, c.options)
            a += n_layers
            for k, rows in self._lanes(c, s)[1]:
                peak.append(fixed + int(np.ceil(rows)) * (flight[s] * per_flight + once))
                cap.append(self.pool.capacity[k])
                host.append(h)
                hcap.append(self.pool.host_capacity[k])
        return Estimate(float("inf"), self._labels(c.stage_devices), tuple(peak), tuple(cap), tuple(host),
                        tuple(hcap))

    def __call__(self, c: Candidate) -> Estimate:
        """Predicted step seconds and memory of ``c``; ``detail`` has the pipeline and post-step seconds."""
        if self._view(c) is not self:
            return self._view(c)(c)
        mem = self.memory(c)
        fwd, bwd, comm = self._pipe_costs(c)
        pipe = self.pipeline_seconds(c)
        post = self._post(c)
        detail = {"pipeline_seconds": pipe, "post_seconds": post, "stage_forward_seconds": fwd,
                  "stage_backward_seconds": bwd, "p2p_seconds": comm}
        return Estimate(pipe + post, mem.groups, mem.peak_bytes, mem.capacity, mem.host_bytes, mem.host_capacity,
                        detail)


def pipeline_closed_form(schedule: str, m: int, fwd, bwd, wgt, comm: float, v: int = 1) -> float:
    """Seconds of a pipeline of ``m`` micro-batches whose stage s takes ``fwd[s]`` / ``bwd[s]`` (B) / ``wgt[s]``
    (W, zero-bubble; else 0) seconds per micro-batch and ``comm`` seconds per transfer, in closed form:

    - GPipe, 1F1B: m·max(F+B) + Σ(F+B) − max + 2(p−1)·send (Narayanan et al. 2021);
    - Interleaved1F1B, v chunks: m·max(F+B) + (Σ(F+B) − max)/v + 2(p−1)·send·(...)  (SC'21 §2.2.2);
    - ZB-H1: m·max(F+B+W) + ... (Qi et al. ICLR'24 §3).
    """
    p = len(fwd)
    per = [f + b + w for f, b, w in zip(fwd, bwd, wgt, strict=True)]
    top = max(per)
    if schedule == "Interleaved1F1B":
        return m * top + (sum(per) - top) / v + 2 * (p - 1) * comm
    if schedule == "ZB-H1":
        i = per.index(top)
        rest = [s for s in range(p) if s != i]
        slack = m * (top - max((per[s] for s in rest), default=top))
        extra = sum(max(fwd[s], bwd[s]) - fwd[s] for s in rest)
        return m * top + sum(fwd[s] for s in rest) + max(0.0, extra - slack) + 2 * (p - 1) * comm
    return m * top + sum(per) - top + 2 * (p - 1) * comm
