"""The optimizer over one rank's parameters: the user's own instance, re-pointed at what this rank holds.

An optimizer instance made over the full model keeps driving training: its param groups (weight decay / no
decay, per-group learning rates) and every LR scheduler attached to it stay valid, because the same object and
the same group dicts are kept; only each group's ``params`` list is replaced by this rank's parameters. A
parameter of another pipeline stage leaves its group; a split parameter is replaced by this rank's shard(s)
in the same group. Groups that end up empty stay (schedulers index groups by position).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class OptimizerError(TypeError):
    """An optimizer Whale cannot drive; the message says what to pass instead."""


def bind_optimizer(optimizer: torch.optim.Optimizer | Callable, module: nn.Module, model_params: set[int],
                   origins: dict[int, nn.Parameter] | None = None) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters of ``module`` (after stage cut and split sharding).

    Args:
        optimizer: a callable ``params -> Optimizer`` (called with this rank's parameters), or an optimizer
            instance built over the full model (re-pointed in place and returned: the same object).
        module: this rank's stage module.
        model_params: ``id`` of every parameter of the full model (before sharding).
        origins: ``id`` of a shard parameter -> the full parameter it was cut from.

    Raises:
        OptimizerError: ``optimizer`` is neither; an instance that has already stepped (its state would belong
            to full parameters); an instance over none of the model's parameters (built over a copy?) or over
            tensors that are not the model's parameters.
    """
    params = list(module.parameters())
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(f"optimizer must be a torch.optim.Optimizer or a callable params -> Optimizer, "
                             f"got {type(optimizer).__name__}")
    if any(optimizer.state.values()):
        raise OptimizerError(
            f"the {type(optimizer).__name__} passed to parallelize has already taken steps; its state belongs to "
            "the full model's parameters. Pass a fresh optimizer (LR schedulers may be attached), or a callable "
            "params -> Optimizer, and restore training state with engine.load_checkpoint")
    local = {id(p): p for p in params}
    shards: dict[int, list[nn.Parameter]] = {}
    for p in params:
        origin = (origins or {}).get(id(p))
        if origin is not None:
            shards.setdefault(id(origin), []).append(p)
    if not any(id(p) in model_params for g in optimizer.param_groups for p in g["params"]):
        raise OptimizerError(f"the {type(optimizer).__name__} passed to parallelize holds none of the model's "
                             "parameters (built over a copy?); build it over model.parameters() of the model you "
                             "parallelize")
    foreign = [(i, tuple(p.shape)) for i, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in model_params]
    if foreign:
        i, shape = foreign[0]
        raise OptimizerError(
            f"the {type(optimizer).__name__} passed to parallelize holds {len(foreign)} tensor(s) that are not "
            f"parameters of the model (the first, of shape {shape}, in param group {i}); Whale cannot reduce their "
            "gradients across ranks. Make them parameters of the model (e.g. an nn.Parameter attribute of a "
            "module) or optimize them separately")
    for group in optimizer.param_groups:
        mine: list[nn.Parameter] = []
        for p in group["params"]:
            found = [local[id(p)]] if id(p) in local else shards.get(id(p), [])
            mine += [q for q in found if all(q is not r for r in mine)]
        group["params"] = mine
    return optimizer
