"""Sequence parallelism, low level: the collectives along the sequence dim, as autograd functions.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
§4.2.2) keeps the activations between tensor-parallel operators (LayerNorm, dropout, the residual stream) cut
along the sequence: rank r of a split group of n holds ``x[:, r·s/n : (r+1)·s/n]`` of ``x [b, s, h]``. Its
conjugate operators replace Megatron-LM's f / g (:func:`whale.parallel.split_ops.copy_to_group` /
:func:`~whale.parallel.split_ops.reduce_from_group`):

=========================  =========================  ========================  ==============================
function                   forward                    backward                  bytes per rank (result buffer)
=========================  =========================  ========================  ==============================
:func:`gather_linear`      all-gather seq, matmul     re-gather, reduce-scatter fwd b·s·in, bwd 2 × b·s·in
:func:`reduce_scatter_seq` reduce-scatter seq         all-gather seq            fwd b·s·h, bwd b·s·h
:func:`scatter_seq`        own seq slice              all-gather seq            bwd b·s·h
:func:`gather_seq`         all-gather seq             own seq slice             fwd b·s·h
=========================  =========================  ========================  ==============================

(times the itemsize; a reduce-scatter counts its input, the S of the ring formula, which sends (n−1)/n × S.)
:func:`gather_linear` keeps only this rank's shard ``[b, s/n, in]`` for the weight gradient and all-gathers it
again in backward, as Megatron-LM does, so the column-parallel input costs 1/n of the memory (the price: one
more all-gather per backward).

Only equal shards: the sequence length must be a multiple of the split degree (:func:`seq_shard`).
All tensors here are ``[b, s, ...]`` with the sequence on dim 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from whale.parallel.split_ops import all_gather, comm_bytes, group_rank, group_size
from whale.splitrules import SplitError

SEQ_DIM = 1
"""The sequence dim of every tensor sequence parallelism cuts: ``[b, s, ...]``."""


def seq_shard(seq_len: int, group=None) -> tuple[int, int]:
    """``(start, length)`` of this rank's sequence shard of ``seq_len`` positions over ``group``.

    Raises:
        SplitError: ``seq_len`` is not a multiple of the group size (names both and the fix).
    """
    n = group_size(group)
    if seq_len % n:
        raise SplitError(f"sequence parallelism over {n} devices needs a sequence length divisible by {n}, got "
                         f"{seq_len}; use a sequence length that is a multiple of {n}, or turn "
                         "Config.sequence_parallel off")
    size = seq_len // n
    return group_rank(group) * size, size


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    return all_gather(x, group, SEQ_DIM)


def _own(x: torch.Tensor, group) -> torch.Tensor:
    start, size = seq_shard(x.shape[SEQ_DIM], group)
    return x.narrow(SEQ_DIM, start, size).contiguous()


def reduce_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x [b, s, ...]`` over the group and keep this rank's sequence shard ``[b, s/n, ...]`` (a contiguous
    copy; counts numel(x) × itemsize in ``comm_bytes["reduce_scatter"]``)."""
    n = group_size(group)
    if n == 1:
        return x
    seq_shard(x.shape[SEQ_DIM], group)
    parts = [p.contiguous() for p in x.chunk(n, SEQ_DIM)]
    out = torch.empty_like(parts[0])
    comm_bytes["reduce_scatter"] += x.numel() * x.element_size()
    dist.reduce_scatter(out, parts, group=group)
    return out


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """Own sequence shard of a replicated ``x``."""
        ctx.group = group
        return _own(x, group)

    @staticmethod
    def backward(ctx, grad):
        """All-gather of the shards' gradients."""
        return _gather(grad.contiguous(), ctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """All-gather of the sequence shards."""
        ctx.group = group
        return _gather(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        """Own slice of the (replicated) gradient."""
        return _own(grad, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """Reduce-scatter of partial sums along the sequence."""
        ctx.group = group
        return reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        """All-gather of the shards' gradients."""
        return _gather(grad.contiguous(), ctx.group), None


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        """``all_gather_seq(x) @ weight.T + bias``, saving only the shard ``x``."""
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x.contiguous(), group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        """Input gradient reduce-scattered along the sequence; weight gradient from the re-gathered input."""
        x, weight = ctx.saved_tensors
        full = _gather(x.contiguous(), ctx.group)
        grad = grad.contiguous()
        gx = reduce_scatter(grad.matmul(weight), ctx.group) if ctx.needs_input_grad[0] else None
        g2 = grad.reshape(-1, grad.shape[-1])
        gw = g2.t().mm(full.reshape(-1, full.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def scatter_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """Replicated ``[b, s, ...]`` → this rank's ``[b, s/n, ...]``; backward all-gathers the gradient."""
    return _ScatterSeq.apply(x, group) if group_size(group) > 1 else x


def gather_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence shards ``[b, s/n, ...]`` → the whole ``[b, s, ...]`` on every rank; backward keeps this rank's
    slice of the gradient."""
    return _GatherSeq.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """Partial sums ``[b, s, h]`` → this rank's shard of their sum ``[b, s/n, h]`` (a row-parallel Linear's
    output under sequence parallelism); backward all-gathers the gradient."""
    return _ReduceScatterSeq.apply(x, group) if group_size(group) > 1 else x


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group=None) -> torch.Tensor:
    """A column-parallel Linear on a sequence-sharded input: ``x [b, s/n, in]`` → ``[b, s, out_r]``.

    Forward all-gathers ``x`` along the sequence; backward all-gathers it again for the weight gradient and
    reduce-scatters the input gradient (each rank's shard of the sum of every rank's partial input gradient).
    """
    return _GatherLinear.apply(x, weight, bias, group)
