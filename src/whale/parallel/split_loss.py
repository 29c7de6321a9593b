"""split, loss side: softmax cross-entropy, top-1 prediction and accuracy over class-sharded logits.

A column-sharded classification head (:class:`whale.parallel.split.ColumnParallelLinear`, ``gather_output=
False``) leaves rank r holding logits for the classes ``[class_start, class_start + C_local)`` only. These
functions compute the same numbers as ``F.cross_entropy`` / ``argmax`` on the full ``[N, C]`` logits without ever
gathering them on one rank: per step they move O(N) numbers instead of O(N × C).

Communication per call (N = number of rows, i.e. ``target.numel()``; ring all-reduce sends 2(n−1)/n × S):

- :func:`sharded_cross_entropy`: forward all-reduce (max) of N floats, then one all-reduce (sum) of 2N floats
  (sum of exponentials and target logit together): 12 × N bytes handed over; backward: **none**.
- :func:`sharded_argmax` / :func:`sharded_accuracy`: all-reduce (max) of N values and all-reduce (min) of N
  int64 indices: (itemsize + 8) × N bytes. No backward.

Compare gathering the logits: an all-gather of N × C × itemsize bytes per rank, e.g. N = 256 rows at
C = 100,000 classes is 102 MB in fp32, against 3 KB here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from whale.parallel.split_ops import all_reduce


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-row loss ``log Σ_c exp(z_c) − z_target`` over sharded classes; all collectives in forward.

    Backward is local: d loss_i / d z_local = softmax_local − onehot_local (rows scaled by the incoming
    per-row gradient), because the softmax normalizer is already global after forward.
    """

    @staticmethod
    def forward(ctx, logits, target, class_start, group, ignore_index):
        """Forward of this collective (see the class/module docstring for shapes and bytes)."""
        x = logits.float()
        c_local = x.shape[-1]
        row_max = all_reduce(x.detach().amax(dim=-1), group, op=dist.ReduceOp.MAX)  # [N]
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - class_start
        own = (local_t >= 0) & (local_t < c_local)
        idx = torch.where(own, local_t, torch.zeros_like(local_t)).unsqueeze(-1)
        picked = torch.where(own, shifted.gather(-1, idx).squeeze(-1), torch.zeros_like(row_max))
        sums = all_reduce(torch.stack([exp.sum(dim=-1), picked]), group)  # [2, N]
        valid = target != ignore_index
        loss = torch.where(valid, sums[0].log() - sums[1], torch.zeros_like(row_max))
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, own & valid, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """Backward: the adjoint collective (see the module docstring)."""
        softmax, idx, own, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx, -own.to(grad.dtype).unsqueeze(-1))
        grad.mul_(torch.where(valid, grad_loss, torch.zeros_like(grad_loss)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def sharded_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, class_start: int, group=None,
                          reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target)`` computed from this rank's class shard of the logits.

    Args:
        local_logits: ``[N, C_local]`` (or ``[*, C_local]``) logits of classes
            ``[class_start, class_start + C_local)``; the shards of the group's ranks cover all C classes.
        target: ``[N]`` (or ``[*]``) int64 **global** class ids, the same on every rank of the group; rows
            equal to ``ignore_index`` contribute no loss and no gradient.
        class_start: first global class id of this rank's shard (``offsets(sizes)[group_rank]``).
        group: the split process group (``None``: default group).
        reduction: ``"mean"`` (over non-ignored rows, as ``F.cross_entropy``), ``"sum"`` or ``"none"``
            (per-row losses shaped like ``target``).

    Returns:
        the loss, fp32, identical on every rank. Computation is in fp32 whatever the logits' dtype; the
        gradient comes back in the logits' dtype.

    Communication: forward all-reduce of N floats (max) + all-reduce of 2N floats; backward none.

    Raises:
        ValueError: unknown ``reduction``; ``target`` shape not matching the logits' leading dims.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if tuple(target.shape) != tuple(local_logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits {tuple(local_logits.shape)} "
                         f"(expected target of shape {tuple(local_logits.shape[:-1])})")
    logits2d = local_logits.reshape(-1, local_logits.shape[-1])
    flat_target = target.reshape(-1)
    loss = _ShardedCrossEntropy.apply(logits2d, flat_target, int(class_start), group, ignore_index)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_target != ignore_index).sum()


def sharded_argmax(local_logits: torch.Tensor, class_start: int, group=None) -> torch.Tensor:
    """Top-1 global class id per row from class-sharded logits ``[*, C_local]`` → int64 ``[*]``.

    Equals ``full_logits.argmax(-1)``, including its tie-break (the lowest class id among equal maxima).
    Communication: all-reduce (max) of N values and all-reduce (min) of N int64; no gradient flows.
    """
    with torch.no_grad():
        local_idx = local_logits.argmax(dim=-1)
        local_max = local_logits.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
        best = all_reduce(local_max, group, op=dist.ReduceOp.MAX)
        no_claim = torch.iinfo(torch.int64).max
        cand = torch.where(local_max == best, local_idx + int(class_start), torch.full_like(local_idx, no_claim))
        return all_reduce(cand, group, op=dist.ReduceOp.MIN)


def sharded_accuracy(local_logits: torch.Tensor, target: torch.Tensor, class_start: int, group=None,
                     ignore_index: int = -100) -> torch.Tensor:
    """Top-1 accuracy (fp32 0-dim tensor) of class-sharded logits against global ``target`` ids, over rows
    whose target is not ``ignore_index`` (NaN if there are none). Communication: as :func:`sharded_argmax`."""
    pred = sharded_argmax(local_logits, class_start, group)
    valid = target != ignore_index
    return ((pred == target) & valid).sum().float() / valid.sum().float()
