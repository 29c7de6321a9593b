"""Split (tensor-parallel) degrees in ``Config(auto=True)``'s search of a real model (issue 28, part 3).

Which units may be split: a profiled unit whose module type has a split rule of the user's with a ``dim_size``
(``wh.register_split_rule(T, rule, dim_size=fn, check=fn)``; :func:`whale.splitrules.searchable_split_dim`),
e.g. the example GPT's ``Block`` (cut by whole heads, :mod:`examples.gpt.tensor_parallel`). Such a unit is
described as a ``"dense"`` layer whose ``split_dims`` are that size, so the search
(:meth:`whale.planner.steptime.estimate.DefaultEstimator.split_ok`) only tries degrees dividing it, and only
inside one node; every other unit is ``"other"``: it stays data parallel, costed as whole on each device of a
split group (an upper bound: the runtime runs it data parallel over all devices). Whale's own rules (a lone
``nn.Linear``, whose output the loss would then receive sharded) are not searched.

How a chosen degree t is planned: as Whale's colocated hybrid (the paper's "replicate and split on the same
devices"), what ``GPT(split_blocks=True, stage_width=t)`` annotates by hand: every split unit its own
``split(t)`` TaskGraph, each run of the other units one ``replicate(t)`` TaskGraph, in module order; world = K x t
(nested data parallelism). Split is searched for unpipelined plans (one stage) only; the model's own
annotations, if any, are kept as before (:mod:`whale.frontend.autoplan`).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from whale.annotation import Scope, replicate, split
from whale.frontend.profile import ModelProfile
from whale.planner.model_desc import ModelDesc
from whale.splitrules import searchable_split_dim


def split_units(model: nn.Module, prof: ModelProfile, world_size: int) -> dict[int, int]:
    """``{unit index: size of the dim its rule cuts}`` for the profiled units that may be split (module
    docstring), checked at every degree dividing ``world_size``."""
    degrees = tuple(n for n in range(2, world_size + 1) if world_size % n == 0)
    out = {}
    for i, u in enumerate(prof.units):
        size = searchable_split_dim(model.get_submodule(u.name), degrees)
        if size is not None:
            out[i] = size
    return out


def with_split_kinds(desc: ModelDesc, units: dict[int, int]) -> ModelDesc:
    """``desc`` (one layer per profiled unit, :func:`whale.planner.model_desc.from_profile`) with the split units
    ``"dense"`` (``split_dims`` = their cut dim's size) and every other unit ``"other"``."""
    layers = tuple(dataclasses.replace(x, kind="dense", split_dims=(units[i],)) if i in units else
                   dataclasses.replace(x, kind="other") for i, x in enumerate(desc.layers))
    return ModelDesc(layers, desc.name)


def split_layout(model: nn.Module, prof: ModelProfile, units: dict[int, int],
                 t: int) -> tuple[list[Scope], dict[str, int], dict[str, Scope]]:
    """The colocated layout of split degree ``t`` (module docstring) as
    :func:`whale.frontend.taskgraphs.task_graph_scopes` gives an annotated model's: ``(TaskGraph scopes in
    module order, tensor FQN -> TaskGraph index, tensor FQN -> scope)``; a tied tensor belongs to the first
    unit holding it."""
    graphs: list[Scope] = []
    per_unit: list[Scope] = []
    current: Scope | None = None
    for i in range(len(prof.units)):
        if i in units:
            current = None
            graphs.append(split(t))
            per_unit.append(graphs[-1])
            continue
        if current is None:
            current = replicate(t)
            graphs.append(current)
        per_unit.append(current)
    index = {id(s): k for k, s in enumerate(graphs)}
    owner: dict[int, Scope] = {}
    stage_of: dict[str, int] = {}
    scopes: dict[str, Scope] = {}
    for u, scope in zip(prof.units, per_unit, strict=True):
        mod = model.get_submodule(u.name)
        for name, tensor in [*mod.named_parameters(prefix=u.name, remove_duplicate=False),
                             *mod.named_buffers(prefix=u.name, remove_duplicate=False)]:
            sc = owner.setdefault(id(tensor), scope)
            scopes[name], stage_of[name] = sc, index[id(sc)]
    return graphs, stage_of, scopes
