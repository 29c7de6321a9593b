"""Graph capture with ``torch.export`` (non-strict) for the pipeline stage cut.

Why export: ``torch.fx.symbolic_trace`` runs ``forward`` on proxies and fails on much of today's Python
(current ``transformers`` wraps ``forward`` in ``*args, **kwargs`` decorators and branches on shapes); non-strict
``torch.export`` runs ``forward`` as ordinary Python on fake tensors and records ATen operations, so it
captures Hugging Face models as they are. ``torch.distributed.pipelining`` builds on it too.

What Whale adds on top of the exported graph (``ExportedProgram.module()``), each because the stage cut needs it:

- **Split targets stay single calls.** The model is exported with ``preserve_module_call_signature`` for the
  plan's ``leaf_modules``; each one's ATen nodes are then replaced by one ``call_module`` node rebuilt from the
  recorded call signature (its input nodes, constants and argument structure), so the runtime can swap the
  module for its shards as with an fx trace.
- **Train and eval.** Export specializes on the mode (``aten.dropout(x, 0.1, True)`` in train, ``False`` and
  fewer ``contiguous`` calls in eval), so the model is captured in both modes; the stage module
  (:class:`ModalStage`) runs the eval graph when it or the model is in ``eval()``.
- **Any row count.** Every dimension of every tensor input is exported as ``Dim.AUTO``, and the guard module and
  tensor-metadata asserts are dropped, so a stage runs micro-batches of any size (uneven lanes).
- **The model's own tensors.** The graph is rebuilt on the model itself, so get_attr nodes and single calls
  reach the model's very parameters and modules under their original names.

Every rank re-captures from the plan's :class:`whale.plan.plan.CaptureInput` list (shapes and dtypes only:
export traces on fake tensors, values do not matter), and the node names come out the same.
"""

from __future__ import annotations

import gc
import inspect
import json

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import Dim

from whale.frontend.graph import StageError
from whale.plan.plan import CaptureInput

_DROPPED = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range")


def capture_inputs(inputs) -> tuple[CaptureInput, ...]:
    """The example of a sample batch's inputs: a tensor, a tuple/list of positional arguments, or a dict of
    keyword arguments; non-tensor values must be JSON scalars (``use_cache=False``).

    Raises:
        StageError: a value that is neither a tensor nor a JSON scalar (naming it).
    """
    items = inputs.items() if isinstance(inputs, dict) else \
        ((f"#{i}", v) for i, v in enumerate(inputs if isinstance(inputs, tuple | list) else (inputs,)))
    out = []
    for name, v in items:
        if isinstance(v, torch.Tensor):
            shape = (max(2, v.shape[0]), *v.shape[1:]) if v.dim() else ()
            out.append(CaptureInput(name, str(v.dtype).removeprefix("torch."), tuple(shape)))
        elif v is None or isinstance(v, bool | int | float | str):
            out.append(CaptureInput(name, constant=json.dumps(v)))
        else:
            raise StageError(f"input {name!r} is a {type(v).__name__}; capturing with torch.export takes tensors "
                             "and JSON scalars (bool, int, float, str, None) as forward arguments")
    return tuple(out)


def example_args(spec: tuple[CaptureInput, ...]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of zero tensors of the recorded shapes and dtypes, and the recorded constants."""
    args, kwargs = [], {}
    for c in spec:
        value = json.loads(c.constant) if not c.dtype else torch.zeros(c.shape, dtype=getattr(torch, c.dtype))
        if c.name.startswith("#"):
            args.append(value)
        else:
            kwargs[c.name] = value
    return tuple(args), kwargs


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Every dimension of every tensor argument as ``Dim.AUTO``, keyed by ``forward``'s parameter names."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return pytree.tree_map(lambda v: {d: Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) else None,
                           dict(bound))


#: torch.export's non-strict tracer now and then (about 1 start-up in 40 here, on one rank) loses track of a
#: tensor made inside ``forward`` (``torch.arange``) and refuses it as "a fake tensor in the exported program
#: constant's list"; the same capture succeeds when repeated, so it is retried this many times first.
EXPORT_RETRIES = 2
_TRANSIENT = "fake tensor in the exported program constant"


def _export(model: nn.Module, spec: tuple[CaptureInput, ...], leaves: tuple[str, ...]):
    """``torch.export.export(strict=False)`` of ``model`` on the example inputs of ``spec`` (every dimension
    dynamic), keeping ``leaves`` as single calls. A transient refusal (:data:`_TRANSIENT`) is retried up to
    :data:`EXPORT_RETRIES` times, with the cyclic garbage collector paused during each trace as a precaution (the
    tracer keeps its tensor records in weak-reference tables). The refusal's cause is not known: 150 exports of
    the GPT in one process, with a thread making cyclic garbage, did not reproduce it.

    Raises:
        StageError: export failed for another reason, or the transient refusal every time (with guidance).
    """
    args, kwargs = example_args(spec)
    for attempt in range(EXPORT_RETRIES + 1):
        paused = gc.isenabled()
        gc.disable()
        try:
            return torch.export.export(model, args, kwargs, strict=False,
                                       dynamic_shapes=_dynamic_shapes(model, args, kwargs),
                                       preserve_module_call_signature=tuple(leaves))
        except Exception as exc:  # noqa: BLE001 - re-raised with guidance
            if _TRANSIENT in str(exc) and attempt < EXPORT_RETRIES:
                continue
            raise StageError(
                f"pipelining {type(model).__name__} needs its graph, and torch.export.export(strict=False) failed: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. Common fixes: no Python "
                "branching on tensor values in forward (use torch.where / torch.cond), inputs as tensors or JSON "
                "scalars; or Config(capture='fx') to trace with torch.fx.symbolic_trace, or a single TaskGraph."
            ) from exc
        finally:
            if paused:
                gc.enable()
    raise AssertionError("unreachable")


def _path_get(node: fx.Node, graph: fx.Graph, path) -> fx.Node:
    """``node[k1].k2...`` as getitem/getattr nodes along a pytree key path."""
    import operator

    for key in path:
        if isinstance(key, pytree.GetAttrKey):
            node = graph.call_function(getattr, (node, key.name))
        else:
            node = graph.call_function(operator.getitem, (node, getattr(key, "idx", getattr(key, "key", None))))
    return node


def _collapse(graph: fx.Graph, fqn: str, sig, renamed: dict[str, fx.Node]) -> None:
    """Replace the nodes of module ``fqn`` by one ``call_module`` node from its recorded call signature.
    ``renamed``: the output nodes of leaves collapsed before (erased) -> what replaced them, so that a leaf fed
    by the one before it (two split blocks in a row) finds its input; updated here."""
    by_name = {n.name: n for n in graph.nodes}
    by_name.update(renamed)
    leaves = [by_name[a.name] if hasattr(a, "name") and a.name in by_name else getattr(a, "value", None)
              for a in sig.inputs]
    call_args, call_kwargs = pytree.tree_unflatten(leaves, sig.in_spec)
    outs = [by_name.get(getattr(a, "name", ""), None) for a in sig.outputs]
    first_out = next((o for o in outs if o is not None), None)
    anchor = first_out if first_out is not None else next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(anchor):
        call = graph.call_module(fqn, tuple(call_args), dict(call_kwargs))
    paths = [p for p, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(range(len(outs)), sig.out_spec))[0]]
    for out, path in zip(outs, paths, strict=True):
        if out is not None:
            with graph.inserting_after(call):
                renamed[out.name] = _path_get(call, graph, path)
                out.replace_all_uses_with(renamed[out.name])
    inside = [n for n in graph.nodes if any(p == fqn or p.startswith(fqn + ".")
                                            for p, _ in (n.meta.get("nn_module_stack") or {}).values())]
    kept = _shared_sizes(inside)
    for n in reversed(inside):
        if n in kept:
            continue
        if n.users:
            raise StageError(f"{fqn} cannot be kept as a single call: its value {n.name!r} is used outside it")
        graph.erase_node(n)


def _shared_sizes(inside: list[fx.Node]) -> set[fx.Node]:
    """The nodes of a collapsed module that stay in the graph: symbolic sizes (``SymInt`` arithmetic on the
    sizes of tensors from outside the module) that export computed inside it and shares with later code, e.g.
    ``batch * seq`` of a ``reshape(-1, d)`` reused by the next layer. Their inputs must come from outside or be
    such sizes themselves; anything else used outside stays inside (and :func:`_collapse` refuses it)."""
    members, kept = set(inside), set()
    for n in reversed(inside):
        used_outside = any(u not in members or u in kept for u in n.users)
        if used_outside and isinstance(n.meta.get("val"), torch.SymInt):
            kept.add(n)
    todo = list(kept)
    while todo:  # a kept size keeps the sizes it is computed from; one computed from a tensor inside cannot stay
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in members and a not in kept:
                if not isinstance(a.meta.get("val"), torch.SymInt):
                    return set()
                kept.add(a)
                todo.append(a)
    return kept


def _use_name(node: fx.Node, attr: fx.Node, tensors: dict) -> str:
    """The name ``node`` uses for the tensor ``attr`` reaches: the one under the module whose forward made the
    call, when that is the same tensor (export reaches a tied weight under one name), else ``attr``'s target."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack and isinstance(attr.target, str):
        path = str(list(stack.values())[-1][0]).split("@")[0]
        name = f"{path}.{attr.target.rsplit('.', 1)[-1]}" if path else attr.target
        if name in tensors and tensors[name] is tensors.get(attr.target):
            return name
    return attr.target


def _untie_names(graph: fx.Graph, model: nn.Module) -> None:
    """Every use of a tied tensor reads it under its calling module's name (``transformer.wte.weight`` in the
    embedding, ``lm_head.weight`` in the head), as an fx trace does, so each stage's ownership follows it."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for attr in [n for n in graph.nodes if n.op == "get_attr"]:
        for user in list(attr.users):
            name = _use_name(user, attr, tensors)
            if name != attr.target:
                with graph.inserting_before(user):
                    user.replace_input_with(attr, graph.get_attr(name))


def _clean(graph: fx.Graph, spec: tuple[CaptureInput, ...]) -> None:
    """Drop the guard call and metadata asserts; constant placeholders get their value as default."""
    constants = {c.name: json.loads(c.constant) for c in spec if not c.dtype}
    for n in list(graph.nodes):
        name = getattr(n.target, "__name__", str(n.target))
        if (n.op == "call_module" and n.target == "_guards_fn") or \
                (n.op == "call_function" and not n.users and any(d in name for d in _DROPPED)):
            graph.erase_node(n)
        elif n.op == "placeholder" and n.target in constants:
            n.args = (constants[n.target],)
    for n in reversed(list(graph.nodes)):
        if n.op == "get_attr" and not n.users:
            graph.erase_node(n)


class OutputStructure(nn.Module):
    """The model's output structure (e.g. a ``CausalLMOutputWithPast``) rebuilt from the graph's flat outputs."""

    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, *leaves):
        """``tree_unflatten(leaves, spec)``."""
        return pytree.tree_unflatten(list(leaves), self.spec)


def export_graph(model: nn.Module, spec: tuple[CaptureInput, ...], leaves: tuple[str, ...],
                 train: bool) -> fx.GraphModule:
    """``model`` captured by ``torch.export`` in train (or eval) mode, rebuilt on ``model`` (see the module
    docstring); every module's ``training`` flag is restored afterwards.

    Raises:
        StageError: export failed (naming the error and common fixes), or a leaf module cannot be a single call.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train(train)
        ep = _export(model, spec, leaves)
    finally:
        for m, flag in modes:
            m.training = flag
    graph = fx.Graph()  # a copy owned by no module: nodes can call modules the exported one lacks
    flat_out = graph.graph_copy(ep.module().graph, {})
    graph.output(flat_out)
    renamed: dict[str, fx.Node] = {}
    for entry in ep.module_call_graph:
        if entry.fqn in leaves:
            _collapse(graph, entry.fqn, entry.signature, renamed)
    _untie_names(graph, model)
    _clean(graph, spec)
    out = next(n for n in graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], list | tuple) else (out.args[0],)
    with graph.inserting_before(out):
        structured = graph.call_module("_whale_output", tuple(flat))
    out.args = (structured,)
    graph.set_codegen(fx.graph.CodeGen())
    graph.lint()
    root = nn.Module()
    root.__dict__.update(model.__dict__)  # the model's own parameters, buffers and submodules, not copies
    root._modules = {**model._modules, "_whale_output": OutputStructure(ep.call_spec.out_spec)}
    return fx.GraphModule(root, graph, type(model).__name__)


class ModalStage(nn.Module):
    """A pipeline stage captured in both modes: runs ``train_module`` while it and ``model`` train, else
    ``eval_module``. Both are ``GraphModule`` s over the same submodules; this module shares their tensors
    and names (``named_parameters()`` equals the train stage's), so optimizers and checkpoints see one stage.

    Raises (on construction):
        StageError: the eval stage uses a tensor the train stage does not hold.
    """

    def __init__(self, train_module: fx.GraphModule, eval_module: fx.GraphModule, model: nn.Module) -> None:
        super().__init__()
        names = {n for n, _ in train_module.named_parameters(remove_duplicate=False)}
        names |= {n for n, _ in train_module.named_buffers(remove_duplicate=False)}
        extra = [n for n, _ in [*eval_module.named_parameters(remove_duplicate=False),
                                *eval_module.named_buffers(remove_duplicate=False)] if n not in names]
        if extra:
            raise StageError(f"the eval-mode graph of this stage uses {extra[:3]}, which its train-mode graph does "
                             "not; the model's forward uses other parameters in eval(): pipeline it with a single "
                             "TaskGraph or Config(capture='fx')")
        self._modules, self._parameters, self._buffers = \
            train_module._modules, train_module._parameters, train_module._buffers
        self._non_persistent_buffers_set = train_module._non_persistent_buffers_set  # one state dict
        eval_module._modules = train_module._modules  # one set of submodules: .to() and buffers stay shared
        self.__dict__.update(_whale_train=train_module, _whale_eval=eval_module, _whale_model=model)

    def forward(self, *args, **kwargs):
        """The stage's train or eval graph (shapes are the stage's own)."""
        module = self._whale_train if self.training and self._whale_model.training else self._whale_eval
        return module.forward(*args, **kwargs)
