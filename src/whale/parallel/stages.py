"""Cut a traced model into pipeline stages at TaskGraph boundaries.

The model is traced with ``torch.fx.symbolic_trace``. Every node gets a stage:
``stage(node) = max(stage of its inputs, stage of the TaskGraph owning the parameters/buffers it uses)``;
model inputs enter at stage 0 and unannotated, parameter-free work joins the stage where its inputs are
ready (so unannotated modules join the neighbouring stage). A value produced at stage s and used at t > s is
passed along every boundary in between (s -> s+1 -> ... -> t). A parameter used by nodes of several stages
(tied input embedding and output head) is held by each of them; the runtime sums its gradients.

Stage modules are ``GraphModule`` s built on the traced root, so they keep the model's original parameter
names (``blocks.3.attn.qkv.weight``) and share the very same ``Parameter`` objects.

What can cross a stage boundary: tensors (float ones carry gradients back; integer ones do not) and plain
Python values (ints, floats, bools, None, tuples of those), e.g. a sequence length. Not supported: models
that ``symbolic_trace`` cannot trace (Python control flow on tensor values, iterating over ``x.shape``), and
``F.dropout(..., training=self.training)`` style flags, which tracing freezes (use ``nn.Dropout`` modules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn


class StageError(ValueError):
    """The model cannot be cut into the requested stages; the message says why and what to change."""


@dataclass
class StageGraphs:
    """Result of :func:`build_stages`.

    Attributes:
        modules: one ``GraphModule`` per stage; ``modules[s](*inputs)`` returns a tuple of boundary values
            (the last stage returns the model's output unchanged).
        num_inputs: values each stage receives (stage 0: the model's forward arguments).
        shared: parameter names per parameter held by more than one stage, ``[[fqn, ...], ...]``, with the
            stages holding each: ``shared_stages[i]``.
    """

    modules: list[fx.GraphModule]
    num_inputs: list[int]
    shared: list[list[str]]
    shared_stages: list[list[int]]


class _Tracer(fx.Tracer):
    """Keeps the given modules (split targets, replaced by sharded regions after the cut) as single calls."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        """Split targets and torch's own leaf modules are traced as single calls."""
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def trace(model: nn.Module, leaves: set[str] | None = None) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` (modules named in ``leaves`` stay opaque calls) with an error message that
    says how to make the model traceable."""
    try:
        tracer = _Tracer(set(leaves or ()))
        graph = tracer.trace(model)
        return fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # noqa: BLE001 - re-raised with guidance
        raise StageError(
            f"pipelining needs a model that torch.fx.symbolic_trace can trace, and tracing "
            f"{type(model).__name__} failed: {type(exc).__name__}: {exc}. Common fixes: use x.size(1) instead "
            "of unpacking x.shape, x.unflatten/flatten instead of view(*shape), no Python if/for on tensor "
            "values in forward. Or use a single TaskGraph (no pipeline)."
        ) from exc


def _attr_stage(gm: fx.GraphModule, target: str, stage_of: dict[int, int]) -> int:
    obj = gm.get_submodule(target) if _is_module(gm, target) else _get_attr(gm, target)
    tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, nn.Module) else [obj]
    stages = [stage_of[id(t)] for t in tensors if id(t) in stage_of]
    return max(stages, default=-1)


def _is_module(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_submodule(target)
        return True
    except AttributeError:
        return False


def _get_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def assign_stages(gm: fx.GraphModule, stage_of: dict[int, int], num_stages: int) -> dict[fx.Node, int]:
    """Stage of every node except ``get_attr`` nodes (they are copied into each stage that uses them).

    ``stage_of`` maps ``id(tensor)`` of annotated parameters/buffers to their stage index.
    """
    stages: dict[fx.Node, int] = {}
    attr_stage: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            stages[node] = 0
        elif node.op == "get_attr":
            attr_stage[node] = _attr_stage(gm, node.target, stage_of)
        elif node.op == "output":
            stages[node] = num_stages - 1
        else:
            own = _attr_stage(gm, node.target, stage_of) if node.op == "call_module" else -1
            inputs = [attr_stage[n] if n in attr_stage else stages[n] for n in node.all_input_nodes]
            stages[node] = max([own, 0, *inputs])
    return stages


def _boundaries(gm: fx.GraphModule, stages: dict[fx.Node, int], num_stages: int) -> list[list[fx.Node]]:
    """``bounds[s]``: values crossing the boundary between stage s and s+1, in graph order."""
    last_use: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            if inp.op != "get_attr":
                last_use[inp] = max(last_use.get(inp, -1), stages[node])
    return [[n for n in gm.graph.nodes if n in last_use and stages[n] <= s < last_use[n]]
            for s in range(num_stages - 1)]


def _stage_graph(gm, stages, s, inputs, outputs) -> fx.Graph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.node_copy(n) if n.op == "placeholder" and s == 0 else g.placeholder(n.name)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or stages.get(node) != s:
            continue
        for inp in node.all_input_nodes:
            if inp.op == "get_attr" and inp not in env:
                env[inp] = g.node_copy(inp)
        env[node] = g.node_copy(node, lambda n: env[n])
    if outputs is None:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        for inp in out.all_input_nodes:
            if inp.op == "get_attr" and inp not in env:
                env[inp] = g.node_copy(inp)
        g.node_copy(out, lambda n: env[n])
    else:
        g.output(tuple(env[n] for n in outputs))
    g.lint()
    return g


def build_stages(model: nn.Module, stage_of: dict[int, int], num_stages: int,
                 leaves: set[str] | None = None) -> StageGraphs:
    """Trace ``model`` and cut it into ``num_stages`` stage modules (see the module docstring).

    Args:
        model: the full local model (all ranks build it identically).
        stage_of: ``id(parameter or buffer) -> stage`` for annotated tensors.
        num_stages: S >= 1.
        leaves: module FQNs to keep whole (split regions are swapped in for them on each rank).

    Raises:
        StageError: the model cannot be traced, or some stage ends up with no work at all.
    """
    gm = trace(model, leaves)
    stages = assign_stages(gm, stage_of, num_stages)
    bounds = _boundaries(gm, stages, num_stages)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mods, num_inputs = [], []
    for s in range(num_stages):
        inputs = placeholders if s == 0 else bounds[s - 1]
        outputs = None if s == num_stages - 1 else bounds[s]
        if not any(v == s for n, v in stages.items() if n.op not in ("placeholder", "output")):
            raise StageError(
                f"stage {s} of {num_stages} has no operations: its TaskGraph's modules are never called in "
                "forward, or every use of them lands in a later stage. Check the annotations' order."
            )
        mods.append(fx.GraphModule(gm, _stage_graph(gm, stages, s, inputs, outputs), class_name=f"Stage{s}"))
        num_inputs.append(len(inputs))
    shared, shared_stages = _shared_params(mods)
    return StageGraphs(mods, num_inputs, shared, shared_stages)


def _shared_params(mods: list[fx.GraphModule]) -> tuple[list[list[str]], list[list[int]]]:
    holders: dict[int, list[int]] = {}
    names: dict[int, list[str]] = {}
    for s, m in enumerate(mods):
        for name, p in m.named_parameters(remove_duplicate=False):
            if s not in holders.setdefault(id(p), []):
                holders[id(p)].append(s)
            if name not in names.setdefault(id(p), []):
                names[id(p)].append(name)
    keys = [k for k, h in holders.items() if len(h) > 1]
    return [sorted(names[k]) for k in keys], [holders[k] for k in keys]


def local_parameters(module: nn.Module) -> list[torch.nn.Parameter]:
    """Unique parameters of a (stage) module in registration order."""
    return list(module.parameters())
