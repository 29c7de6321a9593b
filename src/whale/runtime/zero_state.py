"""ZeRO optimizer state as whole tensors per parameter (see :mod:`whale.parallel.zero` and
:mod:`whale.parallel.zero3` for the layouts).

Each lane holds the optimizer state of its *pieces*: elements ``lo:hi`` of a flat buffer cut over a group of
ranks: a ZeRO-1/2 bucket, a ZeRO-3 unit, or (under ZeRO-3) a bucket of the parameters tied across stages, which
stay under ZeRO-2 (:attr:`Zero3Shards.tied`). :func:`flats` describes all of them the same way. To save, every
flat buffer's state is assembled whole on every rank of its group, one broadcast per lane range (the exact
values, as :meth:`ZeroShards.gather` does for parameters); a scalar entry (Adam's ``step``) is the same on every
piece of a parameter and is agreed with an all-reduce of the maximum. To load, a piece takes elements
``lo - offset : hi - offset`` of its owner's whole tensor (:func:`piece_ranges`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Flat:
    """One flat buffer cut over a group's ranks, as the checkpoint code sees it.

    Attributes:
        group: the ranks it is cut over.
        params: its parameters (a ZeRO-3 unit's may be freed: their shapes are in ``shapes``).
        shapes: each parameter's whole shape.
        offsets: each parameter's first element in the buffer.
        numel: the buffer's elements.
        dtype: the buffer's dtype.
        bounds: the group ranks' ranges (``bounds[g]:bounds[g + 1]``).
        sources: the global rank of each group rank.
        pieces: this rank's pieces of the buffer.
    """

    group: object
    params: list[nn.Parameter]
    shapes: list[torch.Size]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    bounds: list[int]
    sources: list[int]
    pieces: list


def flats(zero) -> list[Flat]:
    """Every flat buffer of ``zero`` (a ``ZeroShards`` or a ``Zero3Shards``), in the same order on every rank of
    each buffer's group: ZeRO-1/2 buckets; ZeRO-3 units, then the tied parameters' buckets."""
    def mine(k):
        """This rank's pieces of bucket ``k``."""
        return [pc for pc in zero.pieces if pc.bucket == k]

    if zero.level >= 3:
        out = []
        for k, u in enumerate(zero.units):
            shapes = [v.shape for v in u.views]
            offsets = [0, *itertools.accumulate(v.numel() for v in u.views)][:-1]
            out.append(Flat(zero.group, u.params, shapes, offsets, u.flat.numel(), u.flat.dtype, u.bounds,
                            zero.sources, mine(k)))
        return out + (flats(zero.tied) if zero.tied is not None else [])
    return [Flat(b.group, b.params, [p.shape for p in b.params], list(b.offsets), b.grad_numel, b.buf.dtype,
                 zero.bounds[k], zero.sources[k], mine(k)) for k, b in enumerate(zero.buckets)]


def piece_ranges(zero) -> dict[int, tuple[nn.Parameter, int, int]]:
    """``id`` of each piece's parameter (what the optimizer steps) -> ``(owner parameter, lo, hi)``: the
    elements of the flattened owner the piece covers."""
    out = {}
    for f in flats(zero):
        for pc in f.pieces:
            off = f.offsets[pc.index]
            out[id(pc.param)] = (pc.owner, pc.lo - off, pc.hi - off)
    return out


def _keys(optimizer, pieces, group) -> list[tuple[str, bool]]:
    """Every state key of the buffer's pieces over the group, with whether it is per element (collective)."""
    mine = sorted({(k, v.dim() > 0) for pc in pieces for k, v in optimizer.state.get(pc.param, {}).items()})
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return sorted({tuple(k) for keys in everyone for k in keys})


def _has(optimizer, pieces, key: str, n: int, group) -> torch.Tensor:
    """Per owner parameter of the buffer: 1 when some rank's piece of it holds ``key`` (collective)."""
    has = torch.zeros(n)
    for pc in pieces:
        if key in optimizer.state.get(pc.param, {}):
            has[pc.index] = 1
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    return has


@torch.no_grad()
def _flat_state(optimizer, f: Flat) -> dict[tuple[int, str], torch.Tensor]:
    """``{(owner index, key): whole tensor}`` for buffer ``f`` (collective over its group); owners without
    state (never stepped: frozen or unused) are left out, as one process holds no state for them."""
    out = {}
    for key, per_element in _keys(optimizer, f.pieces, f.group):
        has = _has(optimizer, f.pieces, key, len(f.params), f.group)
        held = [pc for pc in f.pieces if key in optimizer.state.get(pc.param, {})]
        if per_element:
            flat = torch.zeros(f.numel, dtype=f.dtype)
            for pc in held:
                flat[pc.lo: pc.hi] = optimizer.state[pc.param][key].detach().reshape(-1).cpu()
            for g, src in enumerate(f.sources):
                if f.bounds[g] < f.bounds[g + 1]:
                    dist.broadcast(flat[f.bounds[g]: f.bounds[g + 1]], src=src, group=f.group)
            for i, (off, shape) in enumerate(zip(f.offsets, f.shapes, strict=True)):
                if has[i]:
                    out[(i, key)] = flat[off: off + shape.numel()].view(shape).clone()
        else:
            steps = torch.zeros(len(f.params), dtype=torch.float64)
            for pc in held:
                steps[pc.index] = float(optimizer.state[pc.param][key])
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=f.group)
            dtype = optimizer.state[held[0].param][key].dtype if held else torch.float32
            for i in range(len(f.params)):
                if has[i]:
                    out[(i, key)] = torch.tensor(steps[i].item(), dtype=dtype)
    return out


def whole_zero_state(optimizer, zero, canon: dict[int, str]) -> dict[str, torch.Tensor]:
    """``{"<canonical fqn>/<key>": whole CPU tensor}`` for every parameter ZeRO manages (collective over each flat
    buffer's group, buffers in :func:`flats` order); :func:`whale.runtime.fqn_state.whole_optim_state` files them
    under ``optim/``."""
    out = {}
    for f in flats(zero):
        for (i, key), t in _flat_state(optimizer, f).items():
            out[f"{canon[id(f.params[i])]}/{key}"] = t
    return out
