"""split, bookkeeping: how each parameter of a sharded module is laid out, tied shards, and whole tensors back.

**Layout.** Every module holding parameters inside a split region declares, with a ``shard_layout()`` method,
how each of its own parameters lies across the split group: ``{name: dim}`` for a parameter cut along
``dim`` into the module's ``sizes`` (one entry per rank of the group, in group-rank order), ``{name: None}``
for one replicated whole on every rank (a row-parallel Linear's bias). A module whose parameters fuse ``k``
tensors cut alike (GPT-2's q|k|v projection) sets ``fused_parts = k``: each rank's slice along ``dim`` is then
``k`` equal blocks, one of each fused tensor, and ``sizes`` counts all ``k``. Whale's sharded layers
(:mod:`whale.parallel.split`) declare theirs; a custom split rule's module must too (otherwise
:func:`whale.parallel.split.shard_module` refuses it). The layout decides:

- the gradient norm (:func:`whale.runtime.groups.norm_owned_params`): a sharded parameter counts on every
  rank of the group, a replicated one on one rank only (:func:`replicated_param_ids`);
- the consolidated model (:func:`gather_full_state`): shards are all-gathered with the uneven ``sizes``.

**Ties.** A weight shared by two modules under split (an embedding and an LM head) must stay one parameter:
while :func:`shard_ties` is active, every slice of one full parameter cut the same way (same dim, start and
size, or replicated) is the same sharded ``nn.Parameter``. A vocabulary-sharded ``nn.Embedding`` and a
column-sharded ``nn.Linear`` head over the same vocabulary cut the shared ``[V, d]`` weight along dim 0, so with
the same shard sizes they share their shard. A tie that cannot be kept (cut two ways, or shared with a module
outside the split) is refused by :meth:`SplitTies.check`, naming the modules; one tied across pipeline stages
into a split module by :func:`check_cross_stage_ties`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch import nn

from whale.parallel.split_ops import all_gather, group_size
from whale.splitrules import SplitError  # defined in the neutral registry module so the planner can raise it

Layout = tuple[int | None, tuple[int, ...]]
"""``(dim, sizes)`` of one parameter: cut along ``dim`` into ``sizes``, or ``(None, ())`` when replicated."""


# --- layout ---------------------------------------------------------------------------------------------
def declared_layout(module: nn.Module) -> dict[str, Layout]:
    """``{parameter FQN under module: (dim, sizes)}`` for every parameter whose module declares it with
    ``shard_layout()`` (tied parameters under each of their names). Undeclared parameters are absent."""
    out: dict[str, Layout] = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        layout = getattr(mod, "shard_layout", None)
        if not callable(layout):
            continue
        for pname, dim in layout().items():
            if mod._parameters.get(pname) is None:
                continue
            sizes = () if dim is None else tuple(int(s) for s in mod.sizes)
            out[f"{mname}.{pname}" if mname else pname] = (dim, sizes)
    return out


def undeclared_params(module: nn.Module) -> list[str]:
    """FQNs of parameters under ``module`` that no ``shard_layout()`` declares."""
    known = declared_layout(module)
    return [n for n, _ in module.named_parameters(remove_duplicate=False) if n not in known]


def replicated_param_ids(module: nn.Module) -> set[int]:
    """``id`` of every parameter declared replicated across its split group (counted once per group in the
    gradient norm, not once per shard)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {id(params[n]) for n, (dim, _) in declared_layout(module).items() if dim is None and n in params}


# --- ties -----------------------------------------------------------------------------------------------
_ACTIVE: ContextVar[SplitTies | None] = ContextVar("whale_split_ties", default=None)


class SplitTies:
    """The sharded parameters made from each full parameter while :func:`shard_ties` is active.

    Args:
        module: the module about to be sharded (its parameter names, for messages).
        plan: the plan (``None``: no cross-stage check); see :func:`check_cross_stage_ties`.

    Raises:
        SplitError: (with ``plan``) a parameter tied across pipeline stages lies in a split module.
    """

    def __init__(self, module: nn.Module, plan=None) -> None:
        if plan is not None:
            check_cross_stage_ties(plan)
        self.names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(name)
        self.fulls: dict[int, torch.Tensor] = {}  # kept alive so that ids stay unique until check()
        self.shards: dict[tuple, nn.Parameter] = {}

    def shard(self, full: torch.Tensor, key: tuple, make: Callable[[], nn.Parameter]) -> nn.Parameter:
        """The sharded parameter for ``full`` cut as ``key`` (made once, then shared)."""
        self.fulls[id(full)] = full
        k = (id(full), *key)
        if k not in self.shards:
            self.shards[k] = make()
        return self.shards[k]

    def check(self, sharded: nn.Module) -> None:
        """Refuse ties that sharding broke, once every split module of ``sharded`` (the stage module after
        sharding) is in place.

        Raises:
            SplitError: a full parameter cut two different ways (naming its modules and the cuts), or still
                held unsharded outside the split (naming the modules on each side).
        """
        still = {id(p): n for n, p in sharded.named_parameters(remove_duplicate=False)}
        for fid in self.fulls:
            names = self.names.get(fid, ["<a parameter outside this stage>"])
            cuts = sorted({k[1:] for k in self.shards if k[0] == fid}, key=str)
            if len(cuts) > 1:
                raise SplitError(
                    f"{' and '.join(names)} are one tied parameter, but split cuts it {len(cuts)} ways {cuts} "
                    "(dim, start, size per cut), so the tie would be lost; under split a tie is kept only when "
                    "every module sharing it is cut the same way (an nn.Embedding and an nn.Linear head over the "
                    "same vocabulary in one split scope, with the same shard weights). Untie the modules, or "
                    "put them in one split scope")
            if fid in still:
                raise SplitError(
                    f"{' and '.join(names)} are one tied parameter, but {still[fid]} is not under split while "
                    "the others are, so the tie would be lost; put every module sharing the weight under the "
                    "same split, or untie them")
        self.fulls.clear()


def check_cross_stage_ties(plan) -> None:
    """Refuse a parameter tied across pipeline stages (:attr:`whale.plan.plan.Plan.shared_params`) that lies
    in a split module of any stage: the other stages hold it whole, so it cannot be sharded. Every rank
    checks the same plan, so all refuse together, before any collective.

    Raises:
        SplitError: naming the tied names, the stages and the split module.
    """
    for sp in plan.shared_params:
        for stage in range(plan.num_stages):
            for target, _ in plan.split_targets(stage):
                hit = [n for n in sp.names if target == "" or n == target or n.startswith(target + ".")]
                if hit:
                    raise SplitError(
                        f"{' and '.join(sp.names)} are one parameter tied across pipeline stages {sp.stages}, but "
                        f"{hit[0]} lies in {target or 'the model'!r}, which is under split in stage {stage}: the "
                        "other stages would hold it whole and the shards would drift apart. Keep the modules "
                        "sharing the weight out of split, put them in one stage, or untie them")


@contextlib.contextmanager
def shard_ties(module: nn.Module, plan=None) -> Iterator[SplitTies]:
    """While active, slices of one full parameter cut the same way are one sharded parameter (see the
    module docstring); call :meth:`SplitTies.check` on the sharded module afterwards. With ``plan``, first
    :func:`check_cross_stage_ties`."""
    ties = SplitTies(module, plan)
    token = _ACTIVE.set(ties)
    try:
        yield ties
    finally:
        _ACTIVE.reset(token)


def tied_shard(full: torch.Tensor, key: tuple, make: Callable[[], nn.Parameter]) -> nn.Parameter:
    """``make()``, shared with every earlier slice of ``full`` cut as ``key`` while :func:`shard_ties` is
    active (a fresh parameter otherwise)."""
    ties = _ACTIVE.get()
    return make() if ties is None else ties.shard(full, key, make)


# --- making shards ---------------------------------------------------------------------------------------
def _materialize(shape: list[int], full: torch.Tensor, bound: float | None) -> nn.Parameter:
    t = torch.empty(shape, dtype=full.dtype)
    with torch.no_grad():
        t.uniform_(-bound, bound) if bound is not None else t.normal_()
    return nn.Parameter(t, requires_grad=full.requires_grad)


def local_param(full: torch.Tensor, dim: int, start: int, size: int, bound: float | None = None) -> nn.Parameter:
    """This rank's slice ``full.narrow(dim, start, size)`` as a new parameter (one per slice of a tied
    ``full``, see :func:`shard_ties`); for a custom split rule, declare it in ``shard_layout()`` as ``dim``.
    A ``full`` on the meta device (a layer too big to build whole) is materialized shard by shard:
    uniform(-bound, bound) (PyTorch's default for Linear, with the FULL layer's fan-in) or, with
    ``bound=None``, normal(0, 1) (Embedding's default). Shards of one position are made equal across
    replicas by the engine's broadcast."""
    def make() -> nn.Parameter:
        """The shard, made once and shared by every module that ties to it."""
        if not full.is_meta:
            return nn.Parameter(full.detach().narrow(dim, start, size).clone(), requires_grad=full.requires_grad)
        return _materialize([*full.shape[:dim], size, *full.shape[dim + 1:]], full, bound)
    return tied_shard(full, ("shard", dim, start, size), make)


def replicated_param(full: torch.Tensor, group, bound: float | None) -> nn.Parameter:
    """A whole copy of ``full`` on every rank of ``group`` (declare it in ``shard_layout()`` as ``None``); on
    the meta device materialized as :func:`local_param` does and broadcast from the group's first rank
    (collective then: every rank of the group builds its shard at the same time), so that every rank holds
    the same values."""
    def make() -> nn.Parameter:
        """The shard, made once and shared by every module that ties to it."""
        if not full.is_meta:
            return nn.Parameter(full.detach().clone(), requires_grad=full.requires_grad)
        p = _materialize(list(full.shape), full, bound)
        if group_size(group) > 1:
            dist.broadcast(p.data, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return p
    return tied_shard(full, ("replicated",), make)


# --- whole tensors back ---------------------------------------------------------------------------------
def gather_full_state(module: nn.Module, group=None, done: dict[int, torch.Tensor] | None = None,
                      kind: str = "checkpoint") -> dict[str, torch.Tensor]:
    """``module.state_dict()`` of a sharded module with every sharded parameter all-gathered whole along its
    dim with its (uneven) ``sizes``: the names and full shapes of the unsharded module. Replicated
    parameters and buffers come as they are (detached, on their device).

    Collective over ``group`` (every rank of it calls this, for the same module, in the same order).
    ``done`` maps ``id`` of parameters already gathered to their full tensor (a tie across modules is
    gathered once). Bytes go to ``comm_bytes[kind]``.

    Raises:
        SplitError: a parameter without a declared layout (see the module docstring).
    """
    layout = declared_layout(module)
    done = {} if done is None else done
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, nn.Parameter):
            out[name] = t.detach()
            continue
        if name not in layout:
            raise SplitError(f"parameter {name!r} of a split module declares no shard layout (see "
                             "whale.parallel.split_state), so its whole tensor cannot be rebuilt")
        dim, sizes = layout[name]
        if dim is None:
            out[name] = t.detach()
        else:
            if id(t) not in done:
                full = all_gather(t.detach(), group, dim, list(sizes), kind=kind)
                done[id(t)] = _unfuse(full, dim, list(sizes), _fused_parts(module, name))
            out[name] = done[id(t)]
    return out


def _fused_parts(module: nn.Module, name: str) -> int:
    """``fused_parts`` of the module holding parameter ``name`` (1 when it fuses nothing)."""
    owner = name.rpartition(".")[0]
    return int(getattr(module.get_submodule(owner) if owner else module, "fused_parts", 1))


def _unfuse(full: torch.Tensor, dim: int, sizes: list[int], parts: int) -> torch.Tensor:
    """Rank-ordered shards of ``parts`` fused blocks each -> the fused tensors whole, one after another."""
    if parts == 1:
        return full
    blocks = [shard.chunk(parts, dim) for shard in full.split(sizes, dim)]
    return torch.cat([rank[j] for j in range(parts) for rank in blocks], dim)
