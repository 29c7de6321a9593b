"""Activation checkpointing: chosen modules drop their activations after forward and recompute them in backward
(``torch.utils.checkpoint``, non-reentrant).

Choosing (front end, :func:`resolve_targets`): ``Config.activation_checkpoint`` (``"all"``, module types, FQN
globs, TaskGraph indices) becomes a list of module FQNs recorded in the plan (``Plan.activation_checkpoint``);
the runtime applies exactly that list (:func:`apply_checkpointing`) and decides nothing.

Applying (runtime), by what this rank's stage module is:

- **The user's model** (no pipeline): each chosen module's ``forward`` is wrapped in place (an instance
  attribute; the module, its FQNs and its hooks stay as they are), so any model works, Hugging Face included.
- **A pipeline stage** (a ``torch.fx`` ``GraphModule``, or the train graph of an export-captured
  :class:`~whale.frontend.export.ModalStage`): a stage graph's nodes are ATen or function calls, not the
  chosen modules, so the nodes each module produced (by the ``nn_module_stack`` both captures record) are cut
  out, run by contiguous node ranges as one sub-graph each, and checkpointed as one call. Parameters stay where
  they are (the sub-graph reads them by the same names); the stage's ``named_parameters`` do not change.

RNG: ``torch.utils.checkpoint`` saves the CPU (and device) generator state before the first forward and
restores it for the recompute, so dropout masks are identical; the state it saves is that of Whale's lane
stream (:mod:`whale.runtime.rng`), swapped in around the whole stage's forward. Split regions have streams of
their own that advance per micro-batch, so a checkpointed module may neither contain nor sit inside a split
module (refused at planning). A module whose forward mutates its inputs in place would apply the mutation twice
on recompute; stage graphs with such nodes are refused.

Buffers: the recompute runs on copies of the buffers the chosen module updates, holding what they held before
its first forward, and leaves the module's own untouched (:mod:`whale.memory.recompute_state`): BatchNorm's
running statistics and ``num_batches_tracked``, or any buffer a forward updates, end as after one forward, and
the recomputed activations equal the first ones.
"""

from __future__ import annotations

import fnmatch
import operator

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from whale.memory.recompute_state import BufferWatch
from whale.memory.tracker import recomputing
from whale.plan.checks import PlanError


class CheckpointError(PlanError):
    """Activation checkpointing cannot apply as asked; the message names the module and the fix."""


# --- choosing (front end) --------------------------------------------------------------------------------
def repeated_layers(model: nn.Module) -> list[str]:
    """FQNs of the outermost children of ``ModuleList``/``Sequential`` containers (the repeated layers)."""
    out: list[str] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        """Collect the children of containers under ``mod``; do not descend into a collected layer."""
        for name, child in mod.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(mod, nn.ModuleList | nn.Sequential) and next(child.parameters(), None) is not None:
                out.append(fqn)
            else:
                walk(child, fqn + ".")
    walk(model, "")
    return out


def layer_units(model: nn.Module) -> list[str]:
    """FQNs of the units a whole-model stage is handled in layer by layer (ZeRO-3's gather/free units): its
    :func:`repeated_layers`, else its direct children that hold parameters (containers aside)."""
    return repeated_layers(model) or [n for n, c in model.named_children() if next(c.parameters(), None)
                                      is not None and not isinstance(c, nn.ModuleList | nn.ModuleDict)]


def _matches(entry, named: dict[str, nn.Module], task_graphs, units: list[str]) -> list[str]:
    if isinstance(entry, int):
        if entry >= len(task_graphs):
            raise CheckpointError(f"activation_checkpoint lists TaskGraph {entry} but the model has "
                                  f"{len(task_graphs)} TaskGraph(s) (0..{len(task_graphs) - 1})")
        mods = task_graphs[entry].modules
        return [u for u in units if any(m in ("", u) or u.startswith(m + ".") for m in mods)]
    return [n for n, m in named.items() if n and (type(m).__name__ == entry or fnmatch.fnmatchcase(n, entry))]


def resolve_targets(model: nn.Module, spec, task_graphs=(), split_targets=(), units=()) -> tuple[str, ...]:
    """The module FQNs ``Config.activation_checkpoint`` ``spec`` selects in ``model``, outermost only, in model
    order (see :class:`whale.config.Config`).

    Args:
        model: the full local model.
        spec: ``()``, ``"all"`` or a tuple of class names, FQN globs and TaskGraph indices.
        task_graphs: the plan's TaskGraphs (for TaskGraph indices).
        split_targets: FQNs of the modules run under ``split``.
        units: the layer units of the model (``whale.frontend.profile.default_units``), for TaskGraph indices.

    Raises:
        CheckpointError: an entry that matches no module (naming the model's module types), a TaskGraph index
            out of range, or a chosen module that contains or sits inside a split module.
    """
    if not spec:
        return ()
    named = dict(model.named_modules())
    if spec == "all":
        chosen = set(repeated_layers(model)) or set(units) - {""}
    else:
        chosen = set()
        for entry in spec:
            hits = _matches(entry, named, task_graphs, list(units))
            if not hits:
                types = sorted({type(m).__name__ for m in named.values()})
                raise CheckpointError(f"activation_checkpoint entry {entry!r} matches no module of "
                                      f"{type(model).__name__}; its module types are {types[:12]}; FQN globs look "
                                      "like 'blocks.*'")
            chosen.update(hits)
    names = [n for n in named if n in chosen and not any(n.startswith(o + ".") for o in chosen)]
    for n in names:
        for s in split_targets:
            if n == s or n.startswith(s + ".") or s.startswith(n + "."):
                raise CheckpointError(f"activation checkpointing of {n!r} overlaps the split module {s!r}: a split "
                                      "region's random streams advance per micro-batch, so its recompute is not "
                                      "supported; checkpoint modules outside the split ones")
    return tuple(names)


# --- applying (runtime) ----------------------------------------------------------------------------------
class _Checkpointed:
    """``fn`` under ``torch.utils.checkpoint`` (non-reentrant, RNG preserved) while gradients are on; the
    recompute in backward is marked for the memory tracker (:func:`whale.memory.tracker.recomputing`) and runs
    on copies of the buffers of ``owner`` that the first forward saw (:mod:`whale.memory.recompute_state`), so
    buffers end as after one forward."""

    def __init__(self, fn, owner: nn.Module) -> None:
        self.fn = fn
        self.watch = BufferWatch(owner)

    def _run(self, call, *args, **kwargs):
        if torch._C._current_graph_task_id() != -1:  # inside backward: this is the recompute
            with recomputing(), self.watch.replay(call):
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        tracing = torch.fx._symbolic_trace.is_fx_symbolic_tracing() or torch.compiler.is_compiling()
        if not torch.is_grad_enabled() or tracing:
            return self.fn(*args, **kwargs)
        call = self.watch.begin()
        out = checkpoint(self._run, call, *args, use_reentrant=False, **kwargs)
        self.watch.end(call)
        return out


class _ClassForward:
    """``type(module).forward(module, ...)``, looked up at each call: a class swapped after wrapping (global
    BatchNorm, :func:`whale.runtime.buffers.convert_batchnorm`) is followed."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


def _wrap_forward(module: nn.Module) -> None:
    """Checkpoint ``module``'s forward in place (an instance attribute; undone by deleting it)."""
    current = module.__dict__.get("forward")
    if isinstance(current, _Checkpointed):
        return
    module.forward = _Checkpointed(current if current is not None else _ClassForward(module), module)


def unwrap(model: nn.Module) -> None:
    """Undo :func:`apply_checkpointing` on the modules of ``model`` whose forward was wrapped in place."""
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), _Checkpointed):
            del m.forward


def apply_checkpointing(module: nn.Module, names: tuple[str, ...]) -> int:
    """Checkpoint the modules ``names`` (FQNs) of this rank's stage ``module`` (see the module docstring).

    Returns:
        How many checkpointed calls were installed (modules wrapped, or node ranges in a stage graph).

    Raises:
        CheckpointError: a stage graph where a chosen module's nodes mutate a value made outside them.
    """
    if not names:
        return 0
    graph_module = getattr(module, "_whale_train", module)  # an export capture's train graph
    if isinstance(graph_module, fx.GraphModule):
        return _checkpoint_graph(graph_module, names)
    wrapped = 0
    for name in names:
        try:
            target = module.get_submodule(name)
        except AttributeError:
            continue  # held by another stage (or replaced by a split region)
        _wrap_forward(target)
        wrapped += 1
    return wrapped


def _owner(node: fx.Node, names: tuple[str, ...]) -> str | None:
    """The chosen module whose forward produced ``node`` (from ``nn_module_stack``), or None."""
    paths = [str(v[0]).split("@")[0] for v in (node.meta.get("nn_module_stack") or {}).values()]
    if node.op == "call_module":
        paths.append(str(node.target))
    return next((n for n in names if any(p == n or p.startswith(n + ".") for p in paths)), None)


def _runs(gm: fx.GraphModule, names: tuple[str, ...]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive compute nodes produced by one chosen module."""
    runs: list[list[fx.Node]] = []
    last = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        owner = _owner(node, names) if node.op != "output" else None
        if owner is not None and owner == last:
            runs[-1].append(node)
        elif owner is not None:
            runs.append([node])
        last = owner
    return runs


def _mutates_outside(node: fx.Node, inside: set[fx.Node]) -> bool:
    schema = getattr(node.target, "_schema", None)
    mutating = (schema is not None and schema.is_mutable) or \
        (node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("_"))
    first = node.args[0] if node.args else None
    return mutating and isinstance(first, fx.Node) and first not in inside and first.op != "get_attr"


def _checkpoint_graph(gm: fx.GraphModule, names: tuple[str, ...]) -> int:
    runs = _runs(gm, names)
    for i, run in enumerate(runs):
        _replace_run(gm, run, i)
    if runs:
        gm.graph.lint()
        gm.recompile()
    return len(runs)


def _replace_run(gm: fx.GraphModule, run: list[fx.Node], index: int) -> None:
    """Move ``run`` into a sub-graph called once under checkpoint; its outside users read the call's outputs."""
    inside = set(run)
    bad = next((n for n in run if _mutates_outside(n, inside)), None)
    if bad is not None:
        raise CheckpointError(f"graph node {bad.name!r} ({bad.target}) mutates a value made outside its checkpointed "
                              "module; the recompute would apply the change twice: checkpoint another module")
    sub, env, inputs = fx.Graph(), {}, []
    for node in run:
        for a in node.all_input_nodes:
            if a in inside or a in env:
                continue
            env[a] = sub.get_attr(a.target) if a.op == "get_attr" else sub.placeholder(f"in_{len(inputs)}")
            if a.op != "get_attr":
                inputs.append(a)
        env[node] = sub.node_copy(node, lambda n: env[n])
    outs = [n for n in run if any(u not in inside for u in n.users)]
    sub.output(tuple(env[n] for n in outs))
    part = fx.GraphModule(gm, sub, f"Checkpointed{index}")
    fn = _Checkpointed(part, part)
    fn.__name__ = f"whale_checkpoint_{index}"
    with gm.graph.inserting_before(run[0]):
        call = gm.graph.call_function(fn, tuple(inputs))
        for k, n in enumerate(outs):
            n.replace_all_uses_with(gm.graph.call_function(operator.getitem, (call, k)))
    for node in reversed(run):
        gm.graph.erase_node(node)
