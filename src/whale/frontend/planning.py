"""The front end: model + annotations + cluster -> a complete :class:`~whale.plan.plan.Plan`, and nothing else.

Steps: record the TaskGraphs from the annotations; with a sample batch and a cluster, profile the model on fake
tensors (no compute); on a mixed cluster, cut the pipeline and choose each stage's devices together by speed and
memory (:func:`whale.planner.placement.place_stages`, exact; the Whale paper's §3.3 orders by memory first);
cut the traced model into stages and record the cut by name; call the pure planner
(:func:`whale.planner.planner.make_plan`); balance the plan for the devices
(:func:`whale.planner.hardware.apply_hardware`). No process group is touched; nothing from :mod:`whale.parallel`
or :mod:`whale.runtime` is imported, so ``whale plan`` stays light.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

import whale.frontend.hwplan as hwplan
import whale.frontend.hwvirtual as hwvirtual
import whale.frontend.memplan as memplan
from whale.cluster import ClusterSpec, memory_capacity
from whale.config import Config
from whale.detect import detect_cluster
from whale.frontend.autoplan import auto_layout
from whale.frontend.export import capture_inputs
from whale.frontend.graph import StageError
from whale.frontend.profile import default_units
from whale.frontend.stagecut import cut_model
from whale.frontend.taskgraphs import all_tensors, colocated_names, split_leaves, summaries, task_graph_scopes
from whale.memory.checkpointing import resolve_targets
from whale.moe import check_aux_stages, with_moe_layers
from whale.plan.plan import Plan, PlanError
from whale.planner.experts import expert_memory_counts
from whale.planner.hardware import apply_hardware, is_heterogeneous
from whale.planner.memory import MemoryOptions
from whale.planner.planner import TaskGraphSummary, is_colocated, make_plan
from whale.planner.zero import with_zero_weights
from whale.splitrules import check_split_plan


def resolve_cluster(cluster, world_size: int) -> ClusterSpec | None:
    """The job's cluster spec: a :class:`ClusterSpec`, a YAML path, or ``None`` (detected on GPUs; ``None`` on
    CPU, where devices count as identical).

    Raises:
        ClusterError: the spec is invalid or declares a different number of devices than the world size (the
            message names the spec file).
    """
    if cluster is None:
        spec = detect_cluster(world_size) if torch.cuda.is_available() else None
    elif isinstance(cluster, ClusterSpec):
        spec = cluster
    else:
        spec = ClusterSpec.from_yaml(os.fspath(cluster))
    if spec is not None:
        try:
            spec.check_world_size(world_size)
        except ValueError as e:
            where = f"cluster spec {os.fspath(cluster)!r}: " if isinstance(cluster, str | os.PathLike) else ""
            raise type(e)(f"{where}{e}") from None
    return spec


def plan_model(model: nn.Module, world_size: int, config: Config | None = None, sample_batch=None,
               cluster: ClusterSpec | None = None, loss_fn=None) -> Plan:
    """The plan Whale runs ``model`` with on ``world_size`` ranks; no processes needed (see
    :func:`plan_with_stages` for the arguments and errors)."""
    return plan_with_stages(model, world_size, config, sample_batch, cluster, loss_fn)[0]


def plan_with_stages(model: nn.Module, world_size: int, config: Config | None = None, sample_batch=None,
                     cluster: ClusterSpec | None = None, loss_fn=None) -> tuple[Plan, tuple[nn.Module, ...]]:
    """The plan Whale runs ``model`` with on ``world_size`` ranks, and the pipeline's stage modules the cut made
    (empty without a pipeline): ``wh.parallelize`` runs them rather than capturing the model again.

    Args:
        model: the local model with its ``replicate``/``split`` annotations (or none).
        world_size: number of ranks.
        config: micro-batches, schedule, load shares, hardware awareness; ``config.cluster`` (a spec or YAML
            path) is used when ``cluster`` is not given.
        sample_batch: a global batch ``(inputs, target)``: a pipeline is captured from it with
            ``torch.export`` (``config.capture``), and it lets the planner profile the model on fake tensors
            for memory-constrained shares and, on a mixed cluster, speed-balanced pipeline cuts (the
            annotations then fix only the stage count).
        cluster: an already resolved spec (``whale.init`` resolves it once per job).
        loss_fn: the training loss ``loss_fn(output, target)``: profiled with the model, so the memory it
            needs (a language model's log-probabilities and logit gradients) counts in the last stage.

    Raises:
        ValueError: the model has no parameters.
        PlanError: device counts do not fit the world size, and other plan errors.
        InfeasiblePlanError: the work cannot fit the devices' memory (names the device and the bytes).
        StageError: the model cannot be captured or cut into pipeline stages (naming the error and fixes).
        SplitError: a module under ``split`` has no sharding rule, or its sharded dim is smaller than the
            split's device count (naming the module, the dim and the fix).
        ClusterError: a bad cluster spec.
    """
    config = config or Config()
    if cluster is None and config.cluster is not None:
        cluster = resolve_cluster(config.cluster, world_size)
    if not any(True for _ in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to train or parallelize")
    if config.auto:  # search the layout (whale.frontend.autoplan), then plan it like an annotated model
        layout = auto_layout(model, world_size, config, sample_batch, cluster, loss_fn)
        plan, stages = _plan(model, world_size, layout.config, sample_batch, cluster, loss_fn, layout)
        return dataclasses.replace(plan, notes=plan.notes + layout.notes), stages
    return _plan(model, world_size, config, sample_batch, cluster, loss_fn, None)


def _plan(model, world_size, config, sample_batch, cluster, loss_fn, layout) -> tuple[Plan, tuple[nn.Module, ...]]:
    """:func:`plan_with_stages` after the cluster is resolved; ``layout`` (an ``AutoLayout``) replaces the
    annotations' TaskGraphs and cut and the profile when given."""
    if layout is None:
        tg_scopes, stage_of, scopes = task_graph_scopes(model)
    else:
        tg_scopes, stage_of, scopes = layout.tg_scopes, layout.stage_of, layout.scopes
    kinds = [TaskGraphSummary(s.kind, s.device_count) for s in tg_scopes]
    pipelined = len(tg_scopes) > 1 and not is_colocated(kinds, config.num_micro_batch)
    aware = cluster is not None and config.hardware_aware
    virtual = config.virtual_stages > 1
    if virtual and layout is not None:
        raise PlanError(f"virtual_stages={config.virtual_stages} (interleaved 1F1B) is planned from the annotated "
                        "stage scopes: it cannot be combined with Config(auto=True) yet; drop one of them")
    prof = layout.profile if layout is not None else \
        hwplan.profile(model, sample_batch, loss_fn=loss_fn) if aware and sample_batch is not None else None
    speed_cut = hwplan.UnitCut(layout.stage_of, layout.units) if layout is not None and layout.units else None
    if layout is None and pipelined and prof is not None and is_heterogeneous(cluster):
        base = make_plan(kinds, world_size, config)
        cut_fn = hwvirtual.interleaved_cut if virtual else hwplan.hardware_cut  # chunks by speed, or stages
        speed_cut = cut_fn(model, prof, base, cluster, config, hwplan.sample_rows(sample_batch))
    plan, stages = _cut_and_plan(model, world_size, config, tg_scopes, stage_of, scopes, pipelined, speed_cut,
                                 sample_batch)
    # Split shapes and sharding rules, checked now rather than on every rank in wh.parallelize (SplitError
    # naming the module, its type, the dim cut and its size, and the device count; see whale.splitrules).
    check_split_plan(model, plan)
    plan = with_moe_layers(model, plan)
    check_aux_stages(model, plan)  # an MoE auxiliary loss outside the last stage would be silently dropped
    plan = _with_checkpointing(model, plan, config)
    if sample_batch is not None:
        plan.micro_batch_rows(hwplan.sample_rows(sample_batch))  # the plan can run batches of this size
    if not aware:
        return plan, stages
    capacity = [memory_capacity(cluster, r) for r in range(world_size)]
    if prof is None:
        plan = apply_hardware(plan, cluster, None, keep_lane_weights=config.load_shares is not None)
        plan = with_zero_weights(plan, capacity)
    elif virtual:  # memory was checked by the chunk planner; the memory techniques are not searched for chunks
        plan = _interleaved_hardware(plan, model, prof, cluster, config, speed_cut)
    else:
        params = hwplan.stage_param_names(plan.stage_cuts, model)
        plan = dataclasses.replace(plan, stage_flops=hwplan.stage_flops(prof, params, plan.stage_cuts))
        plan = _fit(model, plan, cluster, config, memplan.stage_memories(prof, model, params,
                    plan.activation_checkpoint), hwplan.sample_rows(sample_batch))
    return expert_memory_counts(plan, capacity), stages  # experts per device within memory (MoE under split)


def _interleaved_hardware(plan: Plan, model: nn.Module, prof, cluster, config: Config,
                          speed_cut: hwplan.UnitCut | None) -> Plan:
    """An interleaved plan balanced for ``cluster``: lane shares by speed, FLOPs per position (its chunks
    together) and, when the chunk planner cut it, each rank's predicted bytes (its position's chunks)."""
    chunk_flops = hwplan.stage_flops(prof, hwplan.stage_param_names(plan.stage_cuts, model), plan.stage_cuts)
    flops = tuple(sum(chunk_flops[c] for c in plan.chunks_of(s)) for s in range(plan.num_stages))
    plan = dataclasses.replace(plan, stage_flops=flops)  # before apply_hardware: the busy shares follow the cut
    plan = apply_hardware(plan, cluster, None, keep_lane_weights=config.load_shares is not None)
    memory = ()
    if speed_cut is not None and speed_cut.position_bytes:
        memory = tuple(speed_cut.position_bytes[plan.coords(r)[0]] for r in range(plan.world_size))
    return dataclasses.replace(plan, predicted_memory=memory)


def _fit(model: nn.Module, plan: Plan, cluster, config: Config, stage_mem, rows: int) -> Plan:
    """The plan balanced for ``cluster`` with the cheapest memory techniques that fit (:mod:`whale.planner.memory`);
    the printout says what was added and why.

    Raises:
        InfeasiblePlanError: nothing allowed fits.
    """
    floor = MemoryOptions(bool(plan.activation_checkpoint), plan.zero, plan.offload)
    choice = memplan.fit_memory(plan, cluster, stage_mem, rows, config, floor, lambda what: True)
    out = choice.plan
    if choice.options.activation_checkpoint and not plan.activation_checkpoint:
        out = _with_checkpointing(model, out, config.replace(activation_checkpoint="all"))
    notes = out.notes + (choice.reasons if choice.options != floor else ())
    return dataclasses.replace(out, predicted_memory=tuple(r.device_total for r in choice.ranks), notes=notes)


def _with_checkpointing(model: nn.Module, plan: Plan, config: Config) -> Plan:
    """The plan with ``Config.activation_checkpoint`` resolved to module FQNs (:mod:`whale.memory.checkpointing`).

    Raises:
        CheckpointError: an entry matching no module, or one overlapping a split module.
    """
    if not config.activation_checkpoint:
        return plan
    splits = tuple(name for s in range(plan.num_stages) for name, _ in plan.split_targets(s))
    names = resolve_targets(model, config.activation_checkpoint, plan.task_graphs, splits, default_units(model))
    return dataclasses.replace(plan, activation_checkpoint=names)


def _cut_and_plan(model, world_size, config, tg_scopes, stage_of, scopes, pipelined,
                  speed_cut: hwplan.UnitCut | None, sample_batch=None) -> tuple[Plan, tuple[nn.Module, ...]]:
    """Cut the model into stages (pipelines; by ``speed_cut``'s units and on its devices when given) or
    TaskGraph name sets (one stage) and call the planner; returns the plan and the stage modules (empty for one
    stage)."""
    if not pipelined:
        name_sets = colocated_names(model, tg_scopes, scopes)
        return make_plan(summaries(model, tg_scopes, name_sets, scopes), world_size, config), ()
    leaves = split_leaves(model, scopes)
    spec = _capture_spec(config, sample_batch)
    units = speed_cut.units if speed_cut else None
    cut = cut_model(model, speed_cut.stage_of if speed_cut else stage_of, len(tg_scopes), leaves, units, spec)
    name_sets = [set(all_tensors(m)) for m in cut.modules]
    plan = make_plan(summaries(model, tg_scopes, name_sets, scopes), world_size, config,
                     stage_cuts=cut.stage_cuts, shared_params=cut.shared_params, leaf_modules=leaves,
                     chunk_positions=speed_cut.chunk_positions if speed_cut else ())
    plan = dataclasses.replace(plan, capture="export", capture_inputs=spec) if spec else plan
    if speed_cut is not None:  # the devices the placement chose for each stage (apply_hardware keeps them)
        plan = dataclasses.replace(plan, device_order=speed_cut.device_order,
                                   notes=plan.notes + ((speed_cut.note,) if speed_cut.note else ()))
    return plan, cut.modules


def _capture_spec(config, sample_batch) -> tuple:
    """Example inputs to capture the model with ``torch.export`` (empty: ``torch.fx``), per ``config.capture``.

    Raises:
        StageError: ``capture="export"`` without a sample batch.
    """
    if config.capture == "fx" or (config.capture == "auto" and (sample_batch is None or config.virtual_stages > 1)):
        return ()  # interleaved chunks are fx graphs (whale.parallel.chunks merges their module trees)
    if config.virtual_stages > 1:
        raise StageError(f"virtual_stages={config.virtual_stages} cuts its chunks from a torch.fx capture; use "
                         "Config(capture='fx') or 'auto'")
    if sample_batch is None:
        raise StageError("Config(capture='export') needs example inputs: pass sample_batch=(inputs, target) to "
                         "wh.parallelize / wh.plan_model (or use capture='fx')")
    return capture_inputs(sample_batch[0])
