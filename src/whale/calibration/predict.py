"""Predict a plan's step for a real model, measuring what the cache lacks first: the entry of ``whale simulate``
and of the planner benchmarks. It sits in :mod:`whale.calibration` because measuring may launch the engine
(:mod:`whale.calibration.engine`); the costs themselves come from the front end's reader
(:func:`whale.frontend.simcost.model_costs`) and the step-time model (:func:`whale.planner.steptime.simulate.
predict`).
"""

from __future__ import annotations

from torch import nn

from whale.calibration.measure import calibration
from whale.cluster import ClusterSpec, emulation_cores
from whale.frontend import hwplan
from whale.frontend.simcost import model_costs
from whale.frontend.unit_keys import unit_keys
from whale.plan.plan import Plan
from whale.planner.calibration_cache import Calibration
from whale.planner.steptime.simulate import Prediction, StageCost, predict


def measured_costs(model: nn.Module, plan: Plan, sample_batch, loss_fn=None, calib: Calibration | None = None,
                   rows: int = 16, tracked: bool = False,
                   measure_engine: bool = True) -> tuple[list[StageCost], list, Calibration]:
    """``(stage costs, stage memories, calibration)`` of ``plan`` for ``model``: profile once (fake tensors),
    calibrate only the unit types not cached (:func:`whale.calibration.measure.calibration`, on ``rows`` rows;
    ``measure_engine``: measure the engine fits when not cached), then :func:`whale.frontend.simcost.model_costs`.
    With ``calib`` given nothing is measured. The calibration returned carries the model's own engine fit when
    measured (:meth:`Calibration.for_model`)."""
    prof = hwplan.profile(model, sample_batch, loss_fn=loss_fn)
    keys = unit_keys(model, sample_batch, prof, loss_fn, tracked)
    calib = calib or calibration(model, sample_batch, loss_fn, rows, tracked=tracked, keys=keys,
                                 measure_engine=measure_engine)
    return model_costs(model, plan, sample_batch, loss_fn, calib, tracked, prof, keys)


def predict_model(model: nn.Module, plan: Plan, sample_batch, loss_fn=None, cluster: ClusterSpec | None = None,
                  calib: Calibration | None = None, rows: int = 16, cores: float | None = None,
                  factors: list[float] | None = None, tracked: bool | None = None,
                  measure_engine: bool = True) -> Prediction:
    """Predict ``plan``'s step for ``model`` at the sample batch's size: profile (fake tensors), calibrate the
    unit types not cached yet (:func:`whale.calibration.measure.calibration`; a few seconds once per machine and
    model shape), simulate (:func:`whale.planner.steptime.simulate.predict`) with per-rank memory.

    Args:
        cores: CPU cores emulated ranks share (default: :func:`whale.cluster.emulation_cores`).
        factors: per-rank speed factors overriding the cluster's (see
            :func:`whale.planner.steptime.simulate.predict`).
        tracked: the run measures memory with the CPU tracker (``Config.track_memory``; default: as the runtime's
            auto, on under an emulated cluster): units are timed under it too.
        measure_engine: measure the engine fits when not cached (minutes, once per machine and model);
            ``False`` uses them only when cached (see :func:`whale.calibration.measure.calibration`).
    """
    tracked = bool(cluster is not None and cluster.emulate) if tracked is None else tracked
    costs, mems, calib = measured_costs(model, plan, sample_batch, loss_fn, calib, rows, tracked, measure_engine)
    return predict(plan, costs, cluster, calib, hwplan.sample_rows(sample_batch), mems,
                   cores if cores is not None else emulation_cores(), factors)
