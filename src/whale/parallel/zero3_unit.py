"""One ZeRO-3 *unit* (:mod:`whale.parallel.zero3`): its parameters as views of one flat buffer, this lane's shard
of it, and the collectives that gather it and reduce-scatter its gradients.

Layout: the unit's ``N`` elements are cut at ``bounds`` (:func:`~whale.plan.shares.whole_shares` of the lanes'
weights); lane ``g`` owns ``bounds[g]:bounds[g + 1]`` and keeps it in its own *shard*; the flat buffer's storage
exists only while the unit is gathered (``untyped_storage().resize_``, so autograd's saved references to the
parameters see the data again in backward).

Collectives: with equal shares one ``all_gather_single`` / ``reduce_scatter_single`` per unit; with uneven
shares gloo's all-gather refuses different sizes, so each lane broadcasts its range in place into the flat
buffer (no padding, no copy afterwards; an all-gather into padded buffers would need a copy out of the
padding) and gradients go through the list form of ``reduce_scatter`` (uneven slices, gloo and NCCL).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from whale.memory.checkpointing import layer_units
from whale.parallel.zero import _Piece
from whale.parallel.zero3_check import Zero3Error
from whale.plan.shares import whole_shares


class Call:
    """One forward call of a unit whose inputs need gradients (``done``: autograd has made every gradient of
    those inputs from this call)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


@dataclass(eq=False)
class Unit:
    """One gathered-at-once group of parameters, with its backward's bookkeeping (:mod:`whale.parallel.zero3`)."""

    name: str
    params: list[nn.Parameter]
    views: list[torch.Tensor]  # each parameter's view of ``flat`` (its ``.data`` while gathered)
    flat: torch.Tensor  # N elements; storage resized to 0 while freed
    shard: torch.Tensor  # this lane's range, own storage
    shard_grad: torch.Tensor
    bounds: list[int]
    keep: bool  # stays gathered from forward to backward (the root outside pipelines)
    used: torch.Tensor  # per parameter: got a gradient on this lane this step
    index: int = 0
    even: bool = False  # equal ranges: one all-gather / reduce-scatter instead of per-lane calls
    nested: bool = False  # the root around other units: its frozen parameters are read until backward ends
    gathered: bool = False
    active: bool = False  # inside this unit's backward (gathered, gradients arriving)
    arrived: set[int] = field(default_factory=set)
    expected: int = 0  # this backward: parameters that require grad
    hold: bool = False  # this backward: nested with a frozen parameter (freed at the end of the backward)
    call: Call | None = None  # the forward call under way
    open: set = field(default_factory=set)  # this backward's calls whose inputs' gradients are not all made


def find_units(module: nn.Module, pipeline: bool) -> list[tuple[str, nn.Module]]:
    """The units of a stage module other than its root: ``[(fqn, module)]`` (none in a pipeline stage)."""
    if pipeline:
        return []
    return [(n, module.get_submodule(n)) for n in layer_units(module)]


@torch.no_grad()
def make_unit(name: str, params: list[nn.Parameter], weights: list[float], me: int, index: int, keep: bool,
              nested: bool) -> tuple[Unit, list[_Piece]]:
    """Flatten ``params`` into unit number ``index`` (gathered: call :func:`free` next) and lane ``me``'s
    pieces of it (the parts of parameters the optimizer steps here).

    Raises:
        Zero3Error: the parameters mix dtypes or devices.
    """
    if len({(p.dtype, p.device) for p in params}) > 1:
        kinds = sorted({f"{p.dtype}@{p.device}" for p in params})
        raise Zero3Error(f"ZeRO-3 unit {name!r} mixes parameter dtypes/devices {kinds}; give the module's "
                         "parameters one dtype and device, or use Config(zero=2)")
    numel = sum(p.numel() for p in params)
    b = [0, *itertools.accumulate(whole_shares(numel, weights))]
    flat = params[0].new_empty(numel)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset: offset + p.numel()].view_as(p))
        views[-1].copy_(p.detach())
        offset += p.numel()
    a, z = b[me], b[me + 1]
    even = len({y - x for x, y in itertools.pairwise(b)}) == 1
    unit = Unit(name, params, views, flat, flat[a:z].clone(), flat.new_zeros(z - a), b, keep,
                torch.zeros(len(params), dtype=torch.bool), index, even, nested, gathered=True)
    pieces, offset = [], 0
    for i, p in enumerate(params):
        lo, hi = max(a, offset), min(z, offset + p.numel())
        if lo < hi:
            pieces.append(_Piece(nn.Parameter(unit.shard[lo - a: hi - a]), p, index, i, lo, hi))
        offset += p.numel()
    return unit, pieces


def _resized(unit: Unit, numel: int, tracker) -> None:
    unit.flat.untyped_storage().resize_(numel * unit.flat.element_size())
    if tracker is not None:
        tracker.label(unit.flat, "parameters")


@torch.no_grad()
def gather(unit: Unit, group, me: int, sources: list[int], tracker=None) -> None:
    """Make ``unit``'s parameters whole from every lane's shard (collective over ``group``, whose lane ``g`` is
    global rank ``sources[g]``); ``tracker``: a :class:`whale.memory.tracker.StorageTracker` or ``None``."""
    _resized(unit, unit.flat.numel(), tracker)
    b = unit.bounds
    shard = unit.shard.to(unit.flat.device)  # the same tensor unless the shard lives on the host (offload)
    if unit.even:
        dist.all_gather_single(unit.flat, shard, group=group)
    else:
        unit.flat[b[me]: b[me + 1]].copy_(shard)
        works = [dist.broadcast(shard if g == me else unit.flat[b[g]: b[g + 1]], src=src, group=group,
                                async_op=True)
                 for g, src in enumerate(sources) if b[g] < b[g + 1]]
        for w in works:
            w.wait()
    for p, view in zip(unit.params, unit.views, strict=True):
        p.data = view
    unit.gathered = True


def free(unit: Unit, tracker=None) -> None:
    """Free the unit's full buffer; its parameters become empty tensors (shape ``[0]``: reading a freed
    parameter fails on its shape instead of touching freed memory)."""
    _resized(unit, 0, tracker)
    empty = unit.flat.new_empty(0)
    for p in unit.params:
        p.data = empty
    unit.gathered = False


def start_reduce(unit: Unit, group, me: int, lanes: int) -> tuple[torch.Tensor, object, torch.Tensor]:
    """Start summing the unit's gradients (made by autograd, copied into one flat buffer and dropped from the
    parameters) over the lanes into lane ``me``'s range (async collective over ``group`` of ``lanes``).

    Returns:
        ``(this lane's summed range, the work, the flat buffer: keep it alive until the work is done)``.
    """
    b = unit.bounds
    full = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in unit.params])
    for p in unit.params:
        p.grad = None
    out = full.new_empty(b[me + 1] - b[me])
    if unit.even:
        work = dist.reduce_scatter_single(out, full, group=group, async_op=True)
    else:
        work = dist.reduce_scatter(out, [full[b[g]: b[g + 1]] for g in range(lanes)], group=group, async_op=True)
    return out, work, full


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``t`` in host memory (pinned when ``pin``), same dtype and shape."""
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    h.copy_(t.detach())
    return h


@torch.no_grad()
def shards_to_host(unit: Unit, pieces: list[_Piece], me: int, pin: bool) -> None:
    """Keep ``unit``'s shard and shard gradient in host memory from now on (``offload="optimizer+params"``
    under ZeRO-3): lane ``me``'s pieces of it among ``pieces`` become views of the host shard (and of the host
    shard gradient where they have one). :func:`gather` copies the shard to the unit's device for the
    collective; each reduce-scatter's result is added into the host shard gradient."""
    a = unit.bounds[me]
    unit.shard, unit.shard_grad = _host(unit.shard, pin), _host(unit.shard_grad, pin)
    for pc in pieces:
        if pc.bucket == unit.index:
            pc.param.data = unit.shard[pc.lo - a: pc.hi - a]
            if pc.param.grad is not None:
                pc.param.grad = unit.shard_grad[pc.lo - a: pc.hi - a]
