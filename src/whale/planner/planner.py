"""The planner: a pure function from TaskGraph summaries, a world size and a config to a :class:`Plan`.

It resolves each TaskGraph's device count (pipeline stages may differ in width; see :mod:`whale.plan.layout`),
the nested data-parallel degree K and the per-lane load shares (per stage when the widths differ); the
stage cut and shared parameters come in from the front end (:mod:`whale.frontend`), the hardware-aware
balancing is applied afterwards by :func:`whale.planner.hardware.apply_hardware`. It touches no process group and
no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from whale.config import Config
from whale.plan.plan import Kind, NestedScope, Plan, PlanError, SharedParam, StageCut, TaskGraph


@dataclass(frozen=True)
class TaskGraphSummary:
    """What the annotations and the stage cut say about one TaskGraph, before devices are assigned.

    Attributes:
        kind: ``"replicate"`` or ``"split"``.
        device_count: devices requested per replica (``None`` = default, see :func:`make_plan`).
        modules: module FQNs it holds (compressed).
        num_params: parameter elements it holds.
        nested: nested scopes, e.g. a ``split`` inside a ``replicate``.
    """

    kind: Kind
    device_count: int | None
    modules: tuple[str, ...] = ()
    num_params: int = 0
    nested: tuple[NestedScope, ...] = ()


def _scope_text(tgs: list[TaskGraphSummary], counts: list[int]) -> str:
    names = " + ".join(f"{tg.kind}({c})" for tg, c in zip(tgs, counts, strict=True))
    if len(counts) == 1:
        return f"{names} needs {counts[0]} devices per replica"
    return f"{names} need {'+'.join(map(str, counts))} = {sum(counts)} devices per replica"


def is_colocated(tgs: list[TaskGraphSummary], num_micro_batch: int) -> bool:
    """TaskGraphs share devices (run one after another, bridged) when a split TaskGraph stands beside others
    and there is no micro-batching (Whale's replicate backbone + split head); otherwise several TaskGraphs
    are pipeline stages on devices of their own."""
    return len(tgs) > 1 and num_micro_batch == 1 and any(tg.kind == "split" for tg in tgs)


def _colocated_counts(tgs: list[TaskGraphSummary], world_size: int) -> list[int]:
    counts = [tg.device_count or world_size for tg in tgs]
    if len(set(counts)) != 1:
        raise PlanError(
            f"{' + '.join(f'{tg.kind}({c})' for tg, c in zip(tgs, counts, strict=True))} share their devices "
            "(a split beside other TaskGraphs without micro-batching), so they need the same device count; "
            "give them equal counts (or None for all devices)")
    return counts


def resolve_device_counts(tgs: list[TaskGraphSummary], world_size: int,
                          colocated: bool = False) -> tuple[list[int], int]:
    """Devices per replica for each TaskGraph and the nested data-parallel degree K.

    ``device_count=None`` means all devices when there is one TaskGraph or they are colocated, and 1 device
    per replica when there are several stages (nested data parallelism then copies the pipeline over the rest
    of the world). Pipeline stages may have different device counts (e.g. ``replicate(2)`` then
    ``replicate(1)`` on 3 ranks): one replica then needs their sum, and a batch bridge re-splits each
    micro-batch's rows between a stage of n lanes and one of m (:mod:`whale.plan.layout`).

    Raises:
        PlanError: the world size is not a multiple of the devices one replica needs (the sum of the stages'
            counts); colocated TaskGraphs with different device counts.
    """
    if colocated:
        counts = _colocated_counts(tgs, world_size)
        if world_size % counts[0]:
            raise PlanError(f"{_scope_text(tgs[:1], counts[:1])} but world size {world_size} is not a "
                            f"multiple of {counts[0]}; launch a multiple of {counts[0]} processes")
        return counts, world_size // counts[0]
    if len(tgs) == 1:
        counts = [tgs[0].device_count or world_size]
    else:
        counts = [tg.device_count or 1 for tg in tgs]
    per_replica = sum(counts)
    if world_size % per_replica:
        lo = per_replica * max(1, world_size // per_replica)
        raise PlanError(
            f"{_scope_text(tgs, counts)} but world size {world_size} is not a multiple of {per_replica}; "
            f"launch {lo} or {lo + per_replica} processes, or change the device counts"
        )
    return counts, world_size // per_replica


def make_plan(
    tgs: list[TaskGraphSummary],
    world_size: int,
    config: Config,
    stage_cuts: tuple[StageCut, ...] = (),
    shared_params: tuple[SharedParam, ...] = (),
    leaf_modules: tuple[str, ...] = (),
    chunk_positions: tuple[int, ...] = (),
) -> Plan:
    """Build the plan (pure function).

    Args:
        tgs: TaskGraphs in model order (each a pipeline stage when there are several).
        world_size: number of ranks.
        config: validated :class:`Config` (micro-batches, schedule, load shares).
        stage_cuts: per stage, what it owns in the traced model (pipelines only).
        shared_params: parameters held by several stages (tied weights).
        leaf_modules: modules the stage cut traced as single calls.
        chunk_positions: interleaved only: the stage of each chunk when the stages hold different chunk counts
            (:attr:`Plan.chunk_positions`; empty = round-robin).

    Stages of different widths each get their own lane weights (``stage_lane_weights``); ``load_shares``
    then gives one share per rank, stage by stage (stage 0's ``K*n_0`` lanes first).

    Raises:
        PlanError: device counts do not fit the world size; ``load_shares`` has the wrong length; a split in
            a pipeline whose stages have different device counts.
    """
    if world_size < 1:
        raise PlanError(f"world size {world_size} must be >= 1")
    if not tgs:
        raise PlanError("the model has no TaskGraphs (no parameters?)")
    colocated, v = is_colocated(tgs, config.num_micro_batch), config.virtual_stages
    counts, k, where = _chunk_devices(tgs, world_size, colocated, v, chunk_positions)
    shared_params = _stage_ties(shared_params, where) if v > 1 else shared_params
    _check_nested(tgs, counts)
    lane_weights, stage_lane_weights = _lane_weights(config, counts, k, colocated)
    task_graphs = tuple(TaskGraph(i, tg.kind, c, tg.modules, tg.num_params, tg.nested)
                        for i, (tg, c) in enumerate(zip(tgs, counts, strict=True)))
    return Plan(
        world_size=world_size,
        task_graphs=task_graphs,
        num_replicas=k,
        num_micro_batch=config.num_micro_batch,
        schedule=config.schedule,
        lane_weights=lane_weights,
        stage_lane_weights=stage_lane_weights,
        shared_params=tuple(shared_params),
        stage_cuts=tuple(stage_cuts),
        leaf_modules=tuple(leaf_modules),
        colocated=colocated,
        zero=config.zero,
        precision=config.precision,
        offload=config.offload,
        virtual_stages=v,
        chunk_positions=tuple(chunk_positions),
        sequence_parallel=config.sequence_parallel,
    )


def _chunk_devices(tgs: list[TaskGraphSummary], world_size: int, colocated: bool, v: int,
                   chunk_positions: tuple[int, ...]) -> tuple[list[int], int, tuple[int, ...]]:
    """``(devices per replica of each TaskGraph, replicas, the stage of each TaskGraph)``: the first ``p = len / v``
    TaskGraphs are the stages (:func:`resolve_device_counts`); TaskGraph (chunk) c runs on the devices of its stage
    (``chunk_positions[c]``, or ``c % p``).

    Raises:
        PlanError: ``v`` chunks per stage that the TaskGraphs cannot make (a colocated model, a count that is not
            a multiple of v, fewer than two stages); the device counts' own errors.
    """
    if v > 1 and (colocated or len(tgs) % v or len(tgs) < 2 * v):
        raise PlanError(f"virtual_stages={v} runs {v} chunks per pipeline stage, but the model has {len(tgs)} stage "
                        f"scope(s); annotate p * {v} scopes for p >= 2 stages (e.g. {2 * v}), or use virtual_stages=1")
    p = len(tgs) // v
    counts, k = resolve_device_counts(tgs[:p], world_size, colocated)
    where = tuple(chunk_positions) or tuple(c % p for c in range(len(tgs)))
    return [counts[where[c]] for c in range(len(tgs))], k, where


def _stage_ties(shared: tuple[SharedParam, ...], where: tuple[int, ...]) -> tuple[SharedParam, ...]:
    """Ties across the chunks of an interleaved cut as ties across pipeline stages (chunk c on stage
    ``where[c]``); a tie whose chunks all run on one stage is one tensor there, no tie."""
    out = []
    for sp in shared:
        held = tuple(sorted({where[c] for c in sp.stages}))
        if len(held) > 1:
            out.append(SharedParam(sp.names, held))
    return tuple(out)


def _check_nested(tgs: list[TaskGraphSummary], counts: list[int]) -> None:
    for tg, c in zip(tgs, counts, strict=True):
        for nest in tg.nested:
            want = nest.device_count
            if want is not None and want != c:
                raise PlanError(
                    f"{nest.kind}({want}) nested in {tg.kind}({c}) must span the same {c} devices (a sharded "
                    f"operator inside each replica uses the replica's devices); use {nest.kind}({c}) or "
                    f"{nest.kind}()")


def _lane_weights(config: Config, counts: list[int], k: int,
                  colocated: bool) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """``(lane_weights, stage_lane_weights)`` from ``config.load_shares`` (equal shares when unset): one list
    for stages of one width, one per stage otherwise (the shares given stage by stage)."""
    widths = counts[:1] if colocated else counts
    lanes = [k * n for n in widths]
    given = list(config.load_shares) if config.load_shares else None
    if len(set(widths)) == 1:
        if given is not None and len(given) != lanes[0]:
            raise PlanError(f"load_shares has {len(given)} entries but the plan has {lanes[0]} data-parallel lanes "
                            f"({k} replica(s) x {widths[0]} devices per stage); give one share per lane")
        return tuple(given or [1.0] * lanes[0]), ()
    if given is not None and len(given) != sum(lanes):
        raise PlanError(f"load_shares has {len(given)} entries but the stages of widths {widths} have "
                        f"{'+'.join(map(str, lanes))} = {sum(lanes)} data-parallel lanes; give one share per lane, "
                        "stage by stage (stage 0's lanes first)")
    given = given or [1.0] * sum(lanes)
    starts = [sum(lanes[:s]) for s in range(len(lanes))]
    return (), tuple(tuple(given[a:a + n]) for a, n in zip(starts, lanes, strict=True))
