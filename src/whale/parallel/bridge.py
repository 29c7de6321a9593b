"""Bridges between a replicate TaskGraph and a split TaskGraph on the same devices.

A bridge is the communication at a TaskGraph boundary that changes the layout of the values crossing it (the
bridge layers of the Whale paper, Jia et al., USENIX ATC 2022, §3.2); here, a gather along the batch dim.

Under ``replicate`` each of the n ranks of a split group holds its own rows of the micro-batch (its
data-parallel share, possibly uneven); a split part needs every row of the group on every rank. A
:class:`SplitRegion` wraps one sharded module and puts the bridges around it:

- **in** (replicate -> split): all-gather the rows along the batch dim (dim 0). Backward: each rank keeps the
  gradient of its own rows. (Every sharded operator's input already sums the partial gradients of all shards
  over the group -- ``copy_to_group`` in a column-sharded Linear -- so the gradient arriving here is complete
  on every rank; summing again would count it n times.) Bytes per rank: forward ``n x max(rows) x m x
  itemsize`` (the gathered rows, padded: gloo needs equal sizes), backward none, where m = elements per row.
- **out** (split -> replicate): each rank keeps its own rows of the full output. Backward: all-gather of the
  row gradients, ``n x max(rows) x m' x itemsize``.
- **elided**: with a group of one rank (the module is not sharded at all), and at the model's end when the
  split part yields class-sharded logits (a lone column-sharded ``nn.Linear``): they go straight to the loss as
  :class:`ShardedLogits` over all the group's rows (the loss then averages over those rows; no scatter).

Row counts per rank come from the plan, set each step by :class:`whale.parallel.regions.SplitRuntime` through
:meth:`SplitRegion.set_rows`. The gathers are :func:`whale.parallel.split_ops.all_gather` along dim 0; their
bytes (the gathered result, as every split collective counts them: see :mod:`whale.parallel.split_ops`) go to
``comm_bytes["bridge"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from whale.parallel.split import ColumnParallelLinear
from whale.parallel.split_loss import sharded_accuracy, sharded_cross_entropy
from whale.parallel.split_ops import all_gather


def _gather_rows(x: torch.Tensor, group, rows: list[int]) -> torch.Tensor:
    """All ranks' rows, in group-rank order (rank r holds ``rows[r]``), counted as ``"bridge"`` bytes."""
    return all_gather(x, group, dim=0, sizes=rows, kind="bridge")


def _own_rows(x: torch.Tensor, group, rows: list[int]) -> torch.Tensor:
    me = dist.get_rank(group)
    start = sum(rows[:me])
    return x[start: start + rows[me]]


class _BridgeIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rows):
        """Forward of this collective (see the class/module docstring for shapes and bytes)."""
        ctx.group, ctx.rows = group, rows
        return _gather_rows(x, group, rows)

    @staticmethod
    def backward(ctx, grad):
        """Backward: the adjoint collective (see the module docstring)."""
        return _own_rows(grad, ctx.group, ctx.rows).contiguous(), None, None


class _BridgeOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rows):
        """Forward of this collective (see the class/module docstring for shapes and bytes)."""
        ctx.group, ctx.rows = group, rows
        return _own_rows(x, group, rows).clone()

    @staticmethod
    def backward(ctx, grad):
        """Backward: the adjoint collective (see the module docstring)."""
        return _gather_rows(grad, ctx.group, ctx.rows), None, None


@dataclass
class ShardedLogits:
    """Class-sharded logits ``[N, C_local]`` over all N rows of a split group, from a split classification head.

    Columns ``[class_start, class_start + C_local)`` of the full ``[N, C]`` logits live on this rank; C is
    ``num_classes`` (``None``: unknown, the loss then adds the shards' sizes up). Only the losses and metrics
    below accept it; the full logits are never gathered.
    """

    local: torch.Tensor
    class_start: int
    group: object
    num_classes: int | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # pragma: no cover - error path
        raise TypeError(
            f"{func.__name__} got class-sharded logits from a split head; use whale.cross_entropy / "
            "whale.accuracy as the loss/metric, or put the head in an nn.Sequential with a following Linear "
            "so that its output is gathered")


def cross_entropy(output, target: torch.Tensor, weight: torch.Tensor | None = None, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """Softmax cross-entropy with ``F.cross_entropy``'s options and numbers; ``output`` is ``[N, C]`` logits or
    :class:`ShardedLogits` (computed without gathering logits: max and sum-of-exp all-reduces, see
    :func:`whale.parallel.split_loss.sharded_cross_entropy`).

    Args:
        output: logits ``[N, C]`` (any shape ``F.cross_entropy`` takes) or class-sharded ``[N, C_local]``.
        target: int64 class ids ``[N]`` in ``[0, C)`` (or ``ignore_index``).
        weight: per-class weights, the full ``[C]`` tensor (under split each rank uses its class slice).
        ignore_index, reduction, label_smoothing: as in ``F.cross_entropy`` (``reduction`` one of ``"mean"``,
            ``"sum"``, ``"none"``; the mean divides by the summed weights of the non-ignored rows' targets).

    Raises:
        IndexError: a target outside ``[0, C)`` that is not ``ignore_index`` (as in one process).
        ValueError: an unknown ``reduction``, ``label_smoothing`` outside [0, 1], ``weight`` not ``[C]``.
    """
    if isinstance(output, ShardedLogits):
        return sharded_cross_entropy(output.local, target, output.class_start, output.group, reduction,
                                     ignore_index, weight=weight, label_smoothing=label_smoothing,
                                     num_classes=output.num_classes)
    return F.cross_entropy(output, target, weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def accuracy(output, target: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy (0-dim fp32) for ``[N, C]`` logits or :class:`ShardedLogits`."""
    if isinstance(output, ShardedLogits):
        return sharded_accuracy(output.local, target, output.class_start, output.group)
    return (output.argmax(-1) == target).float().mean()


class SplitRegion(nn.Module):
    """One sharded module of a split TaskGraph with its bridges (see the module docstring).

    Args:
        sharded: this rank's shard (from :func:`whale.parallel.split.shard_module`).
        group: the split group (n >= 2 ranks holding the shards).
    """

    def __init__(self, sharded: nn.Module, group) -> None:
        super().__init__()
        self.sharded = sharded
        self.group = group
        self.rows: list[int] | None = None
        self.sharded_output = isinstance(sharded, ColumnParallelLinear) and not sharded.gather_output

    def set_rows(self, rows: list[int]) -> None:
        """Rows of the current micro-batch held by each rank of the group (group-rank order)."""
        self.rows = list(rows)

    def forward(self, x: torch.Tensor):
        """This rank's rows ``[b_r, ...]`` -> the sharded module's output for this rank's rows (or
        :class:`ShardedLogits` over all the group's rows when the module is a class-sharded head)."""
        if self.rows is None:
            raise RuntimeError("SplitRegion.set_rows was not called: the split runtime sets row counts per step")
        if x.is_floating_point():
            x = _BridgeIn.apply(x, self.group, self.rows)
        else:  # token ids and the like: no gradient to bring back
            x = _gather_rows(x, self.group, self.rows)
        y = self.sharded(x)
        if self.sharded_output:
            return ShardedLogits(y, self.sharded.shard_start, self.group, self.sharded.out_features)
        return _BridgeOut.apply(y, self.group, self.rows)
