"""The stage's gradient reduction by the plan's ZeRO stage (:func:`build_grad_sync`, what the engine calls): a
plain :class:`~whale.parallel.data.GradSync`, ZeRO-1/2 buckets (:mod:`whale.parallel.zero`), or ZeRO-3's place in a
step: :class:`~whale.parallel.zero3.Zero3Shards` for the parameters it shards and a
:class:`~whale.parallel.data.GradSync` for those it leaves whole (split shards, parameters tied across stages).
It sits above both ZeRO modules, so neither imports the other's builder."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from whale.parallel.data import GradSync
from whale.parallel.zero import ShardedGradSync, ZeroShards, check_optimizer, shard_buckets
from whale.parallel.zero3 import Zero3Shards
from whale.plan.plan import Plan
from whale.planner.zero import zero_shard_weights


class Zero3GradSync(ShardedGradSync):
    """:class:`~whale.parallel.zero.ShardedGradSync` for the parameters ZeRO-3 leaves to buckets (split shards
    plain; parameters tied across stages ZeRO-2-sharded over their tie group, :attr:`zero`), driving
    :attr:`zero3` at the step's start, end and zeroing."""

    zero3: Zero3Shards | None = None

    def start_step(self) -> None:
        """As :meth:`ShardedGradSync.start_step`, and ZeRO-3's gradient hooks."""
        super().start_step()
        if self.zero3 is not None:
            self.zero3.start_step()

    def finish(self) -> None:
        """As :meth:`ShardedGradSync.finish`, then ZeRO-3's pieces' gradients; ZeRO-3's lanes first check that they
        all reached the step's end (:meth:`Zero3Shards.agree_step`).

        Raises:
            Zero3Error: lanes that called different units this step, on every lane.
        """
        if self.zero3 is not None:
            self.zero3.agree_step()
        super().finish()
        if self.zero3 is not None:
            self.zero3.finish()

    def zero_grad(self) -> None:
        """As :meth:`ShardedGradSync.zero_grad`, and ZeRO-3's shard gradients."""
        super().zero_grad()
        if self.zero3 is not None:
            self.zero3.zero_grad()


def build_zero3(plan: Plan, param_groups: list, lanes_group, tied_groups: list, optimizer, bucket_cap_mb: float,
                module: nn.Module) -> tuple[GradSync, Zero3Shards | ZeroShards | None]:
    """The stage's gradient reduction under ZeRO-3: the lanes entry of ``param_groups``
    (:func:`whale.runtime.groups.sync_sets`, first) is sharded over the stage's lanes by a
    :class:`~whale.parallel.zero3.Zero3Shards` (shares: the stage's ``zero_weights``); parameters tied across
    stages (``tied_groups``) keep whole values but their gradients and optimizer state are sliced over their tie
    group as under ZeRO-2 (:func:`whale.parallel.zero.shard_buckets`); split shards are reduced as without ZeRO.
    The optimizer's groups are re-pointed at this rank's pieces. Returns the sync and what the engine drives:
    the ``Zero3Shards`` (holding the tied slices as ``tied``), else the tied ``ZeroShards`` (one lane), else
    ``None``.

    Raises:
        ZeroError: an optimizer that is not elementwise.
        Zero3Error: a unit whose parameters mix dtypes or devices (later, from the step: lanes that called
            different units, :mod:`whale.parallel.zero3_check`).
    """
    lanes = lanes_group is not None and dist.get_world_size(lanes_group) > 1 and bool(param_groups[0][1])
    sync = Zero3GradSync(param_groups[1:] if lanes else param_groups, bucket_cap_mb)
    sync.zero = shard_buckets(plan, sync, None, tied_groups, set(), 2)
    if not lanes:
        if sync.zero is not None:
            sync.zero.bind(optimizer)
        return sync, sync.zero
    stage = plan.coords(dist.get_rank())[0]
    lane_weights = zero_shard_weights(plan, stage)
    weights = [lane_weights[plan.coords(dist.get_global_rank(lanes_group, g))[1]]
               for g in range(dist.get_world_size(lanes_group))]
    sync.zero3 = Zero3Shards(module, param_groups[0][1], lanes_group, weights, plan.is_pipeline)
    sync.zero3.tied = sync.zero
    sync.zero3.start_step()
    sync.zero3.bind(optimizer)
    return sync, sync.zero3


def build_grad_sync(plan: Plan, param_groups: list, lanes_group, tied_groups: list, optimizer,
                    bucket_cap_mb: float, module: nn.Module | None = None) -> tuple[GradSync, ZeroShards | None]:
    """The stage's gradient reduction and, under ``plan.zero >= 1``, its ZeRO shards (the optimizer's groups
    re-pointed at this rank's pieces): the buckets of the stage's lanes (``lanes_group``, sliced by the
    stage's ``zero_weights``) and of parameters tied across stages (``tied_groups``, :attr:`Mesh.tied`: each
    rank of each holding stage weighs its lane's share of its own stage, so the holding stages take equal
    parts). ``param_groups`` as :func:`whale.runtime.groups.sync_sets` gives them, the lanes entry first;
    split shards are never sharded again. No shards where no group has several ranks. ``plan.zero == 3``:
    :func:`build_zero3` over the stage ``module`` instead.

    Raises:
        ZeroError: ``plan.zero >= 1`` with an optimizer that is not elementwise.
    """
    if not plan.zero:
        return GradSync(param_groups, bucket_cap_mb), None
    check_optimizer(optimizer)
    if plan.zero >= 3:
        return build_zero3(plan, param_groups, lanes_group, tied_groups, optimizer, bucket_cap_mb, module)
    sync = ShardedGradSync(param_groups, bucket_cap_mb)
    sync.zero = shard_buckets(plan, sync, lanes_group, tied_groups, {id(p) for p in param_groups[0][1]}, plan.zero)
    if sync.zero is not None:
        sync.zero.bind(optimizer)
    return sync, sync.zero
