"""The model's ``torch.fx`` graph and the mechanics of cutting it into stage modules.

Both sides use this module: the front end traces the model to decide the stage cut
(:mod:`whale.frontend.stagecut`) and records it by node name in the plan; the runtime traces the same model
again and builds its own stage from the plan's node names (:func:`build_stage_module`). Nothing here decides
anything: given a node -> stage map, the stage modules follow.

Why our own cut rather than ``torch.distributed.pipelining``'s ``pipeline()``: Whale's stages come from
annotations (which TaskGraph owns each parameter), a value may skip stages (it is relayed), tied parameters are
held by several stages, and split modules stay opaque calls to be swapped for their shards; torch's splitter
cuts at explicit split points on an exported graph and moves parameters rather than sharing them.

Stage modules are ``GraphModule`` s built on the traced root, so they keep the model's original parameter names
(``blocks.3.attn.qkv.weight``) and share the very same ``Parameter`` objects. A value produced at stage s and
used at t > s crosses every boundary in between (s -> s+1 -> ... -> t).

What can cross a stage boundary: tensors (float ones carry gradients back; integer ones do not) and plain Python
values (ints, floats, bools, None, tuples of those), e.g. a sequence length. Not supported: models that
``symbolic_trace`` cannot trace (Python control flow on tensor values, iterating over ``x.shape``), and
``F.dropout(..., training=self.training)`` style flags, which tracing freezes (use ``nn.Dropout`` modules).
"""

from __future__ import annotations

from torch import fx, nn


class StageError(ValueError):
    """The model cannot be cut into the requested stages; the message says why and what to change."""


class _Tracer(fx.Tracer):
    """Keeps the given modules (split targets, replaced by sharded regions after the cut) as single calls."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        """Split targets and torch's own leaf modules are traced as single calls."""
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def trace(model: nn.Module, leaves: set[str] | tuple[str, ...] = ()) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` (modules named in ``leaves`` stay opaque calls) with an error message that
    says how to make the model traceable.

    Raises:
        StageError: tracing failed (the message names the model and common fixes).
    """
    try:
        tracer = _Tracer(set(leaves))
        graph = tracer.trace(model)
        return fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # noqa: BLE001 - re-raised with guidance
        raise StageError(
            f"pipelining needs a model that torch.fx.symbolic_trace can trace, and tracing "
            f"{type(model).__name__} failed: {type(exc).__name__}: {exc}. Common fixes: use x.size(1) instead "
            "of unpacking x.shape, x.unflatten/flatten instead of view(*shape), no Python if/for on tensor "
            "values in forward. Or use a single TaskGraph (no pipeline)."
        ) from exc


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a stage runs: every node but placeholders, the output and ``get_attr`` (parameters and
    buffers are copied into each stage that uses them)."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _boundaries(gm: fx.GraphModule, stages: dict[fx.Node, int], num_stages: int) -> list[list[fx.Node]]:
    """``bounds[s]``: values crossing the boundary between stage s and s+1, in graph order."""
    def stage(n: fx.Node) -> int:
        """Placeholders enter at stage 0, the output leaves from the last stage."""
        return 0 if n.op == "placeholder" else num_stages - 1 if n.op == "output" else stages[n]

    last_use: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            if inp.op != "get_attr":
                last_use[inp] = max(last_use.get(inp, -1), stage(node))
    return [[n for n in gm.graph.nodes if n in last_use and stage(n) <= s < last_use[n]]
            for s in range(num_stages - 1)]


def _copy_attrs(g: fx.Graph, node: fx.Node, env: dict) -> None:
    for inp in node.all_input_nodes:
        if inp.op == "get_attr" and inp not in env:
            env[inp] = g.node_copy(inp)


def _stage_graph(gm: fx.GraphModule, stages: dict[fx.Node, int], s: int, inputs, outputs) -> fx.Graph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.node_copy(n) if n.op == "placeholder" and s == 0 else g.placeholder(n.name)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or stages[node] != s:
            continue
        _copy_attrs(g, node, env)
        env[node] = g.node_copy(node, lambda n: env[n])
    if outputs is None:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        _copy_attrs(g, out, env)
        g.node_copy(out, lambda n: env[n])
    else:
        g.output(tuple(env[n] for n in outputs))
    g.lint()
    return g


def stage_module(gm: fx.GraphModule, stages: dict[fx.Node, int], num_stages: int, s: int) -> fx.GraphModule:
    """Stage ``s`` of ``gm`` cut by ``stages`` (node -> stage for every :func:`compute_nodes` node).

    ``module(*inputs)`` returns a tuple of boundary values, in graph order; the last stage returns the model's
    output unchanged. Stage 0 takes the model's forward arguments.
    """
    bounds = _boundaries(gm, stages, num_stages)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"] if s == 0 else bounds[s - 1]
    outputs = None if s == num_stages - 1 else bounds[s]
    return fx.GraphModule(gm, _stage_graph(gm, stages, s, inputs, outputs), class_name=f"Stage{s}")


def tensor_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(parameter FQNs, buffer FQNs)`` of a module, tied tensors under every name, in registration order."""
    params = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    buffers = [n for n, _ in module.named_buffers(remove_duplicate=False)]
    return params, buffers
