"""ZeRO-1/2 optimizer state as whole tensors per parameter (see :mod:`whale.parallel.zero` for the layout).

Each lane holds the optimizer state of its *pieces*: elements ``lo:hi`` of a bucket's flat buffer. To save,
every bucket's state is assembled whole on every rank of the bucket's group, one broadcast per lane range (the
exact values, as :meth:`ZeroShards.gather` does for parameters); a scalar entry (Adam's ``step``) is the same on
every piece of a parameter and is agreed with an all-reduce of the maximum. To load, a piece takes elements
``lo - offset : hi - offset`` of its owner's whole tensor (:func:`piece_range`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from whale.runtime.fqn_state import OPTIM


def piece_range(zero, pc) -> tuple[int, int]:
    """Elements ``(lo, hi)`` of the flattened owner parameter that piece ``pc`` covers."""
    off = zero.buckets[pc.bucket].offsets[pc.index]
    return pc.lo - off, pc.hi - off


def _keys(optimizer, pieces, group) -> list[tuple[str, bool]]:
    """Every state key of the bucket's pieces over the group, with whether it is per element (collective)."""
    mine = sorted({(k, v.dim() > 0) for pc in pieces for k, v in optimizer.state.get(pc.param, {}).items()})
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return sorted({tuple(k) for keys in everyone for k in keys})


def _has(optimizer, pieces, key: str, n: int, group) -> torch.Tensor:
    """Per owner parameter of the bucket: 1 when some rank's piece of it holds ``key`` (collective)."""
    has = torch.zeros(n)
    for pc in pieces:
        if key in optimizer.state.get(pc.param, {}):
            has[pc.index] = 1
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    return has


@torch.no_grad()
def _bucket_state(optimizer, zero, k: int) -> dict[tuple[int, str], torch.Tensor]:
    """``{(owner index, key): whole tensor}`` for bucket ``k`` (collective over its group); owners without
    state (never stepped: frozen or unused) are left out, as one process holds no state for them."""
    b, bd, sources = zero.buckets[k], zero.bounds[k], zero.sources[k]
    pieces = [pc for pc in zero.pieces if pc.bucket == k]
    out = {}
    for key, per_element in _keys(optimizer, pieces, b.group):
        has = _has(optimizer, pieces, key, len(b.params), b.group)
        held = [pc for pc in pieces if key in optimizer.state.get(pc.param, {})]
        if per_element:
            flat = b.buf.new_zeros(b.grad_numel, device="cpu")
            for pc in held:
                flat[pc.lo: pc.hi] = optimizer.state[pc.param][key].detach().reshape(-1).cpu()
            for g, src in enumerate(sources):
                if bd[g] < bd[g + 1]:
                    dist.broadcast(flat[bd[g]: bd[g + 1]], src=src, group=b.group)
            for i, p in enumerate(b.params):
                if has[i]:
                    out[(i, key)] = flat[b.offsets[i]: b.offsets[i] + p.numel()].view_as(p).clone()
        else:
            steps = torch.zeros(len(b.params), dtype=torch.float64)
            for pc in held:
                steps[pc.index] = float(optimizer.state[pc.param][key])
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=b.group)
            dtype = optimizer.state[held[0].param][key].dtype if held else torch.float32
            for i in range(len(b.params)):
                if has[i]:
                    out[(i, key)] = torch.tensor(steps[i].item(), dtype=dtype)
    return out


def whole_zero_state(optimizer, zero, canon: dict[int, str]) -> dict[str, torch.Tensor]:
    """``{"optim/<canonical fqn>/<key>": whole CPU tensor}`` for every parameter ZeRO manages (collective over
    each bucket's group, buckets in order)."""
    out = {}
    for k, b in enumerate(zero.buckets):
        for (i, key), t in _bucket_state(optimizer, zero, k).items():
            out[f"{OPTIM}{canon[id(b.params[i])]}/{key}"] = t
    return out
