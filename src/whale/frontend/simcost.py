"""A model's stage costs for the step-time model: profile + calibration ->
:class:`whale.planner.steptime.simulate.StageCost`.

:func:`stage_costs` sums, per stage cut (a pipeline stage, or an interleaved plan's model chunk), the calibrated
forward/backward seconds of the layer units the cut holds (units by the cut holding their parameters, the loss on
the last one), the bytes it sends to the next cut (its last unit's output) and its trainable elements;
:func:`whale.planner.steptime.simulate.predict` groups an interleaved plan's chunks by stage.
:func:`model_costs` profiles and keys the units from an existing calibration.
"""

from __future__ import annotations

from torch import nn

import whale.frontend.hwplan as hwplan
import whale.frontend.memplan as memplan
from whale.frontend.profile import ModelProfile, UnitProfile
from whale.frontend.unit_keys import unit_keys, variant_keys
from whale.memory.checkpointing import layer_units
from whale.plan.plan import Plan
from whale.planner import calibration_cache as cal
from whale.planner.calibration_cache import Calibration, UnitTiming
from whale.planner.steptime.simulate import StageCost


def _timing(u: UnitProfile, key: str | None, calib: Calibration, base: str | None = None) -> UnitTiming:
    """The unit's calibrated timing under ``key`` (its variant, :func:`whale.frontend.unit_keys.variant_keys`),
    else under ``base`` (its fp32 key, not checkpointed); a unit type never measured costs its FLOPs at the best
    measured speed."""
    for k in (key, base):
        if k in calib.units:
            return calib.units[k]
    spf = calib.best_seconds_per_flop() or 1e-10
    return UnitTiming(u.forward_flops * spf, u.backward_flops * spf)


def layer_timings(prof: ModelProfile, keys: dict[str, str], calib: Calibration) -> list[UnitTiming]:
    """Per profiled unit, in forward order, its calibrated timing (:func:`_timing`), the work outside every
    unit (``"<rest>"``: the loss) added to the last, as :func:`whale.planner.model_desc.from_profile` folds it:
    the layer timings of :class:`whale.planner.steptime.calibrated.CalibratedEstimator`. Seconds on the calibration
    machine."""
    out = [_timing(u, keys.get(u.name), calib) for u in prof.units]
    rest = _timing(prof.rest, keys.get("<rest>"), calib)
    fields = ("fwd_per_row", "bwd_per_row", "fwd_overhead", "bwd_overhead")
    out[-1] = UnitTiming(**{f: getattr(out[-1], f) + getattr(rest, f) for f in fields})
    return out


def covers(calib: Calibration, keys: dict[str, str], loss_fn=None) -> bool:
    """True when ``calib`` holds every unit of ``keys`` (the loss's only when there is a ``loss_fn``)."""
    return all(k in calib.units for n, k in keys.items() if n != "<rest>" or loss_fn is not None)


def stage_units(prof: ModelProfile, plan: Plan, model: nn.Module) -> list[list[UnitProfile]]:
    """Per stage cut, i.e. per model chunk (= per stage unless the plan is interleaved: chunk c runs on stage
    ``plan.position_of(c)``), the profiled units it runs (the ``rest``, i.e. the loss, on the last chunk)."""
    params = hwplan.stage_param_names(plan.stage_cuts, model) if plan.is_pipeline else \
        hwplan.stage_param_names((), model)
    out: list[list[UnitProfile]] = [[] for _ in params]
    where = hwplan._unit_stages(prof, params, plan.stage_cuts) if plan.is_pipeline else [0] * len(prof.units)
    for u, s in zip(prof.units, where, strict=True):
        out[s].append(u)
    out[-1].append(prof.rest)
    return out


def stage_costs(prof: ModelProfile, plan: Plan, model: nn.Module, keys: dict[str, str],
                calib: Calibration) -> list[StageCost]:
    """One :class:`StageCost` per stage cut of ``plan`` (per model chunk: per stage unless interleaved, which
    :func:`whale.planner.steptime.simulate.predict` groups by stage) from the profile and the calibration (``keys``: the
    calibration key of each unit, :func:`whale.frontend.unit_keys.unit_keys`). Each unit costs its timing as
    the plan runs it (:func:`whale.frontend.unit_keys.variant_keys`: under the plan's precision, under the
    checkpoint wrapper when checkpointed) when calibrated, else its fp32 timing; a checkpointed unit timed
    under the wrapper has its recompute in its backward already, one without it is charged its forward again
    (``recompute_per_row``)."""
    params = hwplan.stage_param_names(plan.stage_cuts, model) if plan.is_pipeline else \
        hwplan.stage_param_names((), model)
    mems = memplan.stage_memories(prof, model, params, plan.activation_checkpoint)
    targets = plan.activation_checkpoint or tuple(memplan.repeated_layers(model))
    out = []
    vkeys = variant_keys(keys, plan.precision, plan.activation_checkpoint)
    chunks = stage_units(prof, plan, model)
    for c, units in enumerate(chunks):
        split = tuple(name for name, _ in plan.split_targets(plan.position_of(c) if plan.is_pipeline else 0))
        t = [_timing(u, vkeys.get(u.name), calib, keys.get(u.name)) for u in units]
        real = [u for u in units if u.name != "<rest>"]
        out.append(StageCost(
            fwd_per_row=sum(x.fwd_per_row for x in t), bwd_per_row=sum(x.bwd_per_row for x in t),
            fwd_overhead=sum(x.fwd_overhead for x in t), bwd_overhead=sum(x.bwd_overhead for x in t),
            fwd_flops=sum(u.forward_flops for u in units), bwd_flops=sum(u.backward_flops for u in units),
            boundary_bytes=real[-1].output_bytes if real and c < len(chunks) - 1 else 0.0,
            trainable_elements=mems[c].trainable_elements,
            recompute_per_row=sum(x.fwd_per_row for u, x in zip(units, t, strict=True)
                                  if memplan._inside(u.name, targets) and vkeys.get(u.name) not in calib.units),
            zero3_units=_zero3_units(plan, model), **_split_bytes(real, split)))
    return out


def _zero3_units(plan: Plan, model: nn.Module) -> int:
    """Units ZeRO-3 gathers and frees around every call of a stage: a pipeline stage's one (its root, freed after
    each forward), else :func:`whale.memory.checkpointing.layer_units` of the model, as the runtime's
    :func:`whale.parallel.zero3_unit.find_units` (the root of an unpipelined model stays gathered). 0 without
    ZeRO-3."""
    if plan.zero < 3:
        return 0
    if plan.is_pipeline:
        return 1
    return len(layer_units(model))


def _split_bytes(real: list[UnitProfile], split: tuple[str, ...]) -> dict:
    """``split_bytes`` (each split module's output: its last unit's), ``split_in_bytes`` (its input: the output
    of the unit before its first, else its own output) and ``split_modules`` of a stage's units."""
    out_b = in_b = 0.0
    count = 0
    for t in split:
        idx = [i for i, u in enumerate(real) if memplan._inside(u.name, (t,))]
        if not idx:
            continue
        count += 1
        out_b += real[idx[-1]].output_bytes
        in_b += real[idx[0] - 1].output_bytes if idx[0] > 0 else real[idx[-1]].output_bytes
    return {"split_bytes": out_b, "split_in_bytes": in_b, "split_modules": count}


def model_costs(model: nn.Module, plan: Plan, sample_batch, loss_fn=None, calib: Calibration | None = None,
                tracked: bool = False, prof: ModelProfile | None = None,
                keys: dict[str, str] | None = None) -> tuple[list[StageCost], list, Calibration]:
    """``(stage costs, stage memories, calibration)`` (costs and memories one per stage cut: per model chunk of an
    interleaved plan) of ``plan`` for ``model`` from an existing calibration:
    ``calib`` (e.g. one just measured by :func:`whale.calibration.measure.calibration`), else this machine's
    cached one (:func:`whale.planner.calibration_cache.load`). Profiles once on fake tensors (unless ``prof`` is
    given), keys the units (:func:`whale.frontend.unit_keys.unit_keys`, unless ``keys`` is given) and sums their
    timings; a unit type not in the calibration costs its FLOPs at the best measured speed. Nothing is measured
    here; the calibration returned carries the model's own engine fit when it holds one
    (:meth:`Calibration.for_model`).

    Raises:
        ValueError: no ``calib`` and none cached for this machine (naming the fix).
    """
    if calib is None:
        calib = cal.load(cal.machine_key())
        if calib is None:
            raise ValueError(f"no calibration cached for this machine ({cal.cache_path()}); measure one with "
                             "`whale simulate` or whale.calibration.measure.calibration(model, sample_batch)")
    prof = prof or hwplan.profile(model, sample_batch, loss_fn=loss_fn)
    keys = keys or unit_keys(model, sample_batch, prof, loss_fn, tracked)
    calib = calib.for_model(cal.model_signature(keys))
    params = hwplan.stage_param_names(plan.stage_cuts, model) if plan.is_pipeline else \
        hwplan.stage_param_names((), model)
    mems = memplan.stage_memories(prof, model, params, plan.activation_checkpoint)
    return stage_costs(prof, plan, model, keys, calib), mems, calib
