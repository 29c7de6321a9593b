"""Which parameters each group reduces, and which ones this rank counts in the global gradient norm.
Pure layout from the plan and the :class:`~whale.runtime.mesh.Mesh`."""

from __future__ import annotations

from torch import nn

from whale.parallel.split_state import replicated_param_ids
from whale.plan.plan import Plan
from whale.runtime.mesh import Mesh


def sync_sets(plan: Plan, module: nn.Module, mesh: Mesh,
              split_params: set[int]) -> list[tuple[object, list[nn.Parameter]]]:
    """``[(group, params)]`` whose gradients are summed over ``group`` (``None``: no reduction):

    - parameters shared across stages (tied weights): every rank of every stage holding them;
    - split shards (``id`` in ``split_params``): the ranks holding the same shard in every replica;
    - everything else: the stage's data-parallel group (all lanes).
    """
    local = dict(module.named_parameters(remove_duplicate=False))
    taken: set[int] = set(split_params)
    tied = []
    for sp, group in zip(plan.shared_params, mesh.tied, strict=True):
        param = next((local[n] for n in sp.names if n in local), None)
        if param is not None and mesh.stage in sp.stages:
            taken.add(id(param))
            tied.append((group, [param]))
    own = [p for p in module.parameters() if id(p) not in taken]
    shards = [p for p in module.parameters() if id(p) in split_params]
    return [(mesh.lanes, own), *tied] + ([(mesh.shard_replicas, shards)] if shards else [])


def norm_owned_params(plan: Plan, module: nn.Module, mesh: Mesh, split_params: set[int]) -> list[nn.Parameter]:
    """Parameters whose squared gradients this rank adds to the global norm, so that every distinct
    parameter (or shard) counts exactly once over the world: replicated ones on lane 0, split shards in
    replica 0, parameters shared across stages on the first stage holding them. A parameter of a split module
    that is whole on every rank of its group (a row-parallel bias: ``shard_layout()`` says ``None``) counts
    once per group, on lane 0."""
    local = dict(module.named_parameters(remove_duplicate=False))
    not_mine: set[int] = set()
    for sp in plan.shared_params:
        if mesh.stage in sp.stages and mesh.stage != min(sp.stages):
            not_mine |= {id(local[nm]) for nm in sp.names if nm in local}
    out, whole_in_group = [], replicated_param_ids(module)
    for p in module.parameters():
        if id(p) in not_mine:
            continue
        shard_positions = 1 if id(p) in whole_in_group else plan.width_of(mesh.stage)
        owner = mesh.lane < shard_positions if id(p) in split_params else mesh.lane == 0
        if owner:
            out.append(p)
    return out
