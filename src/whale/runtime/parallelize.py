"""``whale.parallelize``: a plan (made here by the front end, or given) and an :class:`Engine` for this rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from whale.frontend import plan_with_stages
from whale.plan.plan import Plan, PlanError
from whale.runtime.context import Context, current_context
from whale.runtime.engine import Engine


def parallelize(
    model: nn.Module,
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer | Callable,
    ctx: Context | None = None,
    sample_batch=None,
    plan: Plan | None = None,
) -> Engine:
    """Set up hybrid-parallel training of ``model`` on this rank.

    Args:
        model: the local ``nn.Module``, built identically on every rank, with ``replicate``/``split`` scopes
            (or none: the default strategy over all devices). Several top-level TaskGraphs become pipeline
            stages, cut from the model's graph: captured with ``torch.export`` when ``sample_batch`` is given
            (Hugging Face models as they are), else with ``torch.fx.symbolic_trace`` (``Config.capture``).
        loss_fn: ``loss_fn(output, target) -> scalar``, the MEAN over the samples of the batch it is given
            (like ``F.cross_entropy`` with default reduction; samples weigh equally), or a
            :class:`whale.SumOverCount` such as ``wh.token_cross_entropy()`` (a sum over terms normalised by
            the terms of the whole global batch: token-mean language-model losses).
        optimizer: a fresh optimizer over ``model.parameters()`` with any param groups (kept: the engine
            re-points its groups at this rank's parameters, so LR schedulers attached to it drive training),
            or a callable ``params -> Optimizer``.
        ctx: from :func:`whale.init`; defaults to the latest one.
        sample_batch: a global batch ``(inputs, target)`` like those given to ``step`` (inputs: a tensor, a
            tuple, or a dict of keyword arguments): the example a pipeline is captured from with
            ``torch.export`` (shapes and dtypes only), and lets the planner profile the model (fake tensors, no
            compute) for memory-constrained shares and, on a mixed cluster, speed-balanced pipeline cuts.
            Ignored with ``plan``.
        plan: run this plan (e.g. ``Plan.from_json(open("plan.json").read())`` written by ``whale plan --out``)
            instead of planning here; nothing is re-planned.

    Returns:
        An :class:`Engine` with ``step``, ``eval_step``, checkpointing and ``plan``.

    Raises:
        ValueError: the model has no parameters; a plan for another world size.
        PlanError: device counts do not fit the world size (and other plan errors).
        StageError: the model cannot be cut into pipeline stages, or does not match the given plan's cut.
        SplitError: a module under ``split`` has no sharding rule.
    """
    ctx = ctx or current_context()
    stages: tuple = ()
    if plan is None:  # the stage modules the front end cut are run as they are (no second capture)
        plan, stages = plan_with_stages(model, ctx.world_size, ctx.config, sample_batch, cluster=ctx.cluster,
                                        loss_fn=loss_fn)
    else:
        check_plan_fits(plan, ctx)
    return Engine(model, plan, loss_fn, optimizer, ctx, stages=stages)


def check_plan_fits(plan: Plan, ctx: Context) -> None:
    """A given plan must agree with the job it runs in: world size, the config's micro-batches and schedule,
    and the cluster's devices (a plan made for another cluster would run its shares on the wrong devices).

    Raises:
        PlanError: naming both values and the fix.
    """
    cfg = ctx.config
    fix = "make the plan with this job's settings (whale plan --model MODULE:FACTORY --world {world} {flag} --out " \
        "PLAN.json) or change them"
    for what, planned, here, flag in (
            ("world size", plan.world_size, ctx.world_size, ""),
            ("num_micro_batch", plan.num_micro_batch, cfg.num_micro_batch, f"--micro-batches {cfg.num_micro_batch}"),
            ("schedule", plan.schedule, cfg.schedule, f"--schedule {cfg.schedule}"),
            ("precision", plan.precision, cfg.precision, f"--precision {cfg.precision}"),
            ("offload", plan.offload, cfg.offload, f"--offload {cfg.offload}")):
        if cfg.auto and what in ("num_micro_batch", "schedule", "offload"):
            continue  # chosen by the search (Config(auto=True))
        if planned != here:
            how = fix.format(world=ctx.world_size, flag=flag or "...").replace("  ", " ")
            raise PlanError(f"the plan was made for {what} {planned!r} but this job has {here!r}; {how}")
    fix = fix.format(world=ctx.world_size, flag="--cluster SPEC.yaml" if ctx.cluster is not None else "...")
    if ctx.cluster is None:
        fix += " (without --cluster, or give this job the plan's cluster: Config(cluster=...))"
    devices = tuple(d.name for d in ctx.cluster.devices()) if ctx.cluster is not None else ()
    if plan.devices and devices != plan.devices:
        raise PlanError(f"the plan was made for devices {list(plan.devices)} but this job runs on "
                        f"{list(devices) or 'no cluster spec (identical CPU ranks)'}; {fix}")
