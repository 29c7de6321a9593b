"""Process groups a plan needs, and which parameters each group reduces. Pure layout from the plan; every
rank creates every group in the same order (``dist.new_group`` is collective)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from whale.plan.plan import Plan


def rank_sets(plan: Plan, shared_stages: list[list[int]]) -> list[tuple[int, ...]]:
    """Every rank set the plan communicates over, in a fixed order: stage data-parallel groups, split groups
    (per stage and replica), shard-replica groups (per stage and shard), shared-parameter groups."""
    sets = [tuple(plan.stage_ranks(s)) for s in range(plan.num_stages)]
    for s in range(plan.num_stages):
        if any(tg.has_split for tg in plan.stage_task_graphs(s)):
            sets += [tuple(plan.split_group_ranks(s, k)) for k in range(plan.num_replicas)]
            sets += [tuple(plan.shard_replica_ranks(s, j)) for j in range(plan.stage_width)]
    for stages in shared_stages:
        sets.append(tuple(sorted(r for s in stages for r in plan.stage_ranks(s))))
    return sets


def build_groups(plan: Plan, shared_stages: list[list[int]]) -> dict[tuple[int, ...], object]:
    """``{ranks: ProcessGroup}`` for every set of :func:`rank_sets` (``None`` for sets of one rank)."""
    groups: dict[tuple[int, ...], object] = {}
    for ranks in rank_sets(plan, shared_stages):
        if ranks not in groups:
            groups[ranks] = dist.new_group(list(ranks)) if len(ranks) > 1 else None
    return groups


def sync_sets(plan: Plan, module: nn.Module, stage: int, lane: int, groups: dict, shared_stages: list[list[int]],
              split_params: set[int]) -> list[tuple[object, list[nn.Parameter]]]:
    """``[(group, params)]`` whose gradients are summed over ``group``:

    - parameters shared across stages (tied weights): every rank of every stage holding them;
    - split shards (``id`` in ``split_params``): the ranks holding the same shard in every replica;
    - everything else: the stage's data-parallel group (all lanes).
    """
    if not groups:
        return [(None, list(module.parameters()))]
    local = dict(module.named_parameters(remove_duplicate=False))
    taken: set[int] = set(split_params)
    out = []
    for names, stages in zip(plan.shared_params, shared_stages, strict=True):
        if stage not in stages:
            continue
        ranks = tuple(sorted(r for s in stages for r in plan.stage_ranks(s)))
        param = next(local[n] for n in names if n in local)
        taken.add(id(param))
        out.append((groups[ranks], [param]))
    own = [p for p in module.parameters() if id(p) not in taken]
    out.insert(0, (groups[tuple(plan.stage_ranks(stage))], own))
    shards = [p for p in module.parameters() if id(p) in split_params]
    if shards:
        shard = lane % plan.stage_width
        out.append((groups[tuple(plan.shard_replica_ranks(stage, shard))], shards))
    return out


def norm_owned_params(plan: Plan, module: nn.Module, stage: int, lane: int, shared_stages: list[list[int]],
                      split_params: set[int]) -> list[nn.Parameter]:
    """Parameters whose squared gradients this rank adds to the global norm, so that every distinct
    parameter (or shard) counts exactly once over the world: replicated ones on lane 0, split shards in
    replica 0, parameters shared across stages on the first stage holding them."""
    n = plan.stage_width
    local = dict(module.named_parameters(remove_duplicate=False))
    not_mine: set[int] = set()
    for names, stages in zip(plan.shared_params, shared_stages, strict=True):
        if stage in stages and stage != min(stages):
            not_mine |= {id(local[nm]) for nm in names if nm in local}
    out = []
    for p in module.parameters():
        if id(p) in not_mine:
            continue
        owner = lane < n if id(p) in split_params else lane == 0
        if owner:
            out.append(p)
    return out
