"""ZeRO-3's place in a step: the stage's gradient reduction with :class:`~whale.parallel.zero3.Zero3Shards` for
the parameters it shards and a :class:`~whale.parallel.data.GradSync` for those it leaves whole (split shards,
parameters tied across stages)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from whale.parallel.data import GradSync
from whale.parallel.zero3 import Zero3Shards
from whale.plan.plan import Plan
from whale.plan.zero import zero_shard_weights


class Zero3GradSync(GradSync):
    """:class:`~whale.parallel.data.GradSync` for the parameters ZeRO-3 leaves whole (split shards, ties
    across stages), driving :attr:`zero` at the step's start, end and zeroing."""

    zero: Zero3Shards

    def start_step(self) -> None:
        """As :meth:`GradSync.start_step`, and ZeRO-3's gradient hooks."""
        super().start_step()
        if getattr(self, "zero", None) is not None:
            self.zero.start_step()

    def finish(self) -> None:
        """As :meth:`GradSync.finish`, then the pieces' gradients."""
        super().finish()
        self.zero.finish()

    def zero_grad(self) -> None:
        """As :meth:`GradSync.zero_grad`, and the shard gradients."""
        super().zero_grad()
        self.zero.zero_grad()


def build_zero3(plan: Plan, param_groups: list, lanes_group, optimizer, bucket_cap_mb: float,
                module: nn.Module) -> tuple[GradSync, Zero3Shards | None]:
    """The stage's gradient reduction with ZeRO-3 over its lanes: the lanes entry of ``param_groups``
    (:func:`whale.runtime.groups.sync_sets`, first) is sharded (shares: the stage's ``zero_weights``), the
    other entries reduced by a :class:`~whale.parallel.data.GradSync`; the optimizer's groups re-pointed at
    this lane's pieces. Plain :class:`GradSync` and no shards where the stage has one lane.

    Raises:
        ZeroError: an optimizer that is not elementwise.
        Zero3Error: a unit whose parameters mix dtypes or devices.
    """
    if lanes_group is None or dist.get_world_size(lanes_group) < 2 or not param_groups[0][1]:
        return GradSync(param_groups, bucket_cap_mb), None
    stage = plan.coords(dist.get_rank())[0]
    lane_weights = zero_shard_weights(plan, stage)
    weights = [lane_weights[plan.coords(dist.get_global_rank(lanes_group, g))[1]]
               for g in range(dist.get_world_size(lanes_group))]
    sync = Zero3GradSync(param_groups[1:], bucket_cap_mb)
    sync.zero = Zero3Shards(module, param_groups[0][1], lanes_group, weights, plan.is_pipeline)
    sync.zero.start_step()
    sync.zero.bind(optimizer)
    return sync, sync.zero
