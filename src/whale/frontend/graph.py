"""The model's ``torch.fx`` graph and the mechanics of cutting it into stage modules (the graph comes from
:func:`trace` here, or from ``torch.export`` in :mod:`whale.frontend.export` when a sample batch is given).

Both sides use this module: the front end traces the model to decide the stage cut
(:mod:`whale.frontend.stagecut`) and records it by node name in the plan; the runtime traces the same model
again and builds its own stage from the plan's node names (:func:`whale.parallel.stages.build_stage`). Nothing
here decides anything: given a node -> stage map, the stage modules follow.

Why our own cut rather than ``torch.distributed.pipelining``'s ``pipeline()``: Whale's stages come from
annotations (which TaskGraph owns each parameter), a value may skip stages (it is relayed), tied parameters are
held by several stages, and split modules stay opaque calls to be swapped for their shards; torch's splitter
cuts at explicit split points on an exported graph and moves parameters rather than sharing them.

Stage modules are ``GraphModule`` s built on the traced root, so they keep the model's original parameter names
(``blocks.3.attn.qkv.weight``) and share the very same ``Parameter`` objects. A value produced at stage s and
used at t > s crosses every boundary in between (s -> s+1 -> ... -> t).

What can cross a stage boundary: tensors (float ones carry gradients back; integer ones do not) and plain Python
values (ints, floats, bools, None, tuples of those), e.g. a sequence length. Not supported: models that
``symbolic_trace`` cannot trace (Python control flow on tensor values, iterating over ``x.shape``).

Train/eval mode. Tracing runs ``forward`` once, so whatever it reads from ``self.training`` would be frozen into
the graph: ``F.dropout(x, p, training=self.training)`` would keep dropping in ``eval()``. :func:`trace` therefore
traces the model twice, in ``train()`` and in ``eval()`` mode (restoring every module's own flag afterwards), and
compares the graphs node by node. Calls whose *constant* arguments differ (``training=True`` vs ``False``,
``dropout_p=0.1`` vs ``0.0``) become :class:`ModeSwitch` calls that hold both argument sets and pick by the stage
module's mode at run time, so ``stage.eval()`` behaves like ``model.eval()``. Graphs that differ in their
operations (``if self.training: x = x + noise``) cannot follow the mode after tracing and raise a
:class:`StageError` naming the module; so do mode-dependent arguments of a submodule call or of the output.
Modules traced as single calls (``nn.Dropout``, ``nn.BatchNorm2d``, split targets) read their own mode and need
nothing of this. torch.fx has no notion of a traced ``self.training`` (it is a plain Python bool), hence the
two traces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


def _trace_once(model: nn.Module, leaves: set[str]) -> fx.GraphModule:
    tracer = _Tracer(leaves)
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def trace(model: nn.Module, leaves: set[str] | tuple[str, ...] = ()) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` (modules named in ``leaves`` stay opaque calls) that honours train/eval mode
    (see the module docstring), with an error message that says how to make the model traceable.

    The graph is the same whatever mode ``model`` is in; every module's ``training`` flag is restored.

    Raises:
        StageError: tracing failed (the message names the model and common fixes), ``forward`` branches on
            ``self.training`` in a way a traced graph cannot follow (the message names the module), or it
            updates a buffer outside a module traced as one call (named; see :func:`_check_buffers_untouched`).
    """
    modes = [(m, m.training) for m in model.modules()]
    buffers = _buffer_marks(model)
    try:
        model.train()
        train_gm = _trace_once(model, set(leaves))
        model.eval()
        eval_gm = _trace_once(model, set(leaves))
        _check_buffers_untouched(model, buffers)
    except StageError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with guidance
        raise StageError(
            f"pipelining needs a model that torch.fx.symbolic_trace can trace, and tracing "
            f"{type(model).__name__} failed: {type(exc).__name__}: {exc}. Common fixes: use x.size(1) instead "
            "of unpacking x.shape, x.unflatten/flatten instead of view(*shape), no Python if/for on tensor "
            "values in forward. Or pass a sample batch (wh.parallelize(..., sample_batch=(inputs, target))) so "
            "Whale captures the model with torch.export instead, or use a single TaskGraph (no pipeline)."
        ) from exc
    finally:
        for m, flag in modes:
            m.training = flag
    return _honour_mode(train_gm, eval_gm, model)


def _buffer_marks(model: nn.Module) -> dict[str, tuple]:
    """Each buffer's version and a copy of its value, to find (and undo) updates made while tracing."""
    return {n: (b._version, b.detach().clone()) for n, b in model.named_buffers() if not b.is_inference()}


def _check_buffers_untouched(model: nn.Module, before: dict[str, tuple]) -> None:
    """Refuse a forward that updates a buffer outside a module traced as one call: torch.fx runs such code on
    the real tensor (it records no node, and ``1 / self.steps`` becomes a constant), so a traced stage would
    never update it. The values are restored first.

    Raises:
        StageError: naming the buffers and the fix.
    """
    changed = [n for n, b in model.named_buffers() if n in before and b._version != before[n][0]]
    if not changed:
        return
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in changed:
                b.copy_(before[n][1])
    raise StageError(f"{type(model).__name__}'s forward updates buffer(s) {changed[:3]} in place outside a module "
                     "torch.fx keeps as one call, which a torch.fx trace cannot record (the stage would never update "
                     "them, and would read their traced value as a constant). Fix: Config(capture='export') with a "
                     "sample batch (torch.export records the update), or a single TaskGraph (no pipeline)")


# --- train/eval mode ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Slot:
    """Placeholder for the i-th input of a :class:`ModeSwitch` inside its argument templates."""

    index: int

    def __repr__(self) -> str:
        return f"<input {self.index}>"


class ModeSwitch(nn.Module):
    """A traced call whose constant arguments depend on the mode (see the module docstring).

    Args:
        op: ``"call_function"`` or ``"call_method"``.
        target: the function, or the method name (called on the first argument).
        train, eval_: ``(args, kwargs)`` of the call traced in each mode, with :class:`_Slot` ``(i)`` where
            the call takes its i-th input.

    ``forward(*inputs)`` makes the call with the eval arguments when this module or ``owner`` (the module whose
    forward made the call, in the model) is in eval mode, as the model would: ``model.eval()``, a submodule's
    own ``eval()`` and the stage's ``eval()`` all reach it. No parameters or buffers; ``owner`` is referenced,
    not registered as a child.
    """

    def __init__(self, op: str, target, train: tuple, eval_: tuple, owner: nn.Module | None = None) -> None:
        super().__init__()
        self.op, self.target, self.templates = op, target, {True: train, False: eval_}
        self.__dict__["_owner"] = owner  # not a submodule: its tensors stay where the model has them

    def forward(self, *inputs):
        """The call in the current mode (shapes and errors are the call's own)."""
        training = self.training and (self._owner is None or self._owner.training)
        args, kwargs = fx.node.map_aggregate(self.templates[training],
                                             lambda a: inputs[a.index] if isinstance(a, _Slot) else a)
        if self.op == "call_method":
            return getattr(args[0], self.target)(*args[1:], **kwargs)
        return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        """The call and its two argument sets, for ``print(stage)``."""
        name = self.target if isinstance(self.target, str) else getattr(self.target, "__name__", self.target)
        return f"{name}: train {self.templates[True]}, eval {self.templates[False]}"


def _where(node: fx.Node) -> str:
    """The module whose forward made ``node`` (from torch.fx's ``nn_module_stack``), for error messages."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return f"the model's own forward (node {node.name!r})"
    path, cls = list(stack.values())[-1]
    return f"{path} ({getattr(cls, '__name__', cls)}), node {node.name!r}"


def _call(node: fx.Node) -> str:
    """``node`` as a short call description, e.g. ``mul(x, 2)`` or ``c.l(x)``."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    args = ", ".join(repr(a) for a in node.args)
    return f"{node.op} {target}({args})"


def _mode_error(model_name: str, node: fx.Node, what: str) -> StageError:
    return StageError(
        f"{model_name} cannot be pipelined as written: {_where(node)} {what}, so a stage traced once cannot "
        "follow train()/eval(). Fix: use modules torch.fx keeps as calls for mode-dependent work (nn.Dropout, "
        "nn.BatchNorm*), or pass the mode as an argument value "
        "(F.dropout(x, p, training=self.training) is supported); or use a single TaskGraph (no pipeline).")


def _switch(node: fx.Node, other: fx.Node, by_name: dict[str, fx.Node], model: nn.Module) -> ModeSwitch:
    """Turn ``node`` (train trace) into a call of a :class:`ModeSwitch` that also knows ``other`` (eval
    trace) and follows the mode of the module whose forward made the call; returns the switch to register on
    the graph module."""
    names: dict[str, int] = {}
    for n in node.all_input_nodes + other.all_input_nodes:
        names.setdefault(n.name, len(names))
    template = lambda n: fx.node.map_arg((n.args, dict(n.kwargs)), lambda a: _Slot(names[a.name]))  # noqa: E731
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    try:
        owner = model.get_submodule(path) if path else model
    except AttributeError:
        owner = model
    switch = ModeSwitch(node.op, node.target, template(node), template(other), owner)
    node.op, node.target = "call_module", f"_whale_mode_{node.name}"
    node.args, node.kwargs = tuple(by_name[n] for n in names), {}
    return switch


def _honour_mode(train_gm: fx.GraphModule, eval_gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """``train_gm`` with every mode-dependent call made a :class:`ModeSwitch` (see the module docstring).

    Raises:
        StageError: the two graphs differ in their operations, or in the arguments of a submodule call,
            attribute or the output (naming the module).
    """
    model_name = type(model).__name__
    train_nodes, eval_nodes = list(train_gm.graph.nodes), list(eval_gm.graph.nodes)
    key = lambda n: (n.op, n.target, n.name)  # noqa: E731
    for t, e in zip(train_nodes, eval_nodes, strict=False):
        if key(t) != key(e):
            raise _mode_error(model_name, t, f"runs {_call(t)} in train() but {_call(e)} in eval() (forward "
                                             "branches on self.training)")
    if len(train_nodes) != len(eval_nodes):
        longer = train_nodes if len(train_nodes) > len(eval_nodes) else eval_nodes
        node = longer[min(len(train_nodes), len(eval_nodes))]
        raise _mode_error(model_name, node, "runs operations in one mode only (forward branches on "
                                            "self.training)")
    by_name = {n.name: n for n in train_nodes}
    changed = False
    for t, e in zip(train_nodes, eval_nodes, strict=True):
        same = fx.node.map_arg((t.args, dict(t.kwargs)), lambda a: a.name) == \
            fx.node.map_arg((e.args, dict(e.kwargs)), lambda a: a.name)
        if same:
            continue
        if t.op not in ("call_function", "call_method"):
            raise _mode_error(model_name, t, f"passes arguments that depend on self.training to {t.op} "
                                             f"{t.target!r}")
        train_gm.add_submodule(f"_whale_mode_{t.name}", _switch(t, e, by_name, model))
        changed = True
    if changed:
        train_gm.recompile()
    return train_gm


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a stage runs: every node but placeholders, the output and ``get_attr`` (parameters and
    buffers are copied into each stage that uses them)."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def boundaries(gm: fx.GraphModule, stages: dict[fx.Node, int], num_stages: int) -> list[list[fx.Node]]:
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
    bounds = boundaries(gm, stages, num_stages)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"] if s == 0 else bounds[s - 1]
    outputs = None if s == num_stages - 1 else bounds[s]
    return fx.GraphModule(gm, _stage_graph(gm, stages, s, inputs, outputs), class_name=f"Stage{s}")


def tensor_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(parameter FQNs, buffer FQNs)`` of a module, tied tensors under every name, in registration order."""
    params = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    buffers = [n for n, _ in module.named_buffers(remove_duplicate=False)]
    return params, buffers
