"""The optimizer over one rank's parameters."""

from __future__ import annotations

import torch
from torch import nn


def make_optimizer(optimizer, module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters of ``module`` (after stage cut and split sharding).

    ``optimizer`` is a callable ``params -> Optimizer`` (preferred) or an optimizer built over the full model:
    it is rebuilt with the same class and param-group options over the parameters this rank holds; sharded
    parameters that replaced full ones join the first param group.

    Raises:
        TypeError: ``optimizer`` is neither.
    """
    params = list(module.parameters())
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable params -> Optimizer, "
                        f"got {type(optimizer).__name__}")
    local = {id(p) for p in params}
    groups = []
    for g in optimizer.param_groups:
        kept = [p for p in g["params"] if id(p) in local]
        if kept:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": kept})
    known = {id(p) for g in groups for p in g["params"]}
    new = [p for p in params if id(p) not in known]
    if new:
        if groups:
            groups[0]["params"].extend(new)
        else:
            groups.append({**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}, "params": new})
    return type(optimizer)(groups)
