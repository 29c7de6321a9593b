"""This machine's calibration, made and cached: :func:`calibration` reads the cache
(:mod:`whale.planner.calibration_cache`) and measures only what is missing: the unit types of a model
(:mod:`whale.calibration.units`), the local gloo costs and the engine fits (:mod:`whale.calibration.engine`,
spawned engine runs). The front end and the planner only read what this module saved.
"""

from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from whale.calibration.engine import calibrate_engine, calibrate_model
from whale.calibration.units import calibrate_units, measure_comm, measure_optimizer, progress
from whale.frontend.unit_keys import unit_keys, variant_keys
from whale.planner import calibration_cache as cal
from whale.planner.calibration_cache import ENGINE_VERSION, Calibration


def calibration(model: nn.Module | None = None, sample_batch=None, loss_fn=None, rows: int = 16,
                comm: bool = True, save: bool = True, tracked: bool = False,
                keys: dict[str, str] | None = None, measure_engine: bool = True, precision: str = "fp32",
                checkpointed: tuple[str, ...] = ()) -> Calibration:
    """This machine's calibration: the cache's entry (:func:`whale.planner.calibration_cache.load`) completed with what
    is missing: the unit types of ``model`` (timed on ``rows`` rows of ``sample_batch``), the local
    communication costs and the engine fit (when ``comm``; spawn processes once:
    :func:`measure_comm`, :func:`whale.calibration.engine.calibrate_engine`) and the optimizer. Saved back when
    ``save``. A few seconds the first time, nothing when cached. ``keys`` (:func:`unit_keys`): when every one
    is cached already, the model is not run at all. ``measure_engine=False``: the engine fits are used when
    cached but never measured (they take minutes: a job's end-of-run report must not wait for them).
    ``precision``, ``checkpointed``: the unit types are timed as a plan of that precision and those checkpointed
    modules runs them (:func:`whale.calibration.units.calibrate_units`; keys from
    :func:`whale.frontend.unit_keys.variant_keys`)."""
    key = cal.machine_key()
    cached = cal.load(key)
    calib, changed = cached or Calibration(key=key, optimizer_seconds_per_element=measure_optimizer()), not cached
    if comm and calib.p2p_bandwidth == Calibration().p2p_bandwidth:
        progress("measuring local gloo latency and bandwidth, once per machine (2 processes, a few seconds)")
        calib, changed = dataclasses.replace(calib, **measure_comm()), True
    if comm and measure_engine and (calib.engine is None or calib.engine.version != ENGINE_VERSION):
        calib, changed = calibrate_engine(calib), True
    vkeys = variant_keys(keys, precision, checkpointed) if keys is not None else None
    missing = vkeys is None or any(k not in calib.units for n, k in vkeys.items() if n != "<rest>" or loss_fn)
    if model is not None and sample_batch is not None and missing:
        timings, _ = calibrate_units(model, sample_batch, loss_fn, rows, known=calib.units, tracked=tracked,
                                     precision=precision, checkpointed=checkpointed, progress=progress)
        if timings:
            calib, changed = calib.with_units(timings), True
    if comm and measure_engine and model is not None and sample_batch is not None:
        calib, measured = _model_engine(calib, model, sample_batch, loss_fn, keys, tracked)
        changed = changed or measured
    if save and changed:
        cal.save(calib)
    return calib


def _model_engine(calib: Calibration, model, sample_batch, loss_fn, keys, tracked) -> tuple[Calibration, bool]:
    """``calib`` with ``model``'s own engine fit (:func:`whale.calibration.engine.calibrate_model`)
    when not cached yet, and whether it was measured. A model that cannot run on one spawned rank keeps the
    machine's fit (a warning says so)."""
    keys = keys or unit_keys(model, sample_batch, None, loss_fn, tracked)
    sig = cal.model_signature(keys)
    if calib.for_model(sig) is not calib:
        return calib, False
    try:
        fit = calibrate_model(model, sample_batch, loss_fn, calib, tracked)
    except Exception as exc:  # noqa: BLE001 - the machine's fit still predicts
        warnings.warn(f"no engine calibration of this model ({type(exc).__name__}: {exc}); the calibration "
                      f"models' fit is used", stacklevel=3)
        return calib, False
    return dataclasses.replace(calib, model_engines={**calib.model_engines, sig: fit}), True
