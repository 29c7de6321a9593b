"""split, loss side: softmax cross-entropy, top-1 prediction and accuracy over class-sharded logits.

A column-sharded classification head (:class:`whale.parallel.split.ColumnParallelLinear`, ``gather_output=
False``) leaves rank r holding logits for the classes ``[class_start, class_start + C_local)`` only. These
functions compute the same numbers as ``F.cross_entropy`` / ``argmax`` on the full ``[N, C]`` logits without ever
gathering them on one rank: per step they move O(N) numbers instead of O(N × C).

Communication per call (N = number of rows, i.e. ``target.numel()``; ring all-reduce sends 2(n−1)/n × S):

- :func:`sharded_cross_entropy`: forward all-reduce (max) of N floats, then one all-reduce (sum) of 2N floats
  (sum of exponentials and target logit together; 3N with label smoothing, adding the weighted sum of the
  logits): 12 × N bytes handed over (16 × N); backward: **none**. ``weight``, ``ignore_index``,
  ``label_smoothing`` and ``reduction`` behave as in ``F.cross_entropy``.
- :func:`sharded_argmax` / :func:`sharded_accuracy`: all-reduce (max) of N values and all-reduce (min) of N
  int64 indices: (itemsize + 8) × N bytes. No backward.

Compare gathering the logits: an all-gather of N × C × itemsize bytes per rank, e.g. N = 256 rows at
C = 100,000 classes is 102 MB in fp32, against 3 KB here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from whale.parallel.split_ops import all_reduce, has_values


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-row loss of ``F.cross_entropy(..., reduction="none")`` over sharded classes; all collectives in
    forward. With z the logits of row i, p = softmax(z), log Z = log Σ_c exp(z_c), class weights w (ones when
    none), W = Σ_c w_c, C classes, smoothing ε and target y:

        loss_i = (1 − ε) · w_y · (log Z − z_y) + (ε / C) · (W · log Z − Σ_c w_c z_c)      (0 for ignored rows)

    (the second term is −Σ_c w_c log p_c, PyTorch's smoothing term). Backward is local, because log Z is
    already global after forward: d loss_i / d z_c = (1 − ε) w_y (p_c − [c = y]) + (ε / C)(W p_c − w_c).
    """

    @staticmethod
    def forward(ctx, logits, target, valid, class_start, group, w_target, w_local, w_sum, smoothing, num_classes):
        """logits ``[N, C_local]``, target ``[N]``, valid ``[N]`` (bool: not ignored), ``w_target`` ``[N]`` (the
        target's class weight, 0 on ignored rows), ``w_local`` this rank's class weights ``[C_local]`` or
        ``None``, ``w_sum`` = W -> loss ``[N]`` (fp32)."""
        x = logits.float()
        c_local = x.shape[-1]
        row_max = all_reduce(x.detach().amax(dim=-1), group, op=dist.ReduceOp.MAX)  # [N]
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - class_start
        own = (local_t >= 0) & (local_t < c_local) & valid
        idx = torch.where(own, local_t, torch.zeros_like(local_t)).unsqueeze(-1)
        parts = [exp.sum(dim=-1), torch.where(own, shifted.gather(-1, idx).squeeze(-1), torch.zeros_like(row_max))]
        if smoothing:
            parts.append((shifted if w_local is None else shifted * w_local).sum(dim=-1))
        sums = all_reduce(torch.stack(parts), group)  # [2 or 3, N]
        log_z = sums[0].log()
        loss = (1 - smoothing) * w_target * (log_z - sums[1])
        if smoothing:
            loss = loss + smoothing / num_classes * (w_sum * log_z - sums[2])
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), idx, own, valid, w_target, w_local)
        ctx.in_dtype, ctx.smoothing, ctx.w_sum, ctx.num_classes = logits.dtype, smoothing, w_sum, num_classes
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """Backward: local (see the class docstring)."""
        softmax, idx, own, valid, w_target, w_local = ctx.saved_tensors
        eps, scale = ctx.smoothing, ctx.smoothing / ctx.num_classes
        hit = (1 - eps) * w_target  # [N]
        grad = softmax * (hit + scale * ctx.w_sum).unsqueeze(-1)
        grad.scatter_add_(-1, idx, -(hit * own).unsqueeze(-1))
        if eps:
            grad -= scale * (1.0 if w_local is None else w_local)
        grad.mul_(torch.where(valid, grad_loss, torch.zeros_like(grad_loss)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), *([None] * 9)


def _num_classes(c_local: int, group, num_classes: int | None, device) -> int:
    """C: given, or the sum of every rank's ``C_local`` (an all-reduce of one int64 on the logits' device)."""
    if num_classes is not None:
        return int(num_classes)
    return int(all_reduce(torch.tensor([c_local], dtype=torch.int64, device=device), group)[0])


def _check_target(target: torch.Tensor, logits: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """Shape, dtype and range of the class ids, as ``F.cross_entropy`` checks them (local: every rank of the
    group holds the same targets, so all raise together, before any collective of the loss)."""
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"class-sharded cross-entropy needs integer class ids as target, got {target.dtype} "
                         "(class-probability targets would need the full [N, C] logits; use F.cross_entropy on "
                         "gathered logits for them)")
    rows = logits.numel() // max(logits.shape[-1], 1)
    if tuple(target.shape) != tuple(logits.shape[:-1]) and not (target.dim() == 1 and target.numel() == rows):
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)} "
                         f"(expected target of shape {tuple(logits.shape[:-1])}, or flat ({rows},))")
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if has_values(target) and bool(bad.any()):
        raise IndexError(f"target {int(target[bad][0])} is out of range for {num_classes} classes (valid "
                         f"targets: 0 to {num_classes - 1}, or ignore_index={ignore_index}); check the labels "
                         "or the head's out_features")


def _class_weights(weight: torch.Tensor | None, num_classes: int, flat_target: torch.Tensor, valid: torch.Tensor,
                   class_start: int, c_local: int, device) -> tuple:
    """``(w_target [N], w_local [C_local] or None, W)``: the weight of each row's target (0 on ignored rows),
    this rank's slice of the class weights and their total (C without weights)."""
    if weight is None:
        return valid.float(), None, float(num_classes)
    if weight.dim() != 1 or weight.numel() != num_classes:
        raise ValueError(f"weight must be a 1-D tensor with one entry per class ({num_classes}), got shape "
                         f"{tuple(weight.shape)}; pass the full weight on every rank (each uses its class slice)")
    w = weight.detach().to(device=device, dtype=torch.float32)
    w_target = torch.where(valid, w[torch.where(valid, flat_target, torch.zeros_like(flat_target))],
                           torch.zeros((), device=device))
    return w_target, w[class_start: class_start + c_local], float(w.sum())


def sharded_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, class_start: int, group=None,
                          reduction: str = "mean", ignore_index: int = -100, *, weight: torch.Tensor | None = None,
                          label_smoothing: float = 0.0, num_classes: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, weight, ignore_index=, reduction=, label_smoothing=)`` computed
    from this rank's class shard of the logits, the same numbers and gradients.

    Args:
        local_logits: ``[N, C_local]`` (or ``[*, C_local]``) logits of classes
            ``[class_start, class_start + C_local)``; the shards of the group's ranks cover all C classes.
        target: ``[N]`` (or ``[*]``, or flat) integer **global** class ids in ``[0, C)``, the same on every
            rank of the group; rows equal to ``ignore_index`` contribute no loss and no gradient.
        class_start: first global class id of this rank's shard (``offsets(sizes)[group_rank]``).
        group: the split process group (``None``: default group).
        reduction: ``"mean"`` (over non-ignored rows, divided by the sum of their target classes' weights
            when ``weight`` is given, as ``F.cross_entropy``), ``"sum"`` or ``"none"`` (per-row losses shaped
            like ``target``).
        weight: per-class weights, the full ``[C]`` tensor on every rank (each rank uses its class slice); a
            constant, no gradient flows to it.
        label_smoothing: ε in ``[0, 1]``: the target becomes (1 − ε)·onehot + ε/C, as in ``F.cross_entropy``.
        num_classes: C (``None``: the sum of the shards' ``C_local``, one more all-reduce of an int).

    Returns:
        the loss, fp32, identical on every rank. Computation is in fp32 whatever the logits' dtype; the
        gradient comes back in the logits' dtype.

    Communication: forward all-reduce of N floats (max) + all-reduce of 2N floats (3N with label smoothing);
    backward none.

    Raises:
        ValueError: unknown ``reduction``; ``label_smoothing`` outside [0, 1]; ``target`` not integer or not
            shaped like the logits' leading dims; ``weight`` not ``[C]``.
        IndexError: a target outside ``[0, C)`` that is not ``ignore_index`` (naming it and the valid range).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    c_local = local_logits.shape[-1]
    classes = _num_classes(c_local, group, num_classes, local_logits.device)
    _check_target(target, local_logits, classes, ignore_index)
    logits2d = local_logits.reshape(-1, c_local)
    flat_target = target.reshape(-1).long()
    valid = flat_target != ignore_index
    w_target, w_local, w_sum = _class_weights(weight, classes, flat_target, valid, int(class_start), c_local,
                                              local_logits.device)
    loss = _ShardedCrossEntropy.apply(logits2d, flat_target, valid, int(class_start), group, w_target, w_local,
                                      w_sum, float(label_smoothing), classes)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w_target.sum()


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
