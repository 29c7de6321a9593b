"""The pipeline stage cut: which graph nodes, parameters and buffers each stage owns, recorded by name.

Every node gets a stage: ``stage(node) = max(stage of its inputs, stage of the TaskGraph owning the
parameters/buffers it uses)``; model inputs enter at stage 0, so unannotated, parameter-free work joins the
stage where its inputs are ready (unannotated modules join the neighbouring stage). A parameter used by nodes of
several stages (a tied input embedding and output head) is held by each of them, and the runtime sums its
gradients. The result is plain data (:class:`whale.plan.plan.StageCut`, :class:`whale.plan.plan.SharedParam`)
that the runtime turns back into stage modules with :func:`whale.frontend.graph.stage_module`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

from whale.frontend.graph import StageError, compute_nodes, stage_module, tensor_names, trace
from whale.plan.plan import SharedParam, StageCut


@dataclass(frozen=True)
class Cut:
    """A model cut into stages: the plan's entries and, for the front end's own use, the stage modules.

    Attributes:
        stage_cuts: per stage, its nodes, parameters and buffers by name.
        shared_params: parameters held by several stages.
        modules: the stage ``GraphModule`` s (sharing the model's tensors), for profiling and summaries.
    """

    stage_cuts: tuple[StageCut, ...]
    shared_params: tuple[SharedParam, ...]
    modules: tuple[fx.GraphModule, ...]


def _attr_stage(gm: fx.GraphModule, target: str, stage_of: dict[str, int]) -> int:
    """The latest stage owning a tensor reached through ``target`` (a module or a tensor), by name."""
    try:
        mod = gm.get_submodule(target)
    except AttributeError:
        return stage_of.get(target, -1)
    names = [n for n, _ in mod.named_parameters(prefix=target, remove_duplicate=False)]
    names += [n for n, _ in mod.named_buffers(prefix=target, remove_duplicate=False)]
    return max((stage_of[n] for n in names if n in stage_of), default=-1)


def assign_stages(gm: fx.GraphModule, stage_of: dict[str, int]) -> dict[fx.Node, int]:
    """Stage of every :func:`~whale.frontend.graph.compute_nodes` node (see the module docstring).

    ``stage_of`` maps the FQNs of annotated (or planner-cut) parameters and buffers to their stage index, by
    the name a module uses: a tensor tied under two names may belong to two stages.
    """
    stages: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        own = _attr_stage(gm, node.target, stage_of) if node.op in ("call_module", "get_attr") else -1
        if node.op == "get_attr":
            stages[node] = own
            continue
        stages[node] = max([own, 0, *(stages.get(n, 0) for n in node.all_input_nodes)])
    return {n: s for n, s in stages.items() if n.op != "get_attr"}


def _shared(mods: list[fx.GraphModule]) -> tuple[SharedParam, ...]:
    holders: dict[int, list[int]] = {}
    names: dict[int, set[str]] = {}
    for s, m in enumerate(mods):
        for name, p in m.named_parameters(remove_duplicate=False):
            if s not in holders.setdefault(id(p), []):
                holders[id(p)].append(s)
            names.setdefault(id(p), set()).add(name)
    return tuple(SharedParam(tuple(sorted(names[k])), tuple(h)) for k, h in holders.items() if len(h) > 1)


def _empty_stage(gm: fx.GraphModule, stages: dict[fx.Node, int], stage_of: dict[str, int], s: int,
                 num_stages: int) -> str:
    """Why stage ``s`` got no work: its tensors are never used, or the first node using them runs later
    because one of its inputs comes from a later stage."""
    owned = sorted(n for n, st in stage_of.items() if st == s)
    head = f"stage {s} of {num_stages} has no operations although its TaskGraph holds {owned[:3]}"
    for node in compute_nodes(gm):
        if node.op == "call_module" and _attr_stage(gm, node.target, stage_of) == s:
            late = max(node.all_input_nodes, key=lambda n: stages.get(n, 0))
            return (f"{head}: {node.target!r} runs in stage {stages[node]} because its input {late.name!r} comes "
                    f"from stage {stages.get(late, 0)}; a stage's modules must be called before the next stage's "
                    "(annotate the modules in the order forward uses them)")
    return f"{head}: forward never calls its modules; annotate modules that forward uses"


def cut_model(model: nn.Module, stage_of: dict[str, int], num_stages: int, leaves: tuple[str, ...],
              units: list[list[str]] | None = None) -> Cut:
    """Trace ``model`` and cut it into ``num_stages`` stages (see the module docstring).

    Args:
        model: the full local model.
        stage_of: parameter or buffer FQN -> stage for annotated (or planner-cut) tensors.
        num_stages: S >= 2.
        leaves: module FQNs kept as single calls (split targets).
        units: per stage, the layer units a hardware-aware cut gave it (recorded in the plan).

    Raises:
        StageError: the model cannot be traced, its forward branches on ``self.training`` in a way a traced
            stage cannot follow (naming the module; mode-dependent argument values such as
            ``F.dropout(x, p, training=self.training)`` are fine, see :func:`whale.frontend.graph.trace`), or
            some stage ends up with no work at all.
    """
    gm = trace(model, leaves)
    stages = assign_stages(gm, stage_of)
    cuts, mods = [], []
    for s in range(num_stages):
        nodes = tuple(n.name for n in compute_nodes(gm) if stages[n] == s)
        if not nodes:
            raise StageError(_empty_stage(gm, stages, stage_of, s, num_stages))
        mod = stage_module(gm, stages, num_stages, s)
        params, buffers = tensor_names(mod)
        cuts.append(StageCut(nodes, tuple(params), tuple(buffers), tuple(units[s]) if units else ()))
        mods.append(mod)
    return Cut(tuple(cuts), _shared(mods), tuple(mods))
