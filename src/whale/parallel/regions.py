"""Install split regions: replace the modules a plan marks ``split`` by their bridged shards on this rank."""

from __future__ import annotations

from torch import nn

from whale.parallel.bridge import SplitRegion
from whale.parallel.split import SplitError, shard_module
from whale.plan.plan import Plan


def split_targets(plan: Plan, stage: int) -> list[tuple[str, list[float]]]:
    """``(module FQN, shard weights)`` of every module a stage runs under ``split`` (top-level or nested)."""
    out = []
    for tg in plan.stage_task_graphs(stage):
        if tg.kind == "split":
            out += [(name, list(tg.shard_weights)) for name in tg.modules]
        for nest in tg.nested:
            if nest["kind"] == "split":
                out += [(name, list(nest.get("shard_weights", []))) for name in nest["modules"]]
    return out


def _targets_by_module(module: nn.Module, targets: list[tuple[str, list[float]]]) -> list[tuple[str, list[float]]]:
    """Map loose root-level tensor names (a whole model built under split) onto the root module ``""``."""
    loose = [(n, w) for n, w in targets if "." not in n and n in dict(module.named_parameters(recurse=False))]
    if loose and len(loose) == len(targets):
        return [("", loose[0][1])]
    return targets


def install_split_regions(module: nn.Module, plan: Plan, stage: int, lane: int,
                          groups: dict) -> tuple[nn.Module, list[SplitRegion]]:
    """Swap each split module of this stage for a :class:`SplitRegion` over this replica's split group.
    Returns the (possibly replaced, when the whole model is split) module and the regions.

    Nothing happens when the stage's width is 1 (a split over one device is the module itself).

    Raises:
        SplitError: a split TaskGraph holds loose parameters rather than whole modules, or a module type has
            no sharding rule.
    """
    if plan.stage_width == 1:
        return module, []
    ranks = tuple(plan.split_group_ranks(stage, lane // plan.stage_width))
    group = groups[ranks]
    regions = []
    for name, weights in _targets_by_module(module, split_targets(plan, stage)):
        if name == "":
            region = SplitRegion(shard_module(module, group, weights=weights or None), group)
            return region, [region]
        try:
            target = module.get_submodule(name)
        except AttributeError:
            raise SplitError(
                f"split holds {name!r}, which is not a whole module: put whole modules (e.g. an nn.Linear) "
                "inside a split scope, not loose parameters") from None
        region = SplitRegion(shard_module(target, group, weights=weights or None), group)
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, region)
        regions.append(region)
    return module, regions
