"""``whale.parallelize``: annotations -> TaskGraphs -> stage cut -> plan -> an :class:`Engine` for this rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from whale.annotation import Scope, default_strategy, tensor_scopes, top_level
from whale.cluster import ClusterSpec
from whale.config import Config
from whale.parallel.stages import build_stages
from whale.plan.hardware import apply_hardware, is_heterogeneous
from whale.plan.plan import Plan
from whale.plan.planner import TaskGraphSummary, is_colocated, make_plan
from whale.runtime import hwplan
from whale.runtime.context import Context, current_context, resolve_cluster
from whale.runtime.engine import Engine


def compress_names(names: set[str], all_names: list[str]) -> list[str]:
    """Shortest list of module prefixes covering exactly ``names`` among ``all_names`` (dotted FQNs).

    ``{"blocks.0.a.weight", "blocks.0.a.bias"}`` of a model whose ``blocks.0`` holds only those gives
    ``["blocks.0"]``.
    """
    out: list[str] = []
    for name in sorted(names, key=all_names.index):
        parts = name.split(".")
        best = name
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            under = [n for n in all_names if n.startswith(prefix + ".")]
            if all(n in names for n in under):
                best = prefix
                break
        if best not in out:
            out.append(best)
    return out


def _task_graph_scopes(model: nn.Module) -> tuple[list[Scope], dict[int, int], dict[str, Scope]]:
    scopes = tensor_scopes(model)
    tops: dict[int, Scope] = {}
    for s in scopes.values():
        tops.setdefault(top_level(s).uid, top_level(s))
    ordered = [tops[u] for u in sorted(tops)] or [default_strategy()]
    index = {s.uid: i for i, s in enumerate(ordered)}
    stage_of: dict[int, int] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            fqn = f"{mname}.{pname}" if mname else pname
            if t is not None and fqn in scopes:
                stage_of.setdefault(id(t), index[top_level(scopes[fqn]).uid])
    return ordered, stage_of, scopes


def _tensor_names(mod: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(mod.named_parameters(remove_duplicate=False))
    out.update(mod.named_buffers(remove_duplicate=False))
    return out


def _colocated_names(model: nn.Module, tg_scopes: list[Scope], scopes: dict[str, Scope]) -> list[set[str]]:
    """Tensor names per colocated TaskGraph; unannotated tensors join the first replicate TaskGraph."""
    sets: list[set[str]] = [set() for _ in tg_scopes]
    index = {s.uid: i for i, s in enumerate(tg_scopes)}
    home = next((i for i, s in enumerate(tg_scopes) if s.kind == "replicate"), 0)
    for name in _tensor_names(model):
        scope = scopes.get(name)
        sets[index[top_level(scope).uid] if scope is not None else home].add(name)
    return sets


def _summaries(model, tg_scopes, name_sets: list[set[str]], scopes) -> list[TaskGraphSummary]:
    tensors = _tensor_names(model)
    all_names = list(tensors)
    out = []
    for scope, names in zip(tg_scopes, name_sets, strict=True):
        nested: dict[int, dict] = {}
        for n in sorted(names):
            s = scopes.get(n)
            if s is not None and s.parent is not None and top_level(s).uid == scope.uid:
                entry = nested.setdefault(s.uid, {"kind": s.kind, "device_count": s.device_count, "names": set()})
                entry["names"].add(n)
        nest = [{"kind": e["kind"], "device_count": e["device_count"],
                 "modules": compress_names(e["names"], all_names)} for e in nested.values()]
        params = {id(tensors[n]): tensors[n] for n in names if isinstance(tensors[n], nn.Parameter)}
        numel = sum(p.numel() for p in params.values())
        out.append(TaskGraphSummary(scope.kind, scope.device_count, compress_names(names, all_names), numel, nest))
    return out


def parallelize(
    model: nn.Module,
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer | Callable,
    ctx: Context | None = None,
    sample_batch=None,
) -> Engine:
    """Plan and set up hybrid-parallel training of ``model`` on this rank.

    Args:
        model: the local ``nn.Module``, built identically on every rank, with ``replicate``/``split`` scopes
            (or none: the default strategy over all devices). Several top-level TaskGraphs become pipeline
            stages (the model must then be traceable by ``torch.fx.symbolic_trace``).
        loss_fn: ``loss_fn(output, target) -> scalar``, the MEAN over the samples of the batch it is given
            (like ``F.cross_entropy`` with default reduction); samples must weigh equally.
        optimizer: a callable ``params -> Optimizer`` (preferred) or an optimizer over ``model.parameters()``
            (rebuilt over this rank's parameters, keeping its param groups' options).
        ctx: from :func:`whale.init`; defaults to the latest one.
        sample_batch: a global batch ``(inputs, target)`` like those given to ``step``: lets the planner
            profile the model (fake tensors, no compute) for memory-constrained shares and, on a mixed
            cluster, speed-balanced pipeline cuts.

    Returns:
        An :class:`Engine` with ``step``, ``eval_step``, ``state_dict``, checkpointing and ``plan``.

    Raises:
        ValueError: the model has no parameters.
        PlanError: device counts do not fit the world size (and other plan errors).
        StageError: the model cannot be cut into pipeline stages.
        SplitError: a module under ``split`` has no sharding rule.
    """
    ctx = ctx or current_context()
    plan, stage_modules, shared_stages = analyze(model, ctx.world_size, ctx.config, ctx.cluster, sample_batch)
    stage, _ = plan.coords(ctx.rank)
    return Engine(plan, stage_modules[stage], loss_fn, optimizer, ctx, shared_stages=shared_stages)


def analyze(model: nn.Module, world_size: int, config: Config, cluster: ClusterSpec | None = None,
            sample_batch=None) -> tuple[Plan, list[nn.Module], list[list[int]]]:
    """Annotations -> TaskGraphs -> stage modules -> plan, without touching any process group.

    With a ``cluster`` and ``config.hardware_aware``, the plan is balanced for the devices (DESIGN.md §5);
    with a ``sample_batch`` too, the model is profiled on fake tensors so that shares respect memory and, on a
    mixed cluster, the pipeline is re-cut by device speed (the annotations then fix only the stage count).

    Returns ``(plan, stage_modules, shared_stages)``; ``shared_stages[i]`` lists the stages holding the i-th
    entry of ``plan.shared_params``.
    """
    if not any(True for _ in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to train or parallelize")
    tg_scopes, stage_of, scopes = _task_graph_scopes(model)
    kinds = [TaskGraphSummary(s.kind, s.device_count) for s in tg_scopes]
    pipelined = len(tg_scopes) > 1 and not is_colocated(kinds, config.num_micro_batch)
    aware = cluster is not None and config.hardware_aware
    prof = hwplan.profile(model, sample_batch) if aware and sample_batch is not None else None
    stage_layers: list[list[str]] = []
    if pipelined and prof is not None and is_heterogeneous(cluster):
        layout = make_plan(kinds, world_size, config)
        cut = hwplan.hardware_cut(model, prof, layout, cluster, config, hwplan.sample_rows(sample_batch))
        stage_of, stage_layers = cut.stage_of, cut.stage_layers
    plan, stage_modules, shared_stages = _cut_and_plan(model, world_size, config, tg_scopes, stage_of, scopes,
                                                       pipelined)
    plan.stage_layers = stage_layers
    if aware:
        memory = None
        if prof is not None:
            memory = hwplan.memory_model(prof, stage_modules, hwplan.sample_rows(sample_batch))
            plan.stage_flops = hwplan.stage_flops(prof, stage_modules)
        plan = apply_hardware(plan, cluster, memory)
    return plan, stage_modules, shared_stages


def _cut_and_plan(model, world_size, config, tg_scopes, stage_of, scopes, pipelined):
    if pipelined:
        split_names = {n for n, sc in scopes.items() if sc.kind == "split"}
        leaves = set(compress_names(split_names, list(_tensor_names(model))))
        graphs = build_stages(model, stage_of, len(tg_scopes), leaves)
        stage_modules, shared, shared_stages = graphs.modules, graphs.shared, graphs.shared_stages
        name_sets = [set(_tensor_names(m)) for m in stage_modules]
    else:
        stage_modules, shared, shared_stages = [model], [], []
        name_sets = _colocated_names(model, tg_scopes, scopes)
    plan = make_plan(_summaries(model, tg_scopes, name_sets, scopes), world_size, config, shared)
    return plan, stage_modules, shared_stages


def plan_model(model: nn.Module, world_size: int, config: Config | None = None, sample_batch=None) -> Plan:
    """The plan Whale would run ``model`` with on ``world_size`` ranks; no processes needed.

    ``config.cluster`` (a spec or YAML path) makes it hardware-aware; ``sample_batch`` adds the memory model
    and, on mixed clusters, the speed-balanced pipeline cut.

    Raises:
        ValueError, PlanError, StageError, ClusterError: as :func:`parallelize`.
    """
    config = config or Config()
    cluster = resolve_cluster(config.cluster, world_size) if config.cluster is not None else None
    return analyze(model, world_size, config, cluster, sample_batch)[0]
