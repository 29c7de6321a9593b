"""Hardware-aware expert placement for expert parallelism (an MoE layer under ``split``): how many of the E
experts each device of a split group holds.

Each expert costs its device the same work per token it receives; with tokens spread evenly over experts (what
the load-balancing loss drives routing towards), device i's expert time is ``c_i / speed_i`` for ``c_i`` experts.
:func:`expert_counts` gives whole counts minimizing the slowest device, ``max_i c_i / speed_i``, exactly, with
every device holding at least one expert (experts are not replicated) and, with memory given, each within its
memory: ``mem_fixed_i + c_i * bytes_per_expert <= mem_capacity_i``. It is Whale's one apportionment
(:func:`whale.plan.shares.min_max_shares`, exact for this min-max), so the counts equal the shard sizes the
runtime cuts the stacked expert tensors into (:func:`whale.parallel.split_ops.shard_sizes` of the plan's shard
weights) -- the plan stores the weights, and printing and running derive the same counts from them.

Source: the Whale paper's intra-TaskGraph balancing (Jia et al., USENIX ATC 2022, §3.3) applied to experts as
the units of a split; experts as the unit of expert parallelism as in GShard (Lepikhin et al. 2020).
"""

from __future__ import annotations

import dataclasses

from whale.plan.plan import Plan, PlanError
from whale.plan.shares import whole_shares
from whale.planner.balance import InfeasiblePlanError, _balance
from whale.planner.steptime.cost import memory_per_device
from whale.units import format_bytes

__all__ = ["expert_counts", "expert_memory_counts", "ExpertPlacementError"]


class ExpertPlacementError(PlanError):
    """The experts cannot be placed on the devices (more devices than experts)."""


def expert_counts(num_experts: int, speeds: list[float] | tuple[float, ...],
                  mem_capacity: list[float] | None = None, mem_fixed: list[float] | None = None,
                  bytes_per_expert: float = 0.0) -> list[int]:
    """Experts per device of a split group, minimizing ``max_i counts_i / speeds_i`` exactly (module docstring).

    Args:
        num_experts: E, the experts of the layer.
        speeds: relative speed of each device of the group (FLOP/s or the plan's shard weights; > 0).
        mem_capacity: bytes each device may use (``None``: memory not limiting).
        mem_fixed: bytes each device needs whatever its experts (default 0).
        bytes_per_expert: bytes one expert adds (its parameters, gradients and optimizer state).

    Returns:
        Whole counts, each >= 1, adding up to ``num_experts``, in device order.

    Raises:
        ExpertPlacementError: more devices than experts (naming both and the fix).
        InfeasiblePlanError: the experts do not fit the devices' memory (naming the device and bytes).
        ValueError: bad speeds or memory values.
    """
    n = len(speeds)
    if n > num_experts:
        raise ExpertPlacementError(
            f"cannot place {num_experts} experts on {n} devices: expert parallelism puts at least one whole "
            f"expert on each device; use at most {num_experts} devices for the split (nest it in a "
            f"replicate({num_experts}) so that nested data parallelism copies the group), or more experts")
    if mem_capacity is None:
        return whole_shares(num_experts, list(speeds), min_share=1)
    fixed = [0.0] * n if mem_fixed is None else list(mem_fixed)
    try:
        return _balance(num_experts, [float(s) for s in speeds], list(mem_capacity), fixed, float(bytes_per_expert),
                        1, "expert")
    except InfeasiblePlanError as e:
        why = str(e).split(". Use more devices")[0]
        raise InfeasiblePlanError(
            f"cannot place {num_experts} experts of {format_bytes(bytes_per_expert)} each on {n} devices within "
            f"their memory: {why}. Use more devices for the split, devices with more memory, or fewer or smaller "
            "experts", e.device, e.need_bytes, e.capacity_bytes) from None


def _scopes(plan: Plan):
    """``(stage, path, scope)`` of every split scope (a split TaskGraph or a split nested in one)."""
    for i, tg in enumerate(plan.task_graphs):
        stage = 0 if plan.colocated else tg.index
        if tg.kind == "split":
            yield stage, (i, None), tg
        for j, nest in enumerate(tg.nested):
            if nest.kind == "split":
                yield stage, (i, j), nest


def expert_memory_counts(plan: Plan, capacity: list[float]) -> Plan:
    """``plan`` with each expert-parallel split's experts per device capped by device memory (pure function).

    Group position j of a stage may use the least ``capacity`` (bytes, per rank) of the ranks at j over the
    replicas. One expert costs its fp32 parameters, gradients and AdamW state (:func:`whale.planner.steptime.cost.
    memory_per_device` of 4 + 4 + 8 bytes per element); the rest of the model is not counted. The split scopes
    of a stage are placed in model order, each within what the earlier ones left (``mem_fixed``): a scope whose
    modules are all MoE layers of one expert count E gets :func:`expert_counts` of its shard weights within that
    memory (one expert slot holding that expert of every layer of the scope), and where those differ from the
    weights' own counts its shard weights become the counts (:func:`whale.plan.shares.whole_shares` of counts
    adding up to E gives back those counts, so running and printing derive them again); in a scope mixing MoE
    layers with other modules each layer is only checked, at its weights' counts.

    Raises:
        InfeasiblePlanError: the experts do not fit the devices' memory (naming the device and the bytes).
    """
    if not plan.moe_layers or not plan.uniform_width or plan.stage_width <= 1:
        return plan
    n, layers = plan.stage_width, {m.module: m for m in plan.moe_layers}
    tgs, used = list(plan.task_graphs), {}
    for stage, (i, j), scope in _scopes(plan):
        cap = [min(capacity[plan.rank_of(stage, k * n + p)] for k in range(plan.num_replicas)) for p in range(n)]
        counts = _place_scope(scope, [layers[m] for m in scope.modules if m in layers], cap,
                              used.setdefault(stage, [0.0] * n))
        if counts is not None:
            new = dataclasses.replace(scope, shard_weights=tuple(float(c) for c in counts))
            tgs[i] = new if j is None else dataclasses.replace(
                tgs[i], nested=tuple(new if q == j else x for q, x in enumerate(tgs[i].nested)))
    notes = () if tuple(tgs) == plan.task_graphs else (
        "experts per device capped by device memory (parameters, gradients and AdamW state of the experts)",)
    return dataclasses.replace(plan, task_graphs=tuple(tgs), notes=plan.notes + notes)


def _place_scope(scope, mine: list, cap: list[float], used: list[float]) -> list[int] | None:
    """Experts per position for one split scope's MoE layers ``mine`` within ``cap`` minus ``used`` (bytes per
    position, updated in place); the new counts when memory changed them, else ``None``."""
    n = len(cap)
    weights = list(scope.shard_weights) or [1.0] * n
    if not mine:
        return None
    if len(mine) < len(scope.modules) or len({m.num_experts for m in mine}) > 1:
        for m in mine:  # checked at the counts the runtime will use
            each = _expert_bytes(m.expert_params)
            for p, c in enumerate(expert_counts(m.num_experts, weights)):
                used[p] += c * each
                if used[p] > cap[p]:
                    raise InfeasiblePlanError(
                        f"the MoE layer {m.module!r} puts {c} expert(s) of {format_bytes(each)} on device {p} of its "
                        f"split group, which then needs {format_bytes(used[p])} for experts but has "
                        f"{format_bytes(cap[p])}; build the MoE layer in a split scope of its own (its experts "
                        "per device then follow memory too), use devices with more memory, or fewer or smaller "
                        "experts", p, used[p], cap[p])
        return None
    per_slot = sum(_expert_bytes(m.expert_params) for m in mine)
    counts = expert_counts(mine[0].num_experts, weights, cap, used, per_slot)
    for p in range(n):
        used[p] += counts[p] * per_slot
    return counts if counts != expert_counts(mine[0].num_experts, weights) else None


def _expert_bytes(elements: int) -> float:
    """fp32 parameters, gradients and AdamW's two moments of one expert, bytes."""
    return memory_per_device(4.0 * elements, 4.0 * elements, 8.0 * elements)
