"""Annotations -> TaskGraphs: which scope owns each tensor, and a summary of each TaskGraph for the planner."""

from __future__ import annotations

from torch import nn

from whale.annotation import Scope, default_strategy, own_scopes, tensor_scopes, top_level
from whale.plan.plan import NestedScope
from whale.planner.planner import TaskGraphSummary


def compress_names(names: set[str], all_names: list[str]) -> tuple[str, ...]:
    """Shortest list of module prefixes covering exactly ``names`` among ``all_names`` (dotted FQNs).

    ``{"blocks.0.a.weight", "blocks.0.a.bias"}`` of a model whose ``blocks.0`` holds only those gives
    ``("blocks.0",)``.
    """
    out: list[str] = []
    for name in sorted(names, key=all_names.index):
        parts = name.split(".")
        best = name
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            under = [n for n in all_names if n.startswith(prefix + ".")]
            if all(n in names for n in under):
                best = prefix
                break
        if best not in out:
            out.append(best)
    return tuple(out)


def all_tensors(mod: nn.Module) -> dict[str, object]:
    """Every parameter and buffer of ``mod`` by FQN (tied tensors under each of their names)."""
    out = dict(mod.named_parameters(remove_duplicate=False))
    out.update(mod.named_buffers(remove_duplicate=False))
    return out


def task_graph_scopes(model: nn.Module) -> tuple[list[Scope], dict[str, int], dict[str, Scope]]:
    """``(top-level scopes in model order, FQN -> TaskGraph index of the names tagged themselves, FQN -> scope
    with ties propagated)``; a model without any annotation is one TaskGraph of the default strategy."""
    scopes = tensor_scopes(model)
    tops: dict[int, Scope] = {}
    for s in scopes.values():
        tops.setdefault(top_level(s).uid, top_level(s))
    ordered = [tops[u] for u in sorted(tops)] or [default_strategy()]
    index = {s.uid: i for i, s in enumerate(ordered)}
    stage_of = {}
    for fqn, scope in own_scopes(model).items():  # a scope all of whose tensors are tied into another TaskGraph
        top = top_level(scope)                     # is no TaskGraph of its own: its names follow the tie
        stage_of[fqn] = index[top.uid] if top.uid in index else index[top_level(scopes[fqn]).uid]
    return ordered, stage_of, scopes


def colocated_names(model: nn.Module, tg_scopes: list[Scope], scopes: dict[str, Scope]) -> list[set[str]]:
    """Tensor names per colocated TaskGraph; unannotated tensors join the first replicate TaskGraph."""
    sets: list[set[str]] = [set() for _ in tg_scopes]
    index = {s.uid: i for i, s in enumerate(tg_scopes)}
    home = next((i for i, s in enumerate(tg_scopes) if s.kind == "replicate"), 0)
    for name in all_tensors(model):
        scope = scopes.get(name)
        sets[index[top_level(scope).uid] if scope is not None else home].add(name)
    return sets


def split_leaves(model: nn.Module, scopes: dict[str, Scope]) -> tuple[str, ...]:
    """Modules kept as single calls when the model is traced: those under ``split`` (compressed), then MoE
    layers outside them (``is_moe``, :class:`whale.MoE`: their routing depends on values, which ``torch.fx``
    cannot follow)."""
    all_names = list(all_tensors(model))
    per_scope: dict[int, set[str]] = {}  # each split scope compressed alone: two split blocks are two leaves,
    for n, sc in scopes.items():  # not their common parent (a ModuleList that is never called)
        if sc.kind == "split":
            per_scope.setdefault(sc.uid, set()).add(n)
    split = tuple(dict.fromkeys(m for names in per_scope.values() for m in compress_names(names, all_names)))
    moe = [n for n, m in model.named_modules() if n and getattr(m, "is_moe", False)
           and not any(n == s or n.startswith(s + ".") for s in split)]
    return split + tuple(moe)


def _nested(scope: Scope, names: set[str], scopes: dict[str, Scope], all_names: list[str]) -> tuple:
    found: dict[int, tuple[Scope, set[str]]] = {}
    for n in sorted(names):
        s = scopes.get(n)
        if s is not None and s.parent is not None and top_level(s).uid == scope.uid:
            found.setdefault(s.uid, (s, set()))[1].add(n)
    return tuple(NestedScope(s.kind, s.device_count, compress_names(ns, all_names)) for s, ns in found.values())


def summaries(model: nn.Module, tg_scopes: list[Scope], name_sets: list[set[str]],
              scopes: dict[str, Scope]) -> list[TaskGraphSummary]:
    """One :class:`TaskGraphSummary` per TaskGraph; a tensor in several (tied across stages) counts its elements
    in the first only."""
    tensors = all_tensors(model)
    all_names = list(tensors)
    counted: set[int] = set()
    out = []
    for scope, names in zip(tg_scopes, name_sets, strict=True):
        params = {id(tensors[n]): tensors[n] for n in names
                  if isinstance(tensors[n], nn.Parameter) and id(tensors[n]) not in counted}
        counted |= set(params)
        numel = sum(p.numel() for p in params.values())
        out.append(TaskGraphSummary(scope.kind, scope.device_count, compress_names(names, all_names), numel,
                                    _nested(scope, names, scopes, all_names)))
    return out
