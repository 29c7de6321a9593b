"""Bridges between a replicate TaskGraph and a split TaskGraph on the same devices.

A bridge is the communication at a TaskGraph boundary that changes the layout of the values crossing it (the
bridge layers of the Whale paper, Jia et al., USENIX ATC 2022, §3.2); here, a gather along the batch dim.

Under ``replicate`` each of the n ranks of a split group holds its own rows of the micro-batch (its
data-parallel share, possibly uneven); a split part needs every row of the group on every rank. A
:class:`SplitRegion` wraps one sharded module and puts the bridges around it:

- **in** (replicate -> split): all-gather the rows along the batch dim (dim 0) of every tensor argument, positional
  or keyword (also inside plain tuples, lists and dicts, e.g. a transformers attention's ``position_embeddings``)
  that holds this rank's rows (dim 0 == its row count); one with dim 0 == 1 is taken as broadcast over the rows
  and expanded to them first (so every rank gathers the same arguments, whatever its row count: a rotary
  ``cos`` of ``[1, s, d]`` becomes ``[N, s, d]``, equal under broadcasting); any other argument (a flag, a cache
  object, a tensor of another first dim) is passed whole. (A whole tensor whose dim 0 happens to equal the rows
  would be gathered, as :mod:`whale.runtime.batch` would slice it.) Backward: each rank keeps the
  gradient of its own rows. (Every sharded operator's input already sums the partial gradients of all shards
  over the group -- ``copy_to_group`` in a column-sharded Linear -- so the gradient arriving here is complete
  on every rank; summing again would count it n times.) Bytes per rank: forward ``n x max(rows) x m x
  itemsize`` (the gathered rows, padded: gloo needs equal sizes), backward none, where m = elements per row.
  A call with more than one argument first checks that every rank bridges the same arguments (one all-gather
  of n x 64 int64; a mask given on some ranks and ``None`` on others raises :class:`~whale.splitrules.SplitError`
  on every rank, naming the argument, rather than mismatching collectives); a one-argument call skips it.
- **out** (split -> replicate): each rank keeps its own rows of every output tensor with the group's rows (dim
  0 == their sum; a tuple's other entries, e.g. ``None``, pass as they are). Backward: all-gather of the row
  gradients, ``n x max(rows) x m' x itemsize``.
- **none** around a sharded module that routes its own rows (``keeps_rows = True``: an expert-parallel MoE
  layer, :mod:`whale.parallel.moe`, whose tokens travel by all-to-all): each rank passes its rows in and gets
  their outputs back.
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
from whale.splitrules import SplitError


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

    def sharded_cross_entropy(self, target: torch.Tensor, **kwargs) -> torch.Tensor:
        """:func:`cross_entropy` of these logits (``kwargs`` as there): how :mod:`whale.loss`, which the planning
        names load, reaches the split head's loss without importing :mod:`whale.parallel`."""
        return cross_entropy(self, target, **kwargs)


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
        self.keeps_rows = bool(getattr(sharded, "keeps_rows", False))

    def set_rows(self, rows: list[int]) -> None:
        """Rows of the current micro-batch held by each rank of the group (group-rank order)."""
        self.rows = list(rows)

    def forward(self, *args, **kwargs):
        """This rank's rows ``[b_r, ...]`` (in every argument holding them, see the module docstring) -> the
        sharded module's output for this rank's rows (or :class:`ShardedLogits` over all the group's rows when
        the module is a class-sharded head)."""
        if self.keeps_rows:  # routes this rank's own rows itself (expert parallelism, whale.parallel.moe)
            return self.sharded(*args, **kwargs)
        if self.rows is None:
            raise RuntimeError("SplitRegion.set_rows was not called: the split runtime sets row counts per step")
        local, total = self.rows[dist.get_rank(self.group)], sum(self.rows)
        if len(args) + len(kwargs) > 1:
            self._agree(args, kwargs, local)
        args, kwargs = _map((args, kwargs), lambda t: self._bridge_in(t, local))
        y = self.sharded(*args, **kwargs)
        if self.sharded_output:
            return ShardedLogits(y, self.sharded.shard_start, self.group, self.sharded.out_features)
        if not any(t.dim() and len(t) == total for t in _tensors(y)):
            raise TypeError(
                f"{type(self.sharded).__name__} under split returned {type(y).__name__} with no tensor holding the "
                f"split group's {total} rows (dim 0), so no rank's own rows can be handed back; return a tensor, "
                "or a plain tuple, list or dict of them")
        return _map(y, lambda t: _BridgeOut.apply(t, self.group, self.rows) if t.dim() and len(t) == total else t)

    def _agree(self, args, kwargs, local: int) -> None:
        """Refuse, on every rank of the group together, arguments whose bridging differs between ranks (e.g. an
        attention mask built only where a rank's rows hold padding): one all-gather of 64 int64 per call."""
        paths, codes = [], []
        _leaves((args, kwargs), "", paths, codes, local)
        mine = torch.tensor(([len(codes)] + codes + [0] * 63)[:64], dtype=torch.int64,
                            device=next((t.device for t in _tensors((args, kwargs))), None))
        every = all_gather(mine.unsqueeze(0), self.group, dim=0, kind="bridge")  # [n, 64]
        if bool((every != mine).any()):
            i = int((every != mine).any(0).nonzero()[0])
            where = "the number of arguments" if i == 0 else f"argument {paths[i - 1] if i <= len(paths) else '?'}"
            raise SplitError(
                f"the ranks of a split group call {type(self.sharded).__name__} with arguments that differ in "
                f"{where} ({_CODES}; per rank: {every[:, i].tolist()}), so they cannot gather the same rows. A "
                "transformers model builds an attention mask only for rows with padding under sdpa: pass the "
                "mask as a 4D tensor, or use attn_implementation='eager', so that every rank has one")

    def _bridge_in(self, t: torch.Tensor, local: int) -> torch.Tensor:
        if t.dim() == 0 or len(t) not in (1, local):
            return t
        if len(t) != local:  # broadcast over the rows: every rank gathers it alike
            t = t.expand(local, *t.shape[1:])
        if t.is_floating_point():
            return _BridgeIn.apply(t, self.group, self.rows)
        if t.dtype == torch.bool:  # masks: gathered as bytes (not every backend all-gathers bool)
            return _gather_rows(t.to(torch.uint8), self.group, self.rows).bool()
        return _gather_rows(t.contiguous(), self.group, self.rows)  # token ids and the like: no gradient back


_CODES = "0: None, 1: a tensor passed whole, 2: a tensor with the rows, gathered, 3: another value"


def _leaves(x, path: str, paths: list[str], codes: list[int], local: int) -> None:
    """Each leaf of a call's ``(args, kwargs)`` with its bridging code (:data:`_CODES`), in order."""
    if type(x) in (tuple, list) or type(x) is dict:
        items = x.items() if type(x) is dict else enumerate(x)
        for k, v in items:
            _leaves(v, f"{path}[{k!r}]" if path else ("args" if k == 0 else "kwargs"), paths, codes, local)
        return
    paths.append(path)
    if x is None or not isinstance(x, torch.Tensor):
        codes.append(0 if x is None else 3)
    else:
        codes.append(2 if x.dim() and len(x) in (1, local) else 1)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif type(x) in (tuple, list) or type(x) is dict:
        for v in (x.values() if type(x) is dict else x):
            yield from _tensors(v)


def _map(x, fn):
    """``x`` with ``fn`` applied to every tensor, inside plain tuples, lists and dicts (others pass as they are)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) in (tuple, list):
        return type(x)(_map(v, fn) for v in x)
    if type(x) is dict:
        return {k: _map(v, fn) for k, v in x.items()}
    return x
