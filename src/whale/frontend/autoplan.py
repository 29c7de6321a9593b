"""``Config(auto=True)``: profile the model, search the plan (:mod:`whale.planner.search`) and hand the front end a
layout it turns into a real :class:`~whale.plan.plan.Plan` through the usual stage-cut machinery.

What the search may choose for a real model: the pipeline stage count and cut (over the profiled layer units,
as :func:`whale.frontend.hwplan.hardware_cut` cuts them), the data-parallel degree (nested data parallelism:
world = K x stages, each stage a ``replicate(1)`` TaskGraph), the micro-batch count, the schedule and the memory
techniques. Annotations are constraints: annotated stages keep their count and cut (only K, micro-batches,
schedule and memory options are searched). On an unannotated model the split degree is searched too, for the
units whose type has a split rule with a ``dim_size`` (legal degrees only, inside a node, unpipelined plans:
:mod:`whale.frontend.autosplit`); models that carry ``split`` annotations are refused with a clear error for
now. Devices are placed as the runtime places them (:func:`whale.planner.hardware.device_order`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

import whale.frontend.autosplit as autosplit
import whale.frontend.hwplan as hwplan
from whale.annotation import Scope, replicate
from whale.cluster import ClusterSpec, emulation_cores, homogeneous_cpu
from whale.config import Config, ConfigError
from whale.frontend.profile import ModelProfile, profile_model
from whale.frontend.simcost import covers, layer_timings
from whale.frontend.taskgraphs import task_graph_scopes
from whale.frontend.unit_keys import unit_keys
from whale.planner import calibration_cache as cal
from whale.planner.memory import MemoryOptions
from whale.planner.model_desc import ModelDesc, from_profile
from whale.planner.planner import TaskGraphSummary, is_colocated
from whale.planner.search import Constraints, SearchResult, enumerate_candidates, search
from whale.planner.steptime.calibrated import CalibratedEstimator, type_factors
from whale.planner.steptime.estimate import DefaultEstimator, DevicePool, pool_from_cluster
from whale.planner.steptime.simulate import speed_factors


@dataclass(frozen=True)
class AutoLayout:
    """What the search decided, in the front end's terms.

    Attributes:
        config: the Config with the chosen micro-batches, schedule and memory options.
        tg_scopes / stage_of / scopes: TaskGraphs, tensor FQN -> stage, FQN -> scope (as
            :func:`whale.frontend.taskgraphs.task_graph_scopes` gives them).
        units: per stage, the profiled unit names it runs (``None``: the annotations' cut).
        profile: the fake-tensor profile the search used.
        result: the search's ranking; notes: printable lines for the plan.
    """

    config: Config
    tg_scopes: list[Scope]
    stage_of: dict[str, int]
    scopes: dict[str, Scope]
    units: list[list[str]] | None
    profile: ModelProfile
    result: SearchResult
    notes: tuple[str, ...]


def describe_module(model: nn.Module, inputs, batch_size: int = 1, loss_fn=None, name: str | None = None) -> ModelDesc:
    """Profile ``model`` on fake tensors (:func:`whale.frontend.profile.profile_model`; a meta-device model
    works and nothing is allocated) and describe it (:func:`whale.planner.model_desc.from_profile`). ``inputs``:
    ``inputs(batch) -> input(s)`` or InputSpecs; ``loss_fn(output, *inputs)``. Raises ProfileError like the
    profiler."""
    prof = profile_model(model, inputs, batch_size=batch_size, loss_fn=loss_fn)
    return from_profile(prof, name or type(model).__name__)


def _unit_stage_counts(prof: ModelProfile, model: nn.Module, stage_of: dict[str, int]) -> tuple[int, ...] | None:
    """Units per annotated stage, in order (a unit without annotated tensors joins the stage before it);
    ``None`` when the annotated stages are not contiguous runs of units."""
    stages, s = [], 0
    for u in prof.units:
        mod = model.get_submodule(u.name)
        own = [stage_of[n] for n, _ in mod.named_parameters(prefix=u.name, remove_duplicate=False) if n in stage_of]
        s = own[0] if own else s
        stages.append(s)
    if stages != sorted(stages):
        return None
    return tuple(stages.count(k) for k in range(max(stages) + 1))


def _constraints(model, prof, tg_scopes, stage_of, scopes, world_size, config, free_split=False) -> Constraints:
    """The annotations (and Config's memory settings) as search constraints (``free_split``: an unannotated
    model with split units, whose split degree is searched).

    Raises:
        ConfigError: split annotations, or pipeline stages of different device counts (not searched yet).
    """
    floor = MemoryOptions(bool(config.activation_checkpoint), config.zero, config.offload)
    base = Constraints(split=1, floor=floor, forbid=tuple(config.forbid), stage_order="runtime")
    if not scopes:
        return dataclasses.replace(base, split=None) if free_split else base
    if any(s.kind == "split" for s in scopes.values()):
        raise ConfigError("Config(auto=True) does not yet search models with split annotations: plan them "
                          "without auto (the search itself keeps split scopes; the front end cannot yet express "
                          "its choice for them)")
    kinds = [TaskGraphSummary(s.kind, s.device_count) for s in tg_scopes]
    if len(tg_scopes) == 1 or is_colocated(kinds, config.num_micro_batch):
        return dataclasses.replace(base, stages=1)
    if len({s.device_count for s in tg_scopes}) != 1:
        raise ConfigError("Config(auto=True) with pipeline stages of different device counts is not searched; "
                          "give every stage the same count or none")
    p = len(tg_scopes)
    return dataclasses.replace(base, stages=p, stage_layers=_unit_stage_counts(prof, model, stage_of),
                               data_parallel=world_size // p, replica_width=tg_scopes[0].device_count or 1)


def _stage_of(model: nn.Module, prof: ModelProfile, counts: tuple[int, ...]) -> tuple[dict[str, int], list]:
    """Tensor FQN -> stage and unit names per stage for a cut of the profiled units (as hardware_cut makes)."""
    stage_of: dict[str, int] = {}
    names, start = [], 0
    for s, c in enumerate(counts):
        units = prof.units[start:start + c]
        names.append([u.name for u in units])
        for u in units:
            mod = model.get_submodule(u.name)
            for n, _ in [*mod.named_parameters(prefix=u.name, remove_duplicate=False),
                         *mod.named_buffers(prefix=u.name, remove_duplicate=False)]:
                stage_of.setdefault(n, s)
        start += c
    return stage_of, names


def estimator(model: nn.Module, prof: ModelProfile, desc: ModelDesc, pool: DevicePool, batch: int,
              spec: ClusterSpec, config: Config, sample_batch, loss_fn=None) -> tuple[DefaultEstimator, str]:
    """The search's estimator and a note naming it: :class:`whale.planner.steptime.calibrated.CalibratedEstimator` when
    this machine's cached calibration (:func:`whale.planner.calibration_cache.load`) holds every profiled unit of
    ``model`` (timed as the run will be: under the memory tracker when it tracks), else the datasheet
    :class:`DefaultEstimator`. Nothing is measured here: every rank reads the same cache, so all choose the
    same plan (a calibration is made by ``whale simulate`` or :func:`whale.calibration.measure.calibration`)."""
    default = DefaultEstimator(desc, pool, batch)
    calib = cal.load(cal.machine_key())
    if calib is None:
        return default, ("cost model: datasheet FLOP/s (no calibration cached for this machine; `whale simulate` "
                         "makes one)")
    tracked = spec.emulate if config.track_memory is None else bool(config.track_memory)
    try:
        keys = unit_keys(model, sample_batch, prof, loss_fn, tracked)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:  # e.g. a meta-device model
        return default, f"cost model: datasheet FLOP/s (the model cannot run one row for the calibration keys: {e})"
    if not covers(calib, keys, loss_fn):
        return default, "cost model: datasheet FLOP/s (this model's unit types are not calibrated yet)"
    dtype = "fp32" if config.precision == "fp32" else "bf16"
    factors = type_factors(pool, speed_factors(spec, calib, pool.size, emulation_cores(), dtype))
    calib = calib.for_model(cal.model_signature(keys))
    est = CalibratedEstimator(desc, pool, batch, layer_timings(prof, keys, calib), calib, factors, spec.emulate)
    return est, "cost model: calibrated (measured unit seconds, " + ("emulated" if spec.emulate else "real") + \
        f" speed factors {[round(f, 3) for f in factors]})"


def auto_layout(model: nn.Module, world_size: int, config: Config, sample_batch, cluster: ClusterSpec | None,
                loss_fn=None) -> AutoLayout:
    """Profile ``model`` on ``sample_batch`` (fake tensors), search, and return the layout to plan.

    Raises:
        ConfigError: no sample batch, or annotations the search cannot keep yet.
        NoFeasiblePlanError: nothing fits memory (the smallest shortfall and what would fix it).
    """
    if sample_batch is None:
        raise ConfigError("Config(auto=True) needs a sample batch to profile the model: pass sample_batch="
                          "(inputs, target) to wh.parallelize / wh.plan_model (a factory returning (model, batch) "
                          "for whale plan --auto)")
    prof = hwplan.profile(model, sample_batch, loss_fn=loss_fn)
    desc = from_profile(prof, type(model).__name__)
    spec = cluster or homogeneous_cpu(world_size)
    batch = hwplan.sample_rows(sample_batch)
    tg_scopes, stage_of, scopes = task_graph_scopes(model)
    split_units = {} if scopes else autosplit.split_units(model, prof, world_size)
    desc = autosplit.with_split_kinds(desc, split_units) if split_units else desc
    cons = _constraints(model, prof, tg_scopes, stage_of, scopes, world_size, config, bool(split_units))
    pool = pool_from_cluster(spec, "fp32" if config.precision == "fp32" else "bf16")
    est, how = estimator(model, prof, desc, pool, batch, spec, config, sample_batch, loss_fn)
    cands = enumerate_candidates(len(desc.layers), pool.counts, batch, cons, est.cuts, est.split_ok,
                                 [d.memory_bytes for d in pool.types], all_cuts_below=64, rank_types=pool.rank_types)
    result = search((c for c in cands if c.split == 1 or c.stages == 1), est)  # split: unpipelined only
    best = result.best.candidate
    opt = best.options
    new = config.replace(num_micro_batch=best.num_micro_batch, schedule=best.schedule, zero=opt.zero,
                         offload=opt.offload,
                         activation_checkpoint="all" if opt.activation_checkpoint else config.activation_checkpoint)
    notes = tuple(result.describe([t.name for t in pool.types])) + (how,)
    if best.split > 1:  # the colocated replicate + split layout of the chosen degree
        graphs, cut_of, split_scopes = autosplit.split_layout(model, prof, split_units, best.split)
        return AutoLayout(new, graphs, cut_of, split_scopes, None, prof, result, notes)
    if cons.stages is not None or best.stages == 1:  # the annotations' TaskGraphs as they are
        return AutoLayout(new, tg_scopes, stage_of, scopes, None, prof, result, notes)
    cut_of, units = _stage_of(model, prof, best.stage_layers)
    return AutoLayout(new, [replicate(1) for _ in range(best.stages)], cut_of, {}, units, prof, result, notes)
