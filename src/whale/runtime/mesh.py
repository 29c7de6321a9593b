"""The process groups a plan needs, for this rank.

The regular rank grid ``[S, K, n]`` of :meth:`whale.plan.plan.Plan.rank_grid` is a ``DeviceMesh`` with axes
``pp`` (pipeline stage), ``dp`` (nested replica) and ``tp`` (device within a stage: the split group). A stage's
data-parallel group (every lane of the stage) is the flattened ``(dp, tp)`` sub-mesh, as torchtitan flattens its
data-parallel axes. Tied parameters held by several stages need groups across stages that no mesh axis gives,
so they get their own ``dist.new_group`` (every rank creates every group, in the plan's order). Stages of
different widths form no regular grid: each stage's data-parallel group is then a ``dist.new_group`` of its
ranks (every rank creates every stage's group, in stage order), and there is no split group (the plan refuses
split in such pipelines).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from whale.plan.plan import Plan


def _or_none(group):
    """``None`` for a group of one rank (nothing to communicate)."""
    return group if group is not None and dist.get_world_size(group) > 1 else None


class Mesh:
    """This rank's groups under ``plan`` (collective to build: every rank constructs it).

    Attributes:
        stage, lane: this rank's coordinates.
        lanes: the group of every lane of this stage (gradients of replicated parameters are summed over it).
        split_group: this replica's devices of this stage (shards of a split module live on them).
        shard_replicas: the ranks holding this rank's shard in every replica (split gradients summed over it).
        tied: per :attr:`Plan.shared_params` entry, the group of every rank of every stage holding it (``None``
            where this rank holds none).

    Each group is ``None`` when it has one rank, and all are ``None`` in a world of one.
    """

    def __init__(self, plan: Plan, rank: int, device_type: str = "cpu") -> None:
        self.stage, self.lane = plan.coords(rank)
        self.lanes = self.split_group = self.shard_replicas = None
        self.tied: list = [None] * len(plan.shared_params)
        self.device_mesh: DeviceMesh | None = None
        if plan.world_size == 1:
            return
        if plan.uniform_width:
            grid = torch.tensor(plan.rank_grid())
            self.device_mesh = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp", "tp"))
            self.lanes = _or_none(self.device_mesh["dp", "tp"]._flatten("lanes").get_group())
            self.split_group = _or_none(self.device_mesh.get_group("tp"))
            self.shard_replicas = _or_none(self.device_mesh.get_group("dp"))
        else:
            for s in range(plan.num_stages):
                group = dist.new_group(plan.stage_ranks(s))
                if s == self.stage:
                    self.lanes = _or_none(group)
        for i, sp in enumerate(plan.shared_params):
            ranks = sorted(r for s in sp.stages for r in plan.stage_ranks(s))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.tied[i] = _or_none(group)

    @staticmethod
    def source(group) -> int:
        """Global rank of a group's first member (broadcasts start replicas from it)."""
        return dist.get_global_rank(group, 0)
