"""The search's estimator on calibrated costs: :class:`CalibratedEstimator` ranks candidates with the measured
per-unit seconds of :mod:`whale.planner.calibration_cache` instead of datasheet FLOP/s (issue 13).

The default estimator (:class:`whale.planner.steptime.estimate.DefaultEstimator`) turns FLOPs into seconds at each
device type's peak. That misses what small and CPU-emulated steps are made of: a fixed cost per unit call and per
forward/backward segment (paid once per micro-batch, so more micro-batches and more stages cost more than
FLOPs say), per-type time per FLOP (a large matmul is faster per FLOP than attention), and the measured gloo
costs of an emulated cluster. This estimator keeps the default one's structure (lanes, split collectives,
the schedule's event simulation, gradient sync, memory) and takes every formula that differs from
:mod:`whale.planner.steptime.simulate`, their one home:

- compute of a micro-batch: :func:`whale.planner.steptime.simulate.segment_seconds` of the stage's summed layer timings
  (per layer ``overhead + rows x seconds per row``, a :class:`whale.planner.calibration_cache.UnitTiming`) times the
  device type's speed factor (:func:`whale.planner.steptime.simulate.speed_factors`: the emulation stretch, or measured
  seconds per FLOP against the device's peak on a real cluster);
- links: :func:`whale.planner.steptime.simulate.link` (the calibration's local gloo costs under emulation, the declared
  links otherwise, here the pool's);
- after the sync: :func:`whale.planner.steptime.simulate.update_seconds` (optimizer, offload copies, ZeRO's all-gather)
  plus the calibration's per-step overhead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from whale.planner.calibration_cache import Calibration, UnitTiming
from whale.planner.memory import MemoryOptions
from whale.planner.model_desc import ModelDesc
from whale.planner.steptime.estimate import DefaultEstimator, DevicePool
from whale.planner.steptime.simulate import StageCost, link, segment_seconds, update_seconds


def type_factors(pool: DevicePool, rank_factors: Sequence[float]) -> tuple[float, ...]:
    """Per device type of ``pool``, the largest speed factor (seconds there per measured second) of its ranks,
    from per-rank factors (:func:`whale.planner.steptime.simulate.speed_factors`).

    Raises:
        ValueError: the pool does not list its ranks' types, or ``rank_factors`` has another length.
    """
    if len(pool.rank_types) != len(rank_factors) or not rank_factors:
        raise ValueError(f"rank_factors has {len(rank_factors)} entries for a pool of {len(pool.rank_types)} ranks "
                         "(pool.rank_types); build the pool with pool_from_cluster and give one factor per rank")
    out = [0.0] * len(pool.types)
    for k, f in zip(pool.rank_types, rank_factors, strict=True):
        out[k] = max(out[k], float(f))
    return tuple(out)


class CalibratedEstimator(DefaultEstimator):
    """:class:`~whale.planner.steptime.estimate.DefaultEstimator` with calibrated compute, links and post-step work (see
    the module docstring); memory, bound and pruning as the default one's (checkpointing still only adds
    seconds; offload is not declared monotone: its cost here is measured, not compared).

    Args:
        model: the layers; timings: one :class:`UnitTiming` per layer (seconds on the calibration machine,
            the work outside every unit folded into the last layer as :func:`whale.planner.model_desc.from_profile`
            folds it).
        pool: the devices; factors: per device type, seconds there per measured second (:func:`type_factors`).
        calib: the calibration (overheads, gloo, optimizer); emulated: links and the optimizer are local (the
            calibration's measured gloo and seconds per element) rather than the pool's declared links.

    Raises:
        ValueError: not one timing per layer or one factor per device type, or a factor <= 0.
    """

    def __init__(self, model: ModelDesc, pool: DevicePool, global_batch: int, timings: Sequence[UnitTiming],
                 calib: Calibration, factors: Sequence[float], emulated: bool = False) -> None:
        super().__init__(model, pool, global_batch)
        if len(timings) != len(model.layers):
            raise ValueError(f"got {len(timings)} layer timings for {len(model.layers)} layers; give one per layer")
        if len(factors) != len(pool.types) or min(factors) <= 0:
            raise ValueError(f"factors={list(factors)} must hold one positive speed factor per device type "
                             f"({len(pool.types)})")
        self.calib, self.factors, self.emulated = calib, tuple(factors), emulated
        self.monotone_options = ("activation_checkpoint",)
        fields = ("fwd_per_row", "bwd_per_row", "fwd_overhead", "bwd_overhead")
        self._tcum = {f: np.concatenate([[0.0], np.cumsum([getattr(x, f) for x in timings])]) for f in fields}
        self._recompute = np.concatenate([[0.0], np.cumsum([x.fwd_per_row for x in timings])])

    def stage_cost(self, a: int, b: int, t: int = 1) -> StageCost:
        """The :class:`whale.planner.steptime.simulate.StageCost` of layers ``[a, b)`` at split degree ``t`` (split
        layers' seconds per row / t; overheads are per call and stay whole)."""
        c = {f: v[b] - v[a] for f, v in self._tcum.items()}
        share = self._split_share(a, b, t)
        return StageCost(fwd_per_row=c["fwd_per_row"] * share, bwd_per_row=c["bwd_per_row"] * share,
                         fwd_overhead=c["fwd_overhead"], bwd_overhead=c["bwd_overhead"],
                         recompute_per_row=(self._recompute[b] - self._recompute[a]) * share,
                         trainable_elements=int(self._stage(a, b, t).elements))

    def _split_share(self, a: int, b: int, t: int) -> float:
        """Fraction of a stage's per-row work one device of a split group does: the FLOP ratio of the split
        stage to the whole one (1.0 unsplit)."""
        if t == 1:
            return 1.0
        whole = self._stage(a, b, 1).train
        return self._stage(a, b, t).train / whole if whole > 0 else 1.0

    def _seconds(self, a: int, b: int, t: int, k: int, rows: float, ckpt: bool) -> tuple[float, float]:
        """Calibrated ``(forward, backward)`` seconds (:func:`whale.planner.steptime.simulate.segment_seconds`)."""
        ranks = len(self.pool.rank_types) if self.emulated else 0  # emulated ranks crowd this machine's cores
        return segment_seconds(self.stage_cost(a, b, t), rows, self.factors[k], self.calib, ckpt, ranks=ranks)

    def _link(self, group: int, kind: str) -> tuple[float, float]:
        """Measured local gloo (:func:`whale.planner.steptime.simulate.link`) under emulation, else the pool's links."""
        if self.emulated:
            return link(None, self.calib, [], kind)
        return super()._link(group, kind)

    def _update(self, elements: float, mix: tuple[int, ...], d: int, options: MemoryOptions, bw: float,
                lat: float) -> float:
        """:func:`whale.planner.steptime.simulate.update_seconds` of the stage's slowest device type, plus the
        calibration's per-step overhead."""
        mem_bw = 0.0 if self.emulated else min(self.pool.types[k].mem_bandwidth for k, n in enumerate(mix) if n)
        up = update_seconds(elements, d, options.zero, options.offload, self.calib, mem_bw, bw, lat)
        return sum(up.values()) + self.calib.step_overhead
