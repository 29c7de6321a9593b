"""Annotation primitives ``replicate`` and ``split`` and the TaskGraphs they record (Whale paper, Jia et al.,
"Whale: Efficient Giant Model Training over Heterogeneous GPUs", USENIX ATC 2022, §3.1-3.2).

A scope tags every parameter and buffer *registered while it is active* (that is, created by modules
constructed inside the ``with`` block) with the scope. The tag lives on the owning module
(``module._whale_scopes[name]``), so it survives ``copy.deepcopy`` and ``state_dict`` round trips.
Tied parameters keep the tag of the scope that created them first.
"""

from __future__ import annotations

import contextvars
import fnmatch
import itertools
from dataclasses import dataclass

from torch import nn
from torch.nn.modules import module as _module_hooks

REPLICATE = "replicate"
SPLIT = "split"
_TAG_ATTR = "_whale_scopes"
_ids = itertools.count()
_stack: contextvars.ContextVar[tuple[Scope, ...]] = contextvars.ContextVar("whale_scope_stack", default=())
_default: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("whale_default_strategy", default=None)


class AnnotationError(ValueError):
    """An annotation that has no meaning (bad nesting, bad device count, a pattern that matches nothing)."""


@dataclass(frozen=True, eq=False)
class Scope:
    """One annotation: a primitive (``"replicate"`` or ``"split"``) over ``device_count`` devices.

    Used as a context manager around module construction; each ``Scope`` object is one TaskGraph.
    ``device_count=None`` means all devices of the VirtualDevice. ``parent`` is the enclosing scope for the
    one meaningful nesting, a ``split`` inside a ``replicate`` (a sharded operator inside each replica).
    """

    kind: str
    device_count: int | None = None
    uid: int = -1
    parent: Scope | None = None

    def __enter__(self) -> Scope:
        stack = _stack.get()
        if stack:
            _check_nesting(stack[-1], self)
        scope = self if not stack else Scope(self.kind, self.device_count, self.uid, stack[-1])
        if not stack:
            _install_hooks()
        self._tokens().append(_stack.set(stack + (scope,)))
        return scope

    def __exit__(self, *exc) -> None:
        _stack.reset(self._tokens().pop())
        if not _stack.get():
            _remove_hooks()

    def _tokens(self) -> list:
        return _TOKENS.setdefault(self.uid, [])

    def __repr__(self) -> str:
        n = "all" if self.device_count is None else self.device_count
        inner = f" inside {self.parent!r}" if self.parent is not None else ""
        return f"{self.kind}({n})#{self.uid}{inner}"


_TOKENS: dict[int, list] = {}


def _new_scope(kind: str, device_count: int | None) -> Scope:
    if device_count is not None and (not isinstance(device_count, int) or device_count < 1):
        raise AnnotationError(f"{kind}(device_count={device_count!r}): device_count must be an int >= 1 or None")
    return Scope(kind, device_count, next(_ids))


def replicate(device_count: int | None = None) -> Scope:
    """Data parallelism for the modules built inside: each device of the VD holds a copy and a share of the
    batch; gradients are all-reduced. ``device_count=None`` means all devices of the VD.

    Raises:
        AnnotationError: ``device_count`` is not a positive int or None.
    """
    return _new_scope(REPLICATE, device_count)


def split(device_count: int | None = None) -> Scope:
    """Operator sharding for the modules built inside: their parameters and work are cut along one dimension
    across the VD's devices (Megatron-LM style, Shoeybi et al. 2019; shards may be uneven).

    At run time each rank holds its shard (:func:`whale.parallel.split.shard_module`): an ``nn.Linear`` is
    sharded by output features (a lone Linear, such as a classification head, keeps class-sharded logits for
    :func:`whale.cross_entropy`), Linear -> elementwise -> Linear runs as a column- then row-sharded pair, and
    an ``nn.Embedding`` by vocabulary; other modules with parameters need a rule
    (:func:`whale.parallel.split.register_split_rule`). Shard sizes come from the plan (proportional to device
    FLOPS within memory on mixed clusters). The split group gathers the rows of its replicate neighbours'
    micro-batch at the boundary and hands each rank its own rows back (:mod:`whale.parallel.bridge`).

    Raises:
        AnnotationError: ``device_count`` is not a positive int or None.
    """
    return _new_scope(SPLIT, device_count)


def set_default_strategy(scope: Scope | None) -> None:
    """Strategy for modules outside every scope (``None`` restores the default: ``replicate()`` over all)."""
    if scope is not None and not isinstance(scope, Scope):
        raise AnnotationError(f"set_default_strategy expects replicate(...) or split(...), got {scope!r}")
    _default.set(scope)


def default_strategy() -> Scope:
    """The strategy unannotated modules take (``replicate()`` unless :func:`set_default_strategy` said)."""
    scope = _default.get()
    if scope is None:
        scope = Scope(REPLICATE, None, -1)
    return scope


def _check_nesting(outer: Scope, inner: Scope) -> None:
    if outer.kind == REPLICATE and inner.kind == SPLIT and outer.parent is None:
        return
    raise AnnotationError(
        f"{inner!r} is nested inside {outer!r}, which has no meaning: the only nesting Whale accepts is a "
        "split inside a top-level replicate (a sharded operator inside each replica). Close the outer scope "
        "first, or make the two TaskGraphs siblings."
    )


# --- tagging ------------------------------------------------------------------------------------------------
_handles: list = []


def _tag(module: nn.Module, name: str, value) -> None:
    stack = _stack.get()
    if not stack or value is None:
        return
    tags = module.__dict__.setdefault(_TAG_ATTR, {})
    tags.setdefault(name, stack[-1])


def _install_hooks() -> None:
    _handles.append(_module_hooks.register_module_parameter_registration_hook(_tag))
    _handles.append(_module_hooks.register_module_buffer_registration_hook(_tag))


def _remove_hooks() -> None:
    while _handles:
        _handles.pop().remove()


def annotate(model: nn.Module, mapping: dict[str, Scope]) -> nn.Module:
    """Annotate a model one cannot edit: ``{"module.path.pattern": replicate(...) | split(...)}``.

    Patterns are ``fnmatch`` globs over module FQNs (``"blocks.*"``, ``"lm_head"``); every parameter and buffer
    under a matched module is tagged with that scope (a later, more specific pattern wins). Returns ``model``.

    Raises:
        AnnotationError: a pattern matches no module, or a value is not a scope.
    """
    for pattern, scope in mapping.items():
        if not isinstance(scope, Scope):
            raise AnnotationError(f"annotate: value for {pattern!r} must be replicate(...) or split(...)")
        matched = [(n, m) for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            names = [n for n, _ in model.named_modules() if n][:8]
            raise AnnotationError(f"annotate: pattern {pattern!r} matches no module; module names look like {names}")
        for _, sub in matched:
            for mod in sub.modules():
                tags = mod.__dict__.setdefault(_TAG_ATTR, {})
                for pname, p in itertools.chain(mod._parameters.items(), mod._buffers.items()):
                    if p is not None:
                        tags[pname] = scope
    return model


def tensor_scopes(model: nn.Module) -> dict[str, Scope]:
    """FQN of every parameter and buffer (tied ones under each of their names) -> its recorded scope.

    Untagged tensors are absent. For tied tensors the first tag found wins for every name.
    """
    by_id: dict[int, Scope] = {}
    out: dict[str, Scope] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        tags = mod.__dict__.get(_TAG_ATTR, {})
        for pname, t in itertools.chain(mod._parameters.items(), mod._buffers.items()):
            if t is None:
                continue
            fqn = f"{mname}.{pname}" if mname else pname
            scope = tags.get(pname)
            if scope is not None:
                by_id.setdefault(id(t), scope)
            if id(t) in by_id:
                out[fqn] = by_id[id(t)]
    # second pass: a tied tensor first met untagged picks up its tag from a later name
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, t in itertools.chain(mod._parameters.items(), mod._buffers.items()):
            fqn = f"{mname}.{pname}" if mname else pname
            if t is not None and id(t) in by_id:
                out[fqn] = by_id[id(t)]
    return out


def own_scopes(model: nn.Module) -> dict[str, Scope]:
    """FQN -> scope of every parameter and buffer tagged under that very name (its module was built, or the
    tensor registered, inside the scope). Unlike :func:`tensor_scopes`, a tie does not carry a tag to the
    tensor's other names: an unannotated embedding tied to a head built in the last stage's scope stays
    unannotated, so it is never dragged out of its neighbourhood (the pipeline cut then shares the tensor)."""
    out: dict[str, Scope] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        tags = mod.__dict__.get(_TAG_ATTR, {})
        for pname, t in itertools.chain(mod._parameters.items(), mod._buffers.items()):
            if t is not None and tags.get(pname) is not None:
                out[f"{mname}.{pname}" if mname else pname] = tags[pname]
    return out


def top_level(scope: Scope) -> Scope:
    """The outermost scope of a (possibly nested) scope: the TaskGraph it belongs to."""
    while scope.parent is not None:
        scope = scope.parent
    return scope
