"""The split rule registry and the plan-time split check, importing nothing of Whale's (only ``torch.nn``).

The sharding rules themselves (sharded Linear / Embedding layers, the ``nn.Sequential`` column → row fusion)
live in :mod:`whale.parallel.split`, which registers them here on import and re-exports every name of this
module; ``wh.SplitError`` and ``wh.register_split_rule`` are these same objects. The front end
(:func:`whale.plan_model`, ``whale plan``) must not import :mod:`whale.parallel`, so this module also knows,
for each module type, which dim a split cuts, and :func:`check_split_plan` refuses at plan time what the
runtime could not shard, naming the module, its type, the dim and its size, and the device count:

- built in: ``nn.Linear`` cuts ``out_features``; ``nn.Embedding`` cuts ``num_embeddings`` (and refuses
  ``max_norm`` / ``scale_grad_by_freq``); ``nn.Sequential`` is walked as the runtime shards it: a Linear →
  elementwise modules → Linear run is bounded by the first Linear's ``out_features``, other children are
  checked one by one;
- a registered rule: ``register_split_rule(MyModule, rule, dim_size=fn)``, with ``fn(module) -> int`` the size
  of the dim ``rule`` cuts, is checked against the device count; without ``dim_size`` the type is accepted
  with no size check (the rule itself decides at run time); ``check=fn``, with ``fn(module, n) -> str | None``
  the reason the rule cannot shard this module over ``n`` devices (``None``: it can), refuses it at plan time;
- parameter-free modules pass; containers without parameters of their own are walked; any other module that
  holds parameters of its own is refused (no rule);
- a split scope holding loose parameters rather than whole modules is refused, except the whole model (all of
  the split's tensors are the root module's own parameters), which is then checked as one module;
- rules for other libraries' module types load lazily, the first time a type of that library is met
  (:data:`_PROVIDERS`): Hugging Face ``transformers`` (:mod:`whale.splitrules_hf` for the plan-time checks,
  :mod:`whale.parallel.split_hf` for the shards), so neither Whale nor planning ever imports the library.

A split over n devices cuts each sharded dim into n shards of at least one element, so the dim must have at
least n elements (hardware-aware shard sizes only move elements between shards).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

__all__ = ["SplitError", "SplitRule", "DimSize", "ELEMENTWISE", "register_split_rule", "split_rule_for",
           "check_split_plan", "check_split_module", "searchable_split_dim"]


class SplitError(ValueError):
    """A module under ``split`` cannot be sharded (no rule for its type, a dim smaller than the device count, an
    unsupported option, an undeclared shard layout, or a tie that sharding would break)."""


SplitRule = Callable[..., nn.Module]
"""``rule(module, group, sizes, **ctx) -> nn.Module``: this rank's shard of ``module``. ``sizes`` is the shard
sizes along the rule's dim or ``None``; ``ctx`` has ``weights`` (relative load shares or ``None``) and
``gather_output`` (whether the caller needs the full output rather than a sharded last dim)."""

DimSize = Callable[[nn.Module], int]
"""``dim_size(module) -> int``: the size of the dim a rule cuts, checked at plan time against the device
count."""

ELEMENTWISE: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Dropout, nn.Identity,
)
"""Parameter-free modules that act elementwise and so may sit between a column and a row shard, or after a
sharded output, without communication."""

_RULES: dict[type, SplitRule] = {}
_DIM_SIZES: dict[type, DimSize] = {}  # registered dim_size functions of user rules
_CHECKS: dict[type, Callable[[nn.Module, int], str | None]] = {}  # registered check functions of user rules
_BUILTIN_RULES: set[type] = set()  # types whose rule is Whale's own (registered by whale.parallel.split)


def register_split_rule(module_type: type, rule: SplitRule, dim_size: DimSize | None = None,
                        check: Callable[[nn.Module, int], str | None] | None = None) -> None:
    """Use ``rule`` for modules of ``module_type`` (and subclasses without a rule of their own) under split.
    Registering a type again replaces its rule (and its ``dim_size``).

    Args:
        module_type: an ``nn.Module`` subclass.
        rule: ``rule(module, group, sizes, **ctx) -> nn.Module``, this rank's shard (see :data:`SplitRule`).
        dim_size: ``dim_size(module) -> int``, the size of the dim ``rule`` cuts; :func:`whale.plan_model`
            then refuses a split over more devices than that, naming the module. ``None``: no plan-time size
            check for this type. ``Config(auto=True)`` searches split degrees (those dividing it) only for
            modules whose rule has one (:func:`searchable_split_dim`).
        check: ``check(module, n) -> str | None``: why ``rule`` cannot shard this module over ``n`` devices
            (``None``: it can); refused at plan time with that reason, and never chosen by the search.

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass, or ``rule`` / ``dim_size`` is not callable.
    """
    _check_type(module_type)
    if not callable(rule):
        raise TypeError(f"rule must be callable, got {rule!r}")
    if dim_size is not None and not callable(dim_size):
        raise TypeError(f"dim_size must be None or callable (module -> int), got {dim_size!r}")
    if check is not None and not callable(check):
        raise TypeError(f"check must be None or callable (module, n -> str | None), got {check!r}")
    _RULES[module_type] = rule
    if check is None:
        _CHECKS.pop(module_type, None)
    else:
        _CHECKS[module_type] = check
    _BUILTIN_RULES.discard(module_type)
    if dim_size is None:
        _DIM_SIZES.pop(module_type, None)
    else:
        _DIM_SIZES[module_type] = dim_size


def _register_builtin(module_type: type, rule: SplitRule) -> None:
    """Whale's own rules (:mod:`whale.parallel.split`): their dims are known here (:data:`_BUILTIN_DIMS`), or
    they need no plan-time check (already-sharded layers)."""
    _check_type(module_type)
    _RULES[module_type] = rule
    _DIM_SIZES.pop(module_type, None)
    _BUILTIN_RULES.add(module_type)


def _register_builtin_check(module_type: type, check: Callable[[nn.Module, str, int], None]) -> None:
    """A plan-time check of Whale's own for a rule that loads lazily (``check(module, fqn, n)`` raises
    :class:`SplitError`, as the entries of :data:`_BUILTIN_DIMS`)."""
    _check_type(module_type)
    _BUILTIN_DIMS[module_type] = check


def _register_lazy_builtin(module_type: type, rule: SplitRule) -> None:
    """A rule of Whale's that loads lazily: registered unless the user already registered one for the type."""
    if module_type not in _RULES:
        _register_builtin(module_type, rule)


_PROVIDERS: dict[str, tuple[str, str]] = {
    "transformers": ("whale.splitrules_hf", "whale.parallel.split_hf"),
}
"""Top-level package of a module type -> (module registering its plan-time checks, module registering its
runtime rules), imported the first time a type from that package is looked up (by name: planning never
imports :mod:`whale.parallel`)."""
_LOADED: set[str] = set()


def _provide(module_type: type, runtime: bool) -> None:
    """Import the providers for the packages of ``module_type`` and its bases (runtime rules too if
    ``runtime``), once each."""
    for cls in module_type.__mro__:
        names = _PROVIDERS.get(cls.__module__.partition(".")[0])
        for name in (names or ())[: 2 if runtime else 1]:
            if name not in _LOADED:
                _LOADED.add(name)
                importlib.import_module(name)


def _check_type(module_type) -> None:
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")


def split_rule_for(module_type: type) -> SplitRule | None:
    """The rule for ``module_type``: its own, else the nearest base class's; ``None`` if there is none.

    Raises:
        SplitError: the rule is a base class's but ``module_type`` overrides ``forward`` (the base's shard
            would silently drop the subclass's computation).
    """
    _provide(module_type, runtime=True)
    for cls in module_type.__mro__:
        if cls in _RULES:
            _check_forward_kept(module_type, cls)
            return _RULES[cls]
    return None


def _check_forward_kept(module_type: type, base: type) -> None:
    """Refuse inheriting ``base``'s rule when a class between ``module_type`` and ``base`` defines forward."""
    for cls in module_type.__mro__:
        if cls is base:
            return
        if "forward" in cls.__dict__:
            raise SplitError(
                f"split would shard {_name(module_type)} with the rule of its base class {base.__name__}, but "
                f"{cls.__name__} overrides forward, which the shard would not run; register a rule for it with "
                f"whale.register_split_rule({module_type.__name__}, rule, dim_size=fn)")


# --- plan-time check ------------------------------------------------------------------------------------
def split_modules(model: nn.Module, targets: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """``(module FQN, shard weights)`` of the modules a stage splits, from the plan's split targets: a model
    built whole under split (its targets are all loose root parameters) is the root module ``""``."""
    own = dict(model.named_parameters(recurse=False))
    loose = [(n, w) for n, w in targets if "." not in n and n in own]
    if loose and len(loose) == len(targets):
        return [("", loose[0][1])]
    return list(targets)


def linear_pairs(children: list[nn.Module]) -> list[tuple[int, int | None]]:
    """How a ``nn.Sequential``'s children shard, in order: ``(i, j)`` for a Linear at i followed (past
    elementwise modules only) by a Linear at j, cut column then row with no communication in between;
    ``(i, None)`` for a child sharded on its own."""
    out, i = [], 0
    while i < len(children):
        j = i + 1
        while j < len(children) and isinstance(children[j], ELEMENTWISE):
            j += 1
        if type(children[i]) is nn.Linear and j < len(children) and type(children[j]) is nn.Linear:
            out.append((i, j))
            i = j + 1
        else:
            out.append((i, None))
            i += 1
    return out


def check_split_plan(model: nn.Module, plan) -> None:
    """Refuse, before any process starts, a plan whose split targets the runtime could not shard.

    Checks every stage's :meth:`~whale.plan.plan.Plan.split_targets` over ``plan.stage_width`` devices (width 1
    shards nothing), the way :class:`whale.parallel.regions.SplitRuntime` will install them.

    Raises:
        SplitError: a target that is not a whole module, a module type with parameters of its own and no rule,
            a sharded dim smaller than the device count, or an unsupported option; the message names the
            module's FQN and type, the dim and its size, the device count and the fix.
    """
    if not plan.uniform_width:  # the plan itself refuses split in stages of different widths
        return
    n = plan.stage_width
    if n <= 1:
        return
    for stage in range(plan.num_stages):
        for name, _ in split_modules(model, plan.split_targets(stage)):
            if name == "":  # the whole model was built under split
                check_split_module(model, n, "")
                continue
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise SplitError(
                    f"split over {n} devices holds {name!r}, which is not a whole module: put whole modules "
                    "(e.g. an nn.Linear) inside a split scope, not loose parameters") from None
            check_split_module(module, n, name)


def check_split_module(module: nn.Module, n: int, fqn: str = "") -> None:
    """Check that ``module`` (at ``fqn`` in the model) can be sharded over ``n`` devices, walking it as
    :func:`whale.parallel.split.shard_module` does (see the module docstring).

    Raises:
        SplitError: naming the module, its type, the dim and its size, ``n`` and the fix.
    """
    if module is None or next(module.parameters(), None) is None:
        return
    cls = type(module)
    _provide(cls, runtime=False)
    for base in cls.__mro__:
        if base in _RULES or base in _BUILTIN_DIMS:
            _check_forward_kept(cls, base)
        if base in _RULES and base not in _BUILTIN_RULES:  # a rule of the user's
            dim_size = _DIM_SIZES.get(base)
            if dim_size is not None:
                size = dim_size(module)
                if isinstance(size, bool) or not isinstance(size, int):
                    raise SplitError(f"the dim_size registered for {_name(base)} returned {size!r} for "
                                     f"{_where(fqn)}; it must return the size of the dim the rule cuts, an int")
                _bound(module, fqn, f"the dim its registered rule cuts (dim_size of {base.__name__})", size, n,
                       user=base.__name__)
            why = _CHECKS[base](module, n) if base in _CHECKS else None
            if why:
                raise SplitError(f"split over {n} devices cannot shard {_where(fqn)} ({_name(cls)}): {why}")
            return
        if base in _BUILTIN_DIMS:
            _BUILTIN_DIMS[base](module, fqn, n)
            return
        if base in _RULES:  # a rule of Whale's with nothing to check here
            return
    own = [name for name, p in module._parameters.items() if p is not None]
    if own:
        raise SplitError(
            f"split over {n} devices has no sharding rule for {_where(fqn)} ({_name(cls)}), which holds "
            f"parameters of its own ({', '.join(own)}); register one before planning with "
            f"whale.register_split_rule({cls.__name__}, rule, dim_size=fn), where rule(module, group, sizes, "
            "**ctx) returns this rank's shard and dim_size(module) the size of the dim it cuts (see the "
            "whale.parallel.split docs), or build the module outside the split scope")
    for name, child in module.named_children():
        check_split_module(child, n, _join(fqn, name))


def searchable_split_dim(module: nn.Module, degrees: tuple[int, ...]) -> int | None:
    """The size of the dim a registered rule of the user's cuts in ``module`` (its ``dim_size``), when the rule
    has one and passes :func:`check_split_module` at every degree of ``degrees`` that divides it; else ``None``
    (no rule of the user's, no ``dim_size``, or a degree it refuses). ``Config(auto=True)`` searches split
    degrees only for such modules, and only those dividing the size. Whale's own rules (a lone ``nn.Linear``
    shards its output, which the loss must then take sharded) are not searched."""
    cls = type(module)
    base = next((b for b in cls.__mro__ if b in _RULES), None)
    if base is None or base in _BUILTIN_RULES or base not in _DIM_SIZES:
        return None
    size = _DIM_SIZES[base](module)
    try:
        for n in degrees:
            if n > 1 and isinstance(size, int) and size % n == 0:
                check_split_module(module, n)
    except SplitError:
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _bound(module: nn.Module, fqn: str, dim: str, size: int, n: int, note: str = "", user: str = "") -> None:
    """Refuse cutting ``dim`` of ``size`` elements into ``n`` shards of at least one element each (``user``: the
    type whose registered rule and ``dim_size`` apply, when not one of Whale's own)."""
    if size >= n:
        return
    cls = type(module)
    fix = (f"or a rule for {user} that cuts another dim" if user else
           f"or register a split rule that cuts another dim (whale.register_split_rule({cls.__name__}, rule, "
           "dim_size=fn))")
    raise SplitError(
        f"split over {n} devices cannot shard {_where(fqn)} ({_name(cls)}){note}: it cuts {dim}, of size {size}, "
        f"into {n} shards (one per device, each at least one element); use at most {size} device(s) for this "
        f"split, a larger {'dim' if user else dim}, {fix}")


def _linear_dims(module: nn.Linear, fqn: str, n: int) -> None:
    _bound(module, fqn, "out_features", module.out_features, n)


def _embedding_dims(module: nn.Embedding, fqn: str, n: int) -> None:
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise SplitError(f"split over {n} devices cannot shard {_where(fqn)} ({_name(type(module))}): split of "
                         "nn.Embedding does not support max_norm or scale_grad_by_freq (their per-batch "
                         "statistics would be wrong on a shard); drop the option or build it outside the split")
    _bound(module, fqn, "num_embeddings", module.num_embeddings, n)


def _sequential_dims(module: nn.Sequential, fqn: str, n: int) -> None:
    """As ``_sequential_rule``: a Linear → elementwise* → Linear run is column then row sharded, both along the
    first Linear's out_features; every other child is checked on its own."""
    kids: list[tuple[str, nn.Module]] = list(module._modules.items())
    for i, j in linear_pairs([m for _, m in kids]):
        if j is None:
            check_split_module(kids[i][1], n, _join(fqn, kids[i][0]))
            continue
        first, second = _join(fqn, kids[i][0]), _join(fqn, kids[j][0])
        _bound(kids[i][1], first, "out_features", kids[i][1].out_features, n,
               note=f", the column half of the Linear pair {first!r} -> {second!r}")


_BUILTIN_DIMS: dict[type, Callable[[nn.Module, str, int], None]] = {
    nn.Linear: _linear_dims, nn.Embedding: _embedding_dims, nn.Sequential: _sequential_dims,
}
"""Whale's built-in rules by type: ``check(module, fqn, n)`` raises :class:`SplitError` when the rule could not
shard ``module`` over ``n`` devices (the runtime's rules are in :mod:`whale.parallel.split`)."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _where(fqn: str) -> str:
    return f"module {fqn!r}" if fqn else "the whole model"


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

