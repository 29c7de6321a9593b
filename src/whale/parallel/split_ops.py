"""split, low level: shard sizes and the four collectives of operator sharding, as autograd functions.

Every function here works over a process group of n ranks (``group=None`` is the default group; with
``torch.distributed`` not initialized, or a group of one rank, each collective is the identity) and handles
**uneven** shards: ``sizes: list[int]``, one entry per rank of the group in group-rank order, each at least 1,
adding up to the sharded dim. Shard r covers ``[offsets(sizes)[r], offsets(sizes)[r] + sizes[r])``.

=====================  ========================  ========================  =====================================
function               forward                   backward                  bytes handed to collectives, per rank
=====================  ========================  ========================  =====================================
``copy_to_group``      identity                  all-reduce (sum) of grad  bwd: numel(x) × itemsize
``reduce_from_group``  all-reduce (sum)          identity                  fwd: numel(x) × itemsize
``gather_from_group``  all-gather along ``dim``  own slice of grad         fwd: n × max(sizes) × m × itemsize
``scatter_to_group``   own slice along ``dim``   all-gather of grads       bwd: n × max(sizes) × m × itemsize
=====================  ========================  ========================  =====================================

where m is the number of elements per index of the sharded dim (numel of the shard / its size along ``dim``).
``copy_to_group`` and ``reduce_from_group`` are Megatron-LM's conjugate f and g operators (Shoeybi et al.
2019) around column- and row-parallel layers.

Byte convention (:data:`comm_bytes`, and the bridges of :mod:`whale.parallel.bridge`): the bytes handed to a
collective are the size of the result buffer it fills on this rank, the S of the cost model's ring formulas
(:mod:`whale.planner.steptime.cost`): for an all-reduce the reduced tensor; for an all-gather the whole gathered tensor,
padded (n × max(sizes) slices: gloo needs equal shapes, so uneven shards are padded to the largest). On the
wire a ring all-reduce of S bytes sends 2(n−1)/n × S per rank and a ring all-gather of S bytes (n−1)/n × S.

Gloo quirks found while building this (torch 2.13, CPU):

- ``dist.all_gather`` rejects output lists whose tensors differ in shape ("invalid tensor size at index i"),
  so uneven gathers pad every shard to the largest one and slice afterwards.
- ``dist.all_reduce`` on a **non-contiguous** view silently reduces the wrong memory (the view's first
  ``numel`` storage elements), so every collective here works on a contiguous copy.
- ``dist.all_gather_into_tensor`` is deprecated in this release; the list form of ``all_gather`` is used.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from whale.plan.shares import whole_shares

comm_bytes: Counter = Counter()
"""Bytes this process handed to split collectives (result buffer sizes, see the module docstring), by kind:
``"all_reduce"``, ``"all_gather"`` and the bridges' ``"bridge"``. Reset with ``comm_bytes.clear()``; benchmarks
read it to report measured communication."""


# --- shard sizes ----------------------------------------------------------------------------------------
def shard_sizes(dim_size: int, n: int, weights: list[float] | None = None) -> list[int]:
    """Whole shard sizes for cutting a dim of ``dim_size`` elements into ``n`` shards, adding up to ``dim_size``.

    Equal by default; with ``weights`` (e.g. device FLOPS, for hardware-aware shares) following them. Every
    shard gets at least one element. Both by :func:`whale.plan.shares.whole_shares` (the shares minimizing
    the slowest shard's ``size / weight`` exactly, ties to the lower index).

    Raises:
        ValueError: ``n < 1``; more shards than elements (``n > dim_size``); ``weights`` of the wrong length,
            negative, or all zero.
    """
    if n < 1:
        raise ValueError(f"need at least one shard, got n={n}")
    if n > dim_size:
        raise ValueError(f"cannot split a dim of size {dim_size} into {n} shards: more shards than elements "
                         f"(use at most {dim_size} ranks for this dim, or a larger dim)")
    weights = [1.0] * n if weights is None else [float(w) for w in weights]
    if len(weights) != n or min(weights) < 0 or not sum(weights) > 0:
        raise ValueError(f"weights must be {n} non-negative numbers with a positive sum, got {weights}")
    return whole_shares(dim_size, weights, min_share=1)


def check_sizes(sizes: list[int], dim_size: int, n: int) -> list[int]:
    """Validate explicit shard sizes for a dim of ``dim_size`` over ``n`` ranks; return them as a list.

    Raises:
        ValueError: not ``n`` entries; an entry below 1 (naming the dim size and shard count when there
            are more shards than elements); sizes whose sum differs from ``dim_size`` (naming both).
    """
    sizes = [int(s) for s in sizes]
    if len(sizes) != n:
        raise ValueError(f"got {len(sizes)} shard sizes {sizes} for a group of {n} ranks; give one per rank")
    if n > dim_size:
        raise ValueError(f"cannot split a dim of size {dim_size} into {n} shards: more shards than elements")
    if min(sizes) < 1:
        raise ValueError(f"every shard needs at least one element, got sizes {sizes}")
    if sum(sizes) != dim_size:
        raise ValueError(f"shard sizes {sizes} add up to {sum(sizes)}, but the dim has size {dim_size}")
    return sizes


def resolve_sizes(dim_size: int, group=None, sizes: list[int] | None = None,
                  weights: list[float] | None = None) -> list[int]:
    """Shard sizes for one dim over ``group``: ``sizes`` validated, else :func:`shard_sizes` by ``weights``."""
    n = group_size(group)
    if sizes is not None:
        return check_sizes(sizes, dim_size, n)
    return shard_sizes(dim_size, n, weights)


def offsets(sizes: list[int]) -> list[int]:
    """Start index of each shard: ``[0, s0, s0+s1, ...]`` (length ``len(sizes)``)."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


# --- group helpers --------------------------------------------------------------------------------------
def group_size(group=None) -> int:
    """Number of ranks in ``group`` (1 when ``torch.distributed`` is not initialized)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's rank within ``group`` (0 when ``torch.distributed`` is not initialized)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def has_values(x: torch.Tensor) -> bool:
    """Whether ``x`` holds real values that input checks can read (not a meta or fake tensor of a trace)."""
    return not (x.is_meta or isinstance(x, FakeTensor))


def all_reduce(x: torch.Tensor, group=None, op=None) -> torch.Tensor:
    """Out-of-place all-reduce (sum by default) of a contiguous copy of ``x``; ``x`` itself is untouched."""
    out = x.clone(memory_format=torch.contiguous_format)
    if group_size(group) > 1:
        comm_bytes["all_reduce"] += out.numel() * out.element_size()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out


def all_gather(x: torch.Tensor, group=None, dim: int = -1, sizes: list[int] | None = None,
               kind: str = "all_gather") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order; shard r has ``sizes[r]`` entries
    along ``dim`` (``None``: all as large as this rank's). Pads to ``max(sizes)`` (gloo needs equal shapes).

    Counts n × the padded shard's bytes (the gathered result, padding included) in ``comm_bytes[kind]``.

    Raises:
        ValueError: this rank's ``x`` does not have ``sizes[rank]`` entries along ``dim``.
    """
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    sizes = [x.shape[dim]] * n if sizes is None else list(sizes)
    if x.shape[dim] != sizes[group_rank(group)]:
        raise ValueError(f"this rank holds {x.shape[dim]} entries along dim {dim}, but sizes say "
                         f"{sizes[group_rank(group)]} (sizes {sizes})")
    shape = list(x.shape)
    shape[dim] = max(sizes)
    padded = x.new_zeros(shape)
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    parts = [torch.empty_like(padded) for _ in range(n)]
    comm_bytes[kind] += n * padded.numel() * padded.element_size()
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim=dim)


def _own_slice(x: torch.Tensor, group, dim: int, sizes: list[int] | None) -> torch.Tensor:
    n, r = group_size(group), group_rank(group)
    sizes = shard_sizes(x.shape[dim], n) if sizes is None else check_sizes(sizes, x.shape[dim], n)
    return x.narrow(dim, offsets(sizes)[r], sizes[r]).contiguous()


# --- autograd functions ---------------------------------------------------------------------------------
class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """Forward of this collective (see the class/module docstring for shapes and bytes)."""
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        """Backward: the adjoint collective (see the module docstring)."""
        return all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """Forward of this collective (see the class/module docstring for shapes and bytes)."""
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        """Backward: the adjoint collective (see the module docstring)."""
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        """Forward of this collective (see the class/module docstring for shapes and bytes)."""
        ctx.group, ctx.dim, ctx.sizes = group, dim % x.dim(), sizes
        return all_gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        """Backward: the adjoint collective (see the module docstring)."""
        return _own_slice(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        """Forward of this collective (see the class/module docstring for shapes and bytes)."""
        ctx.group, ctx.dim = group, dim % x.dim()
        ctx.sizes = shard_sizes(x.shape[ctx.dim], group_size(group)) if sizes is None else sizes
        return _own_slice(x, group, ctx.dim, ctx.sizes)

    @staticmethod
    def backward(ctx, grad):
        """Backward: the adjoint collective (see the module docstring)."""
        return all_gather(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a sharded region with a replicated ``x``: identity forward; backward sums the gradient over the
    group (each rank's shard contributes a partial gradient of ``x``). Comm: bwd all-reduce of numel(x)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a sharded region holding partial sums: forward all-reduce (sum); backward identity (the summed
    output is replicated, so every rank already has the full gradient). Comm: fwd all-reduce of numel(x)."""
    return _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group=None, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """Shard ``[..., sizes[r], ...]`` along ``dim`` → full ``[..., sum(sizes), ...]`` on every rank.

    Backward takes this rank's slice of the (replicated) gradient. ``sizes=None`` means all shards have this
    rank's size. Comm: fwd all-gather of n × max(sizes) × (numel(x) / sizes[r]) elements.
    """
    return _GatherFromGroup.apply(x, group, dim, None if sizes is None else list(sizes))


def scatter_to_group(x: torch.Tensor, group=None, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """Replicated full ``x`` → this rank's shard along ``dim`` (``sizes=None``: equal shards).

    Backward all-gathers the shard gradients into the full gradient. Comm: bwd all-gather as
    :func:`gather_from_group`. Raises ``ValueError`` for invalid ``sizes`` (see :func:`check_sizes`).
    """
    return _ScatterToGroup.apply(x, group, dim, None if sizes is None else list(sizes))
