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

import numpy as np

from whale.planner.gpt import GPTShape
from whale.planner.legality import split_legal
from whale.planner.roofline import Roofline, attention_seconds, embedding_seconds, ffn_seconds, head_seconds
from whale.planner.search import Candidate, Estimate
from whale.planner.steptime.cost import p2p_time, ring_allgather_time, ring_allreduce_time
from whale.planner.steptime.estimate import DefaultEstimator, DevicePool
from whale.planner.transformer_memory import ALLOCATOR_OVERHEAD, in_flight_layers, stage_peak


class TransformerEstimator(DefaultEstimator):
    """See the module docstring.

    Args:
        shape: the model; pool: the devices (``intra_bandwidth`` / ``inter_bandwidth``: bytes/s per device and
            direction); global_batch: samples per step; rooflines: one per device type of the pool.
        recompute: activations without checkpointing, ``"none"`` or ``"selective"``.
        sequence_parallel: activations between split layers sharded along the sequence.
        precision / fp32_grads: model-state bytes (:func:`~whale.planner.transformer_memory.model_state_bytes`).
        grad_bytes: bytes per element of the data-parallel all-reduce (2: 16-bit gradients).
        virtual: chunks per device of the interleaved schedule (1: plain 1F1B).
        cross_nodes: split groups may span nodes (costed on the inter-node link).

    Raises:
        ValueError: rooflines do not match the pool's types, or virtual < 1.
    """

    def __init__(self, shape: GPTShape, pool: DevicePool, global_batch: int, rooflines: tuple[Roofline, ...],
                 recompute: str = "none", sequence_parallel: bool = False, precision: str = "mixed",
                 fp32_grads: bool = False, grad_bytes: float = 2.0, overlap_grad_sync: bool = False,
                 virtual: int = 1, cross_nodes: bool = False) -> None:
        if len(rooflines) != len(pool.types) or virtual < 1:
            raise ValueError(f"need one roofline per device type ({len(pool.types)}, got {len(rooflines)}) and "
                             f"virtual >= 1 (got {virtual})")
        self.shape, self.roofs, self.recompute, self.seqpar = shape, tuple(rooflines), recompute, sequence_parallel
        self.precision, self.fp32_grads, self.grad_bytes = precision, fp32_grads, grad_bytes
        self.overlap, self.virtual = overlap_grad_sync, virtual
        super().__init__(shape.model_desc(), pool, global_batch, cross_nodes)
        self.monotone_options = ("activation_checkpoint",)

    def split_ok(self, t: int) -> bool:
        """``t`` divides heads, kv heads, hidden, FFN and vocab, and fits a node unless ``cross_nodes``."""
        return split_legal(self.shape, t, self.pool.devices_per_node, self.cross_nodes)

    def _units(self, a: int, b: int) -> tuple[bool, int, int, bool]:
        """(embedding in [a, b), attention halves, FFN halves, head in [a, b))."""
        n = len(self.model.layers)
        body = range(max(a, 1), min(b, n - 1))
        return a == 0, sum(i % 2 == 1 for i in body), sum(i % 2 == 0 for i in body), b == n

    def _seconds(self, a: int, b: int, t: int, k: int, rows: float, ckpt: bool) -> tuple[float, float]:
        sh, roof, r = self.shape, self.roofs[k], max(1, int(np.ceil(rows)))
        emb, n_att, n_ffn, head = self._units(a, b)
        att = attention_seconds(roof, sh.seq, r, sh.hidden, sh.heads, t, self.seqpar)
        ffn = ffn_seconds(roof, sh.seq, r, sh.hidden, sh.ffn, t, self.seqpar)
        fwd = n_att * att.forward + n_ffn * ffn.forward
        bwd = n_att * att.backward + n_ffn * ffn.backward + (fwd if ckpt else 0.0)
        for on, unit in ((emb, embedding_seconds(roof, sh.seq, r, sh.hidden, sh.vocab, t)),
                         (head, head_seconds(roof, sh.seq, r, sh.hidden, sh.vocab, t))):
            if on:
                fwd, bwd = fwd + unit.forward, bwd + unit.backward
        return fwd, bwd

    def _link(self, group: int, kind: str) -> tuple[float, float]:
        inter = group > self.pool.devices_per_node if kind != "p2p" else True
        return (self.pool.inter_bandwidth if inter else self.pool.intra_bandwidth), self.pool.latency

    def _pipe_uncached(self, layers: tuple, mix: tuple, t: int, d: int, m: int,
                       ckpt: bool) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        fwd, bwd, comm = [], [], 0.0
        edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
        msg = 2.0 * self.shape.seq * self.shape.hidden  # 16-bit bytes per sample of one layer's output
        for s in range(len(layers)):
            a, b = int(edges[s]), int(edges[s + 1])
            _, lanes = self._lane_rows(mix[s], m, t)
            f, bw_ = max((self._seconds(a, b, t, k, r, ckpt) for k, r in lanes), key=lambda x: (sum(x), x))
            r_most = max(x[1] for x in lanes)
            if t > 1:
                emb, n_att, n_ffn, head = self._units(a, b)
                lbw, lat = self._link(t, "allreduce")
                one = ring_allreduce_time(r_most * msg, t, lbw, lat)
                f += one * (n_att + n_ffn + emb)
                bw_ += one * ((n_att + n_ffn) * (2 if ckpt else 1) + head)
            fwd.append(f)
            bwd.append(bw_)
            if s < len(layers) - 1:
                lbw, lat = self._link(2 * d * t, "p2p")
                gather = ring_allgather_time(r_most * msg, t, *self._link(t, "allreduce")) if t > 1 else 0.0
                comm = max(comm, p2p_time(r_most * msg / t, lbw, lat) + gather)
        return tuple(fwd), tuple(bwd), comm

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
        """Seconds from the first forward to the last backward of ``c``, in closed form (the fast path):
        m·max_s(F+B) + (Σ_s(F+B) − max)/v + 2·(p−1 + m·(v−1))·send (the module docstring). For v = 1 this is the
        1F1B event simulation's result whenever the slowest stage is the last or all are equal (Megatron-LM's
        cuts); :meth:`simulated_pipeline_seconds` gives the event path to compare."""
        fwd, bwd, comm = self._pipe_costs(c)
        per = [f + b for f, b in zip(fwd, bwd, strict=True)]
        p, m, v = c.stages, c.num_micro_batch, self.virtual if c.stages > 1 else 1
        if c.schedule == "GPipe":
            return m * max(per) + sum(per) - max(per) + 2 * (p - 1) * comm
        return m * max(per) + (sum(per) - max(per)) / v + 2 * (p - 1 + m * (v - 1)) * comm

    def simulated_pipeline_seconds(self, c: Candidate) -> float:
        """The same through :func:`whale.plan.schedule.simulate` (the event path; 1F1B and GPipe, v = 1).

        Raises:
            ValueError: an interleaved estimator (the event simulator has no interleaved schedule yet)."""
        if self.virtual > 1 and c.stages > 1:
            raise ValueError(f"the event simulator has no interleaved schedule (virtual={self.virtual}); "
                             "compare plain 1F1B plans")
        fwd, bwd, comm = self._pipe_costs(c)
        return self._sim(c.schedule, c.stages, c.num_micro_batch, fwd, bwd, comm)

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

    def _flights(self, p: int, m: int, sched: str) -> np.ndarray:
        """Micro-batches' worth of activations each stage holds (interleaving: :func:`in_flight_layers`
        over the stage's layers; GPipe: m)."""
        if sched == "GPipe":
            return np.full(p, float(m))
        return np.array([in_flight_layers(s, p, m, 1, self.virtual) for s in range(p)], dtype=float)

    def memory(self, c: Candidate) -> Estimate:
        """Candidate ``c``'s predicted peak device bytes and host bytes (offloaded optimizer state) per pipeline
        stage's worst device, beside its capacity, by the Korthikanti accounting of
        :mod:`whale.planner.transformer_memory` times :data:`ALLOCATOR_OVERHEAD` (``step_seconds`` is ``inf``:
        memory only)."""
        peak, cap, host, hcap = [], [], [], []
        flight = self._flight(c.stages, c.num_micro_batch, c.schedule)
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
        mem = self.memory(c)
        fwd, bwd, comm = self._pipe_costs(c)
        pipe = self.pipeline_seconds(c)
        post = self._post(c)
        detail = {"pipeline_seconds": pipe, "post_seconds": post, "stage_forward_seconds": fwd,
                  "stage_backward_seconds": bwd, "p2p_seconds": comm}
        return Estimate(pipe + post, mem.groups, mem.peak_bytes, mem.capacity, mem.host_bytes, mem.host_capacity,
                        detail)
