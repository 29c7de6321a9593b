"""The pipeline stage cut: which graph nodes, parameters and buffers each stage owns, recorded by name.

Every node gets a stage: ``stage(node) = max(stage of its inputs, stage of the TaskGraph owning the
parameters/buffers it uses)``; model inputs enter at stage 0, so unannotated, parameter-free work joins the
stage where its inputs are ready (unannotated modules join the neighbouring stage). A parameter used by nodes of
several stages (a tied input embedding and output head) is held by each of them, and the runtime sums its
gradients. The result is plain data (:class:`whale.plan.plan.StageCut`, :class:`whale.plan.plan.SharedParam`)
that the runtime turns back into stage modules with :func:`stage_modules`.

The graph comes from ``torch.export`` when the plan has example inputs (:mod:`whale.frontend.export`), else
from ``torch.fx.symbolic_trace`` (:mod:`whale.frontend.graph`); either way each use of a tied tensor goes by
the name its calling module has for it, so a tie never drags a module out of its annotated stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

from whale.frontend.export import ModalStage, export_graph
from whale.frontend.graph import StageError, boundaries, compute_nodes, stage_module, tensor_names, trace
from whale.frontend.stage_state import complete_state
from whale.plan.plan import CaptureInput, SharedParam, StageCut


@dataclass(frozen=True)
class Captured:
    """The model's graph for cutting: ``train`` (also the only one of an fx trace, which follows the mode by
    itself) and, for an export capture, ``eval``."""

    train: fx.GraphModule
    eval: fx.GraphModule | None


def capture(model: nn.Module, leaves: tuple[str, ...], spec: tuple[CaptureInput, ...] = ()) -> Captured:
    """The model's graph: exported from example inputs ``spec`` when given, else traced by torch.fx.

    Raises:
        StageError: capture failed (naming the error and fixes).
    """
    if spec:
        return Captured(export_graph(model, spec, leaves, True), export_graph(model, spec, leaves, False))
    return Captured(trace(model, leaves), None)


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
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        own = [_attr_stage(gm, node.target, stage_of) if node.op == "call_module" else -1]
        for inp in node.all_input_nodes:
            if inp.op == "get_attr":
                own.append(_attr_stage(gm, inp.target, stage_of))
            else:
                own.append(stages.get(inp, 0))
        stages[node] = max([0, *own])
    return stages


def _use_stages(gm: fx.GraphModule, stages: dict[fx.Node, int]) -> dict[str, int]:
    """Tensor name -> the first stage using it under that name (to cut the eval graph as the train graph)."""
    out: dict[str, int] = {}
    for node, s in stages.items():
        names = [a.target for a in node.all_input_nodes if a.op == "get_attr"]
        if node.op == "call_module":
            names += [n for n, _ in gm.get_submodule(node.target).named_parameters(node.target, remove_duplicate=False)]
        for n in names:
            out[n] = min(out.get(n, s), s)
    return out


def stage_modules(model: nn.Module, cap: Captured, stages: dict[fx.Node, int], num_stages: int,
                  home: dict[str, int] | None = None) -> list[nn.Module]:
    """Every stage module of the cut ``stages`` of ``cap.train``; for an export capture each is a
    :class:`~whale.frontend.export.ModalStage` whose eval graph is cut at the same tensors. Together their state
    dicts hold exactly the model's entries, read by forward or not (:mod:`whale.frontend.stage_state`; ``home``:
    tensor FQN -> the stage its annotation, or the plan's cut, gives it).

    Raises:
        StageError: the eval graph's cut sends other values across a boundary than the train graph's.
    """
    train = [stage_module(cap.train, stages, num_stages, s) for s in range(num_stages)]
    if cap.eval is None:
        complete_state(model, train, home)
        return train
    eval_stages = assign_stages(cap.eval, _use_stages(cap.train, stages))
    sizes = [len(b) for b in boundaries(cap.train, stages, num_stages)]
    eval_sizes = [len(b) for b in boundaries(cap.eval, eval_stages, num_stages)]
    if sizes != eval_sizes:
        raise StageError(f"{type(model).__name__} crosses its stage boundaries with {sizes} values in train() but "
                         f"{eval_sizes} in eval(); pipeline it with Config(capture='fx') or other stage scopes")
    modal = [ModalStage(t, stage_module(cap.eval, eval_stages, num_stages, s), model) for s, t in enumerate(train)]
    complete_state(model, modal, home)
    return modal


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
        used = [node.target] if node.op == "call_module" else \
            [a.target for a in node.all_input_nodes if a.op == "get_attr"]
        if any(_attr_stage(gm, t, stage_of) == s for t in used):
            late = max((n for n in node.all_input_nodes if n.op != "get_attr"), key=lambda n: stages.get(n, 0),
                       default=node)
            what = node.target if node.op == "call_module" else f"{node.name} (using {used[0]})"
            return (f"{head}: {what!r} runs in stage {stages[node]} because its input {late.name!r} comes "
                    f"from stage {stages.get(late, 0)}; a stage's modules must be called before the next stage's "
                    "(annotate the modules in the order forward uses them)")
    return f"{head}: forward never calls its modules; annotate modules that forward uses"


def cut_model(model: nn.Module, stage_of: dict[str, int], num_stages: int, leaves: tuple[str, ...],
              units: list[list[str]] | None = None, spec: tuple[CaptureInput, ...] = ()) -> Cut:
    """Trace ``model`` and cut it into ``num_stages`` stages (see the module docstring).

    Args:
        model: the full local model.
        stage_of: parameter or buffer FQN -> stage for annotated (or planner-cut) tensors.
        num_stages: S >= 2.
        leaves: module FQNs kept as single calls (split targets).
        units: per stage, the layer units a hardware-aware cut gave it (recorded in the plan).
        spec: example inputs to capture with ``torch.export`` (empty: ``torch.fx.symbolic_trace``).

    Raises:
        StageError: the model cannot be traced, its forward branches on ``self.training`` in a way a traced
            stage cannot follow (naming the module; mode-dependent argument values such as
            ``F.dropout(x, p, training=self.training)`` are fine, see :func:`whale.frontend.graph.trace`), or
            some stage ends up with no work at all.
    """
    cap = capture(model, leaves, spec)
    gm = cap.train
    stages = assign_stages(gm, stage_of)
    cuts = []
    for s in range(num_stages):
        nodes = tuple(n.name for n in compute_nodes(gm) if stages[n] == s)
        if not nodes:
            raise StageError(_empty_stage(gm, stages, stage_of, s, num_stages))
    mods = stage_modules(model, cap, stages, num_stages, stage_of)
    for s, mod in enumerate(mods):
        params, buffers = tensor_names(mod)
        nodes = tuple(n.name for n in compute_nodes(gm) if stages[n] == s)
        cuts.append(StageCut(nodes, tuple(params), tuple(buffers), tuple(units[s]) if units else ()))
    return Cut(tuple(cuts), _shared(mods), tuple(mods))
