"""The split runtime of one rank: swaps the modules a plan marks ``split`` for their bridged shards, and keeps
the row bookkeeping of the bridges (how many rows of each micro-batch every rank of the split group holds)."""

from __future__ import annotations

from torch import nn

import whale.parallel.moe  # noqa: F401 - registers the expert-parallel rule for whale.MoE
from whale.parallel.bridge import SplitRegion
from whale.parallel.seqpar import SequenceParallelRegion, is_sequence_parallel
from whale.parallel.split import SplitError, shard_module
from whale.parallel.split_state import shard_ties
from whale.plan.plan import Plan
from whale.splitrules import split_modules


class SplitRuntime:
    """This rank's split regions and their rows.

    Attributes:
        module: the stage module with every split module replaced by a :class:`SplitRegion` (the region itself
            when the whole model is split).
        regions: the installed regions (empty when the stage has no split or its width is 1).
        params: ``id`` of every sharded parameter (their gradients sum over shard replicas, not lanes); a split
            module's data-parallel parameters (an MoE router: its module sets ``data_parallel = True``) are not
            in it, so they are summed over lanes.
        origins: ``id`` of each sharded parameter -> the full parameter of the model it was cut from (an
            optimizer's param groups name the full ones).
        sharded_loss: the model ends in class-sharded logits: the loss covers every row of the split group.

    Raises:
        SplitError: a split TaskGraph holds loose parameters rather than whole modules, or a module type has
            no sharding rule.
    """

    def __init__(self, module: nn.Module, plan: Plan, stage: int, group) -> None:
        self.module, self.regions = module, []
        self.origins: dict[int, nn.Parameter] = {}
        if plan.width_of(stage) > 1:
            with shard_ties(self.module, plan) as ties:  # a weight tied inside the split stays one parameter
                self._install(plan, stage, group)
            ties.check(self.module)
            if plan.sequence_parallel and self.regions and \
                    not any(isinstance(r, SequenceParallelRegion) for r in self.regions):
                raise SplitError(
                    f"sequence_parallel=True, but no split module of stage {stage} has a sequence-parallel shard "
                    f"(its rules ignored ctx['sequence_parallel']: {[type(r.sharded).__name__ for r in self.regions]})"
                    "; split whole transformer blocks whose rule supports it (see whale.parallel.seqpar), or turn "
                    "Config.sequence_parallel off")
        # data-parallel parameters of a split module (an MoE router) are reduced over lanes like replicate ones
        dp = {id(p) for r in self.regions for m in r.modules() if getattr(m, "data_parallel", False)
              for p in m.parameters()}
        self.params = {id(p) for r in self.regions for p in r.parameters()} - dp
        self.sharded_loss = any(r.sharded_output for r in self.regions)

    def _install(self, plan: Plan, stage: int, group) -> None:
        for name, weights in split_modules(self.module, plan.split_targets(stage)):
            weights = list(weights) or None
            if name == "":
                self.module = self._region(self.module, plan, group, weights)
                self.regions = [self.module]
                return
            try:
                target = self.module.get_submodule(name)
            except AttributeError:
                raise SplitError(
                    f"split holds {name!r}, which is not a whole module: put whole modules (e.g. an nn.Linear) "
                    "inside a split scope, not loose parameters") from None
            region = self._region(target, plan, group, weights)
            parent, _, child = name.rpartition(".")
            setattr(self.module.get_submodule(parent) if parent else self.module, child, region)
            self.regions.append(region)

    def _region(self, target: nn.Module, plan: Plan, group, weights) -> SplitRegion:
        """``target``'s shard in a region (a :class:`SequenceParallelRegion` when the plan asks for sequence
        parallelism and the shard's rule built one that supports it); records which full parameter each shard
        parameter comes from (the sharding rules keep the module's parameter names)."""
        shard = shard_module(target, group, weights=weights, sequence_parallel=plan.sequence_parallel)
        region = (SequenceParallelRegion if is_sequence_parallel(shard) else SplitRegion)(shard, group)
        full = dict(target.named_parameters(remove_duplicate=False))
        for pname, p in region.sharded.named_parameters(remove_duplicate=False):
            if pname in full:
                self.origins[id(p)] = full[pname]
        return region

    @staticmethod
    def group_lanes(plan: Plan, lane: int) -> range:
        """The lanes of ``lane``'s split group (one replica's n devices), in group-rank order."""
        first = lane - lane % plan.stage_width
        return range(first, first + plan.stage_width)

    def start_step(self, plan: Plan, rows: list[list[tuple[int, int]]], lane: int) -> None:
        """Tell the bridges the rows each group member holds this step (``rows`` from
        :meth:`Plan.micro_batch_rows`; micro-batches of a step have equal shares)."""
        if not self.regions:
            return
        counts = [rows[other][0][1] - rows[other][0][0] for other in self.group_lanes(plan, lane)]
        for region in self.regions:
            region.set_rows(counts)

    def loss_rows(self, plan: Plan, rows: list[list[tuple[int, int]]], lane: int) -> list[tuple[int, int]]:
        """Per micro-batch, the rows this rank's loss covers: its own, or with class-sharded logits every row
        of its split group."""
        if not self.sharded_loss:
            return rows[lane]
        group = self.group_lanes(plan, lane)
        return [(a, rows[group[-1]][i][1]) for i, (a, _) in enumerate(rows[group[0]])]

    def counts_loss(self, plan: Plan, lane: int) -> bool:
        """Whether this rank reports the loss: with class-sharded logits every rank of a split group computes
        the same loss over the group's rows, and only the first reports it."""
        return not self.sharded_loss or lane % plan.stage_width == 0
