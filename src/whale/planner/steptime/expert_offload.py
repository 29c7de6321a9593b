"""Expert parallelism, mixed precision and granular CPU offload: the memory and step-time model of the recipe Whale
trains its 10-trillion-parameter M6 with (issue 28, ``paper_10t_fits``); an estimator for
:func:`whale.planner.steptime.estimate.plan_search` (same candidates, compute and pipeline as
:class:`~whale.planner.steptime.estimate.DefaultEstimator`; what differs is below).

- **Expert parallelism** as EPL (Whale's open-source release) writes M6: attention and gating under
  ``replicate(all GPUs)``, the MoE variables under ``split(all GPUs)`` (alibaba/EasyParallelLibrary,
  ``docs/en/tutorials/moe.md``). A stage's MoE layers shard their experts over all ``d x t`` devices of the
  stage (each device holds ``ceil(E / (d t))`` whole experts, or a ``1 / (d t)`` slice when there are fewer
  experts than devices); the other layers are replicated over the ``d`` lanes and split over ``t`` as before.
  An MoE layer's dispatch and combine all-to-alls run over the ``d x t`` devices
  (:func:`~whale.planner.steptime.cost.all_to_all_time`, forward and backward).
- **Mixed precision** (Micikevicius et al. 2018, §3.1): fp16 parameters and gradients on the device (2 + 2
  bytes per element); the fp32 master and AdamW's two fp32 moments (12 bytes) live with the optimizer.
- **Offload** by ``MemoryOptions.offload``, per element a device owns (``S`` = its optimizer-state elements:
  its experts plus its replicated elements, the latter / d under ZeRO, any stage):

  ========================  ==============================  =====================================
  offload                   device                          host
  ========================  ==============================  =====================================
  none                      4 B x all + 12 B x S            0
  optimizer (ZeRO-Offload)  4 B x all                       14 B x S (master, moments, fp16 grad)
  optimizer+params          4 B x 2 x the largest layer     14 B x S + 2 B x (all - S)
  ========================  ==============================  =====================================

  ``"optimizer+params"`` here is M6-10T's *granular CPU offloading* (Lin et al., "M6-10T: A Sharing-Delinking
  Paradigm for Efficient Multi-Trillion Parameter Pretraining", arXiv 2110.03888): parameters live on the host;
  each layer's fp16 parameters come to the device before its forward and again before its backward, its fp16
  gradients go back after its backward, and the device holds two layers at a time (the one computing and the
  one prefetched). The host also keeps an fp16 copy of the replicated elements it does not own (ZeRO).

Step time (seconds; constants of :mod:`whale.planner.steptime.memory_time`): per micro-batch, granular offload
moves ``2 B`` per element up in forward and ``2 + 2 B`` in backward over PCIe, overlapped with compute by the
prefetch (a stage's forward is ``max(compute, transfer)``); after the last micro-batch, the fp16 gradient
all-reduce of the replicated elements over the ``d`` lanes, the optimizer step (``32 B`` per state element at
the device's memory bandwidth, or at ``HOST_MEMORY_BANDWIDTH`` on the host) and, with ``"optimizer"``, fp16
gradients down and parameters up (``4 B`` per state element over PCIe).

Not what the runtime runs: Whale's runtime keeps fp32 parameters under autocast (:mod:`whale.runtime.precision`)
and its ``"optimizer+params"`` brings a whole stage to the device (:mod:`whale.runtime.offload`). This model is
the planner's account of the paper's recipe; plans searched with it are predictions, not runnable plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from whale.plan.schedule import in_flight_micro_batches
from whale.planner.memory_types import MemoryOptions
from whale.planner.search import Candidate
from whale.planner.steptime.cost import all_to_all_time, p2p_time, ring_allgather_time, ring_allreduce_time
from whale.planner.steptime.estimate import OPTIMIZER_BYTES_PER_ELEMENT, DefaultEstimator
from whale.planner.steptime.memory_time import HOST_MEMORY_BANDWIDTH, PCIE_BANDWIDTH

HALF, STATE, HOST_STATE = 2.0, 12.0, 14.0
"""Bytes per element: an fp16 value; fp32 master + two AdamW moments; those on the host plus an fp16 gradient."""


@dataclass(frozen=True)
class _Shares:
    """Per-device parameter elements of one stage at split t and d lanes."""

    replicated: float  # elements of the non-expert parts (split over t, replicated over d)
    experts: float     # expert elements this device holds (sharded over d x t)
    largest: float     # the most elements any one layer has on this device


class ExpertOffloadEstimator(DefaultEstimator):
    """:class:`DefaultEstimator` with expert parallelism over ``d x t``, fp16 mixed precision and granular CPU
    offload (see the module docstring). Same constructor; ``est(c) -> Estimate`` and ``bound(c)``; only
    activation checkpointing is declared monotone (granular offload can overlap what plain offload cannot)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.monotone_options = ("activation_checkpoint",)
        self._shares = lru_cache(maxsize=None)(self._shares_uncached)
        self._pipe_ep = lru_cache(maxsize=None)(self._pipe_ep_uncached)

    def _shares_uncached(self, a: int, b: int, t: int, d: int) -> _Shares:
        rep = exp = largest = 0.0
        g = d * t
        for x in self.model.layers[a:b]:
            e = x.expert_params if x.kind == "moe" else 0
            r = (x.params - e) / (t if x.splittable else 1)
            mine = e * math.ceil(x.experts / g) / x.experts if g <= x.experts else e / g
            rep, exp, largest = rep + r, exp + mine, max(largest, r + mine)
        return _Shares(rep, exp, largest)

    def _bytes(self, a: int, b: int, t: int, d: int, options: MemoryOptions) -> dict[str, float]:
        """Device bytes by category (activations per row: ``per_flight`` and ``once``) and host bytes."""
        sh, st = self._shares(a, b, t, d), self._stage(a, b, t)
        total = sh.replicated + sh.experts
        state = sh.replicated / (d if options.zero else 1) + sh.experts
        held = 2 * sh.largest if options.offload == "optimizer+params" else total
        out = {"parameters": HALF * held, "gradients": HALF * held,
               "optimizer_state": STATE * state if options.offload == "none" else 0.0,
               "host": 0.0 if options.offload == "none" else HOST_STATE * state}
        if options.offload == "optimizer+params":
            out["host"] += HALF * (total - state)
        out["per_flight"] = st.ckpt_act if options.activation_checkpoint else st.act
        out["once"] = st.peak_layer if options.activation_checkpoint else 0.0
        return out

    def _coeffs(self, a: int, b: int, t: int, d: int, options: MemoryOptions) -> tuple[float, float, float, float]:
        """``(fixed, per row in flight, per row once, host)`` bytes of one device of a stage."""
        m = self._bytes(a, b, t, d, options)
        return m["parameters"] + m["gradients"] + m["optimizer_state"], m["per_flight"], m["once"], m["host"]

    def breakdown(self, c: Candidate, stage: int, rows: int) -> dict[str, float]:
        """Device bytes by category of one device of ``stage`` holding ``rows`` rows per micro-batch, and
        ``"host"`` (its bytes of host memory)."""
        a = int(sum(c.stage_layers[:stage]))
        m = self._bytes(a, a + c.stage_layers[stage], c.split, c.data_parallel, c.options)
        flight = in_flight_micro_batches(stage, c.stages, c.num_micro_batch, c.schedule)
        return {"parameters": m["parameters"], "gradients": m["gradients"], "optimizer_state": m["optimizer_state"],
                "activations": rows * flight * m["per_flight"], "temporaries": rows * m["once"], "host": m["host"]}

    def _pipe_costs(self, c: Candidate) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        return self._pipe_ep(c.stage_layers, c.stage_devices, c.split, c.data_parallel, c.num_micro_batch,
                             c.options.activation_checkpoint, c.options.offload == "optimizer+params")

    def _pipe_ep_uncached(self, layers: tuple, mix: tuple, t: int, d: int, m: int, ckpt: bool,
                          stream: bool) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        """Forward and backward seconds per micro-batch per stage (compute, or the granular offload's PCIe
        transfers when slower, plus the split all-reduces and the expert all-to-alls over ``d x t``), and the
        p2p seconds per transfer."""
        fwd, bwd, comm = [], [], 0.0
        edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
        for s in range(len(layers)):
            a, b = int(edges[s]), int(edges[s + 1])
            st, sh = self._stage(a, b, t), self._shares(a, b, t, d)
            _, lanes = self._lane_rows(mix[s], m, t)
            f, bw_ = max((self._seconds(a, b, t, k, r, ckpt) for k, r in lanes), key=lambda x: (sum(x), x))
            if stream:
                elems = sh.replicated + sh.experts
                f, bw_ = max(f, HALF * elems / PCIE_BANDWIDTH), max(bw_, 2 * HALF * elems / PCIE_BANDWIDTH)
            r_most = max(x[1] for x in lanes)
            split_comm = 0.0
            if t > 1:
                bw, lat = self._link(t, "allreduce")
                split_comm += ring_allreduce_time(r_most * st.allreduce, t, bw, lat)
            if d * t > 1 and st.alltoall:
                bw, lat = self._link(d * t, "allreduce")
                split_comm += 2 * all_to_all_time(r_most * st.alltoall, d * t, bw, lat)
            fwd.append(f + split_comm)
            bwd.append(bw_ + split_comm)
            if s < len(layers) - 1:
                bw, lat = self._link(2 * d * t, "p2p")
                comm = max(comm, p2p_time(r_most * st.out, bw, lat))
        return tuple(fwd), tuple(bwd), comm

    def _post_uncached(self, layers: tuple, mix: tuple, t: int, d: int, options: MemoryOptions) -> float:
        """Seconds after the pipeline drains, slowest stage: fp16 all-reduce of the replicated gradients over
        the lanes, the optimizer step on the device or the host, and plain offload's PCIe round trip."""
        worst = 0.0
        bw, lat = self._link(d * t, "allreduce")
        edges = np.concatenate([[0], np.cumsum(layers)]).astype(int)
        for s in range(len(layers)):
            sh = self._shares(int(edges[s]), int(edges[s + 1]), t, d)
            state = sh.replicated / (d if options.zero else 1) + sh.experts
            sync = ring_allreduce_time(HALF * sh.replicated, d, bw, lat) if d > 1 else 0.0
            if options.offload == "none":
                mem_bw = min(self.pool.types[k].mem_bandwidth for k, n in enumerate(mix[s]) if n)
                step = OPTIMIZER_BYTES_PER_ELEMENT * state / mem_bw
            else:
                step = OPTIMIZER_BYTES_PER_ELEMENT * state / HOST_MEMORY_BANDWIDTH
                if options.offload == "optimizer":
                    step += 2 * HALF * state / PCIE_BANDWIDTH
            if options.zero and d > 1:  # the owners' updated replicated slices go back to every lane
                step += ring_allgather_time(HALF * sh.replicated, d, bw, lat)
            worst = max(worst, sync + step)
        return worst
