"""split → operator sharding: sharded Linear / Embedding layers and the module-type → rule registry.

The column- and row-parallel Linear layers and the vocabulary-parallel Embedding follow Megatron-LM (Shoeybi et
al. 2019), with uneven shards.

A split TaskGraph's parameters are cut along one dim across the ranks of its VirtualDevice (a process group of
n ranks). Shards may be **uneven**: ``sizes`` (one whole number per rank, in group-rank order, each ≥ 1, adding
up to the dim) come from the plan, e.g. proportional to device FLOPS; ``sizes=None`` means equal shares
(whole elements, :func:`shard_sizes`). Each sharded layer is built **from** an existing full layer and copies
its local slice, so the sharded model computes the same numbers as the unsharded one.

Sharded layers (N = rows of the input, i.e. numel / last dim; bytes handed to collectives per rank and step,
fp32, counted as in :mod:`whale.parallel.split_ops`: an all-gather's whole padded result; a ring all-reduce of
S bytes sends 2(n−1)/n × S):

- :class:`ColumnParallelLinear`: weight rows (out features) sharded; input replicated, output sharded on the
  last dim. Forward: none (``gather_output=True``: all-gather of n × N × max(sizes) × 4). Backward: all-reduce of
  the input gradient, N × in × 4 (none when the input needs no gradient).
- :class:`RowParallelLinear`: weight columns (in features) sharded; input sharded on the last dim, output
  replicated. Forward: all-reduce of the partial sums, N × out × 4. Backward: none (``input_is_parallel=
  False``: all-gather of the input gradient, n × N × max(sizes) × 4).
- Column → elementwise activation → Row (an MLP): no communication in between; N × out × 4 forward plus
  N × in × 4 backward for the pair.
- :class:`VocabParallelEmbedding`: rows of the table (the vocabulary) sharded; forward all-reduce of
  N × embedding_dim × 4 (N = number of ids); backward none. Out-of-range ids raise ``IndexError`` as in one
  process. A weight it shares with a column-sharded head over the same vocabulary stays one parameter
  (see :mod:`whale.parallel.split_state`).
- The loss on class-sharded logits lives in :mod:`whale.parallel.split_loss`; the collectives in
  :mod:`whale.parallel.split_ops`. Both are re-exported here.

Rules. :func:`shard_module` walks a module and replaces what it can shard by a rule looked up by type (exact
type first, then base classes): ``nn.Linear`` → column-sharded (a lone Linear, e.g. the classification head,
keeps sharded outputs unless ``gather_output=True``); ``nn.Sequential`` → children in order, with each
Linear → elementwise modules → Linear run fused as column then row; ``nn.Embedding`` → vocab-sharded;
Hugging Face ``transformers``' Llama attention / MLP and GPT-2 MLP → :mod:`whale.parallel.split_hf` (loaded
the first time such a module is met; whole heads).
Parameter-free modules (activations, dropout, ...) pass through; containers without parameters of their own
are walked recursively. Anything else that holds parameters raises :class:`SplitError`; :func:`whale.plan_model`
already refuses it at plan time, and a sharded dim smaller than the device count too, naming the module (see
:mod:`whale.splitrules`, where the registry lives). Add a rule with :func:`register_split_rule`, with
``dim_size=fn`` (``fn(module) -> int``, the size of the dim the rule cuts) for that plan-time check; a rule is
``fn(module, group, sizes, **ctx) -> nn.Module`` returning this rank's shard (``ctx`` holds ``weights`` and
``gather_output``). Every parameter of the returned module must have a
declared layout (sharded along a dim, or replicated on every rank of the group): Whale's sharded layers declare
theirs; a module of your own needs a ``shard_layout()`` method and a ``sizes`` attribute (see
:mod:`whale.parallel.split_state`, whose :func:`~whale.parallel.split_state.local_param` and
:func:`~whale.parallel.split_state.replicated_param` make the parameters); an undeclared one is refused with
:class:`SplitError`, since gradient norms and the consolidated model depend on it. For example::

    from whale.parallel.split import ColumnParallelLinear, register_split_rule

    class Head(nn.Module):           # owns its parameters directly, so it needs a rule
        def __init__(self, d, c):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(c, d))
        def forward(self, x):
            return x @ self.weight.t()

    def shard_head(module, group, sizes, **ctx):
        lin = nn.Linear(module.weight.shape[1], module.weight.shape[0], bias=False)
        lin.weight = module.weight
        return ColumnParallelLinear(lin, group, sizes, gather_output=ctx.get("gather_output", False))

    register_split_rule(Head, shard_head, dim_size=lambda head: head.weight.shape[0])
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from whale.parallel.split_loss import sharded_accuracy, sharded_argmax, sharded_cross_entropy
from whale.parallel.split_ops import (
    check_sizes,
    comm_bytes,
    copy_to_group,
    gather_from_group,
    group_rank,
    group_size,
    has_values,
    offsets,
    reduce_from_group,
    resolve_sizes,
    scatter_to_group,
    shard_sizes,
)
from whale.parallel.split_state import local_param, replicated_param, undeclared_params
from whale.splitrules import (
    ELEMENTWISE,
    SplitError,
    SplitRule,
    _register_builtin,
    linear_pairs,
    register_split_rule,
    split_rule_for,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SplitError", "SplitRule",
    "ELEMENTWISE", "register_split_rule", "split_rule_for", "shard_module", "shard_sizes", "check_sizes",
    "resolve_sizes", "offsets", "group_rank", "group_size", "comm_bytes", "copy_to_group", "reduce_from_group",
    "gather_from_group", "scatter_to_group", "sharded_cross_entropy", "sharded_argmax", "sharded_accuracy",
]


def _check_ids(ids: torch.Tensor, num_embeddings: int) -> None:
    """Raise ``IndexError`` for an id outside ``[0, num_embeddings)``, as ``F.embedding`` does in one process
    (a shard would otherwise look up zeros for it). Local: every rank of the group holds the same ids."""
    if ids.numel() == 0 or not has_values(ids):
        return
    lo, hi = (int(v) for v in torch.aminmax(ids.detach()))
    if lo < 0 or hi >= num_embeddings:
        bad = lo if lo < 0 else hi
        raise IndexError(f"embedding id {bad} is out of range for a vocabulary of {num_embeddings} (valid ids: 0 "
                         f"to {num_embeddings - 1}); check the token ids or the nn.Embedding's num_embeddings")


class _Sharded(nn.Module):
    """Common bookkeeping: the group, the shard sizes along the sharded dim, and this rank's range.
    :meth:`shard_layout` declares each parameter's layout (see :mod:`whale.parallel.split_state`)."""

    LAYOUT: ClassVar[dict[str, int | None]] = {}

    def shard_layout(self) -> dict[str, int | None]:
        """``{parameter name: sharded dim, or None when replicated on every rank of the group}``."""
        return {name: dim for name, dim in self.LAYOUT.items() if getattr(self, name, None) is not None}

    def _set_shards(self, group, dim_size: int, sizes, weights) -> None:
        self.group = group
        self.sizes = resolve_sizes(dim_size, group, sizes, weights)
        self.rank_in_group = group_rank(group)
        self.shard_start = offsets(self.sizes)[self.rank_in_group]
        self.shard_size = self.sizes[self.rank_in_group]


class ColumnParallelLinear(_Sharded):
    """``nn.Linear`` with its output features sharded: rank r holds ``weight[start:start+size_r, :]`` and the
    matching bias slice.

    Shapes: input ``[*, in]`` (replicated on the group) → output ``[*, size_r]`` (this rank's output features
    ``[shard_start, shard_start + size_r)``), or ``[*, out]`` on every rank with ``gather_output=True``.

    Communication: forward none (all-gather of N × max(sizes) floats with ``gather_output``); backward
    all-reduce of the input gradient, N × in floats.

    Raises:
        ValueError: more shards than ``out_features``; ``sizes`` of the wrong length or not adding up.
    """

    LAYOUT = {"weight": 0, "bias": 0}

    def __init__(self, linear: nn.Linear, group=None, sizes: list[int] | None = None, gather_output: bool = False,
                 weights: list[float] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._set_shards(group, self.out_features, sizes, weights)
        self.gather_output = gather_output
        b = self.in_features ** -0.5
        self.weight = local_param(linear.weight, 0, self.shard_start, self.shard_size, b)
        self.bias = None if linear.bias is None else local_param(linear.bias, 0, self.shard_start, self.shard_size, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[*, in]`` (replicated) -> ``[*, size_r]`` (or ``[*, out]`` with ``gather_output``)."""
        y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather_from_group(y, self.group, -1, self.sizes) if self.gather_output else y

    def extra_repr(self) -> str:
        """Shard layout for ``print(module)``."""
        return (f"in_features={self.in_features}, out_features={self.out_features} (local {self.shard_start}:"
                f"{self.shard_start + self.shard_size} of sizes {self.sizes}), gather_output={self.gather_output}")


class RowParallelLinear(_Sharded):
    """``nn.Linear`` with its input features sharded: rank r holds ``weight[:, start:start+size_r]``; the bias
    is replicated and added once, after the reduction.

    Shapes: input ``[*, size_r]`` (this rank's input features; with ``input_is_parallel=False`` the full
    ``[*, in]``, replicated, sliced here) → output ``[*, out]``, the same on every rank.

    Communication: forward all-reduce of the partial sums, N × out floats; backward none (with
    ``input_is_parallel=False``, all-gather of the input gradient, N × max(sizes) floats).

    Raises:
        ValueError: more shards than ``in_features``; ``sizes`` of the wrong length or not adding up.
    """

    LAYOUT = {"weight": 1, "bias": None}  # the bias is replicated: one copy per group, counted once in norms

    def __init__(self, linear: nn.Linear, group=None, sizes: list[int] | None = None, input_is_parallel: bool = True,
                 weights: list[float] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._set_shards(group, self.in_features, sizes, weights)
        self.input_is_parallel = input_is_parallel
        b = self.in_features ** -0.5
        self.weight = local_param(linear.weight, 1, self.shard_start, self.shard_size, b)
        self.bias = None if linear.bias is None else replicated_param(linear.bias, group, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Forward pass (shapes in the class docstring)."""
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.group, -1, self.sizes)
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        """Shard layout for ``print(module)``."""
        return (f"in_features={self.in_features} (local {self.shard_start}:{self.shard_start + self.shard_size} "
                f"of sizes {self.sizes}), out_features={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(_Sharded):
    """``nn.Embedding`` with its vocabulary (rows) sharded: rank r holds rows ``[start, start + size_r)``.

    Shapes: int64 ids ``[*]`` (global ids in ``[0, num_embeddings)``, replicated) → ``[*, embedding_dim]`` on
    every rank. Ids outside this rank's rows look up zeros; the all-reduce adds the owning rank's row.
    ``padding_idx`` is kept.

    Communication: forward all-reduce of N × embedding_dim floats (N = number of ids); backward none.

    Raises:
        SplitError: ``max_norm`` or ``scale_grad_by_freq`` (their per-batch statistics would be wrong on a
            shard).
        ValueError: more shards than ``num_embeddings``; ``sizes`` of the wrong length or not adding up.
        IndexError: (forward) an id below 0 or at least ``num_embeddings``, naming it and the valid range
            (checked on every rank before any collective: the ids are the same on all of them).
    """

    LAYOUT = {"weight": 0}

    def __init__(self, embedding: nn.Embedding, group=None, sizes: list[int] | None = None,
                 weights: list[float] | None = None) -> None:
        super().__init__()
        if embedding.max_norm is not None or embedding.scale_grad_by_freq:
            raise SplitError("split of nn.Embedding does not support max_norm or scale_grad_by_freq")
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self._set_shards(group, self.num_embeddings, sizes, weights)
        self.sparse = embedding.sparse
        pad = embedding.padding_idx
        local_pad = None if pad is None else pad - self.shard_start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.shard_size else None
        self.weight = local_param(embedding.weight, 0, self.shard_start, self.shard_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Forward pass (shapes in the class docstring)."""
        _check_ids(ids, self.num_embeddings)
        local = ids - self.shard_start
        mine = (local >= 0) & (local < self.shard_size)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight,
                          padding_idx=self.padding_idx, sparse=self.sparse)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return reduce_from_group(out, self.group)

    def extra_repr(self) -> str:
        """Shard layout for ``print(module)``."""
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.shard_start}:"
                f"{self.shard_start + self.shard_size} of sizes {self.sizes})")


# --- registry -------------------------------------------------------------------------------------------
# The registry (SplitError, SplitRule, ELEMENTWISE, register_split_rule, split_rule_for) lives in the neutral
# whale.splitrules, which the planning front end imports without whale.parallel; re-exported above. The rules
# below register themselves there as Whale's built-ins, whose plan-time dims whale.splitrules knows.


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard_module(module: nn.Module, group=None, sizes: list[int] | None = None, *,
                 weights: list[float] | None = None, gather_output: bool = False,
                 sequence_parallel: bool = False) -> nn.Module:
    """This rank's shard of ``module`` for a split over ``group``; the original module is not modified.

    Args:
        module: the full module (its initialized weights are copied into the shards).
        group: the split process group (``None``: default group).
        sizes: shard sizes for every sharded dim (each must add up to that dim), or ``None``.
        weights: relative load shares per rank, used when ``sizes`` is ``None`` (hardware-aware sizes).
        gather_output: whether the module's output must be full; ``False`` lets a trailing column-sharded
            Linear keep its output sharded along the last dim (the classification head + sharded loss).
        sequence_parallel: passed to ``module``'s own rule as ``ctx["sequence_parallel"]``: a rule that can
            builds a shard running on sequence shards (:mod:`whale.parallel.seqpar`); others ignore it.

    Raises:
        SplitError: a module with parameters and no rule (names the type and how to register one).
        ValueError: invalid ``sizes`` (see :func:`check_sizes`).
    """
    if not _has_params(module):
        return module
    rule = split_rule_for(type(module))
    if rule is not None:
        ctx = {"sequence_parallel": True} if sequence_parallel else {}
        return _declared(rule(module, group, sizes, weights=weights, gather_output=gather_output, **ctx), module)
    if next(module.parameters(recurse=False), None) is not None:
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        raise SplitError(
            f"split has no sharding rule for {name}, which holds parameters of its own; register one with "
            f"whale.parallel.split.register_split_rule({type(module).__name__}, rule), where "
            f"rule(module, group, sizes, **ctx) returns this rank's shard (see the whale.parallel.split docs)")
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    for name, child in module.named_children():
        # Unknown data flow inside a custom container: every sharded child returns full outputs.
        clone._modules[name] = shard_module(child, group, sizes, weights=weights, gather_output=True)
    return clone


def _declared(sharded: nn.Module, module: nn.Module) -> nn.Module:
    """``sharded`` when every parameter's layout is declared (see :mod:`whale.parallel.split_state`)."""
    missing = undeclared_params(sharded)
    if missing:
        raise SplitError(
            f"the split rule for {type(module).__name__} returned a module whose parameter(s) {missing} declare "
            "no shard layout, so gradient norms and the consolidated model cannot be right; build the shard "
            "from ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding, or give the module holding "
            "each parameter a shard_layout() method ({name: sharded dim, or None if replicated}) and a sizes "
            "attribute (shard sizes per rank of the group)")
    return sharded


def _linear_rule(module, group, sizes, **ctx):
    return ColumnParallelLinear(module, group, sizes, gather_output=ctx.get("gather_output", False),
                                weights=ctx.get("weights"))


def _embedding_rule(module, group, sizes, **ctx):
    return VocabParallelEmbedding(module, group, sizes, weights=ctx.get("weights"))


def _sequential_rule(module, group, sizes, **ctx):
    """Children in order; Linear, elementwise*, Linear → column, pass-through, row (no comm in between)."""
    names, kids = list(module._modules), list(module._modules.values())
    out: OrderedDict[str, nn.Module] = OrderedDict()
    weights = ctx.get("weights")
    for i, j in linear_pairs(kids):  # the pairing the plan-time check uses too
        if j is not None:
            col = ColumnParallelLinear(kids[i], group, sizes, gather_output=False, weights=weights)
            out[names[i]] = col
            out.update({names[k]: kids[k] for k in range(i + 1, j)})
            out[names[j]] = RowParallelLinear(kids[j], group, col.sizes, input_is_parallel=True)
            continue
        # Full output needed unless only elementwise modules follow (then the caller decides).
        last = all(isinstance(k, ELEMENTWISE) for k in kids[i + 1:])
        out[names[i]] = shard_module(kids[i], group, sizes, weights=weights,
                                     gather_output=ctx.get("gather_output", False) if last else True)
    return nn.Sequential(out)


def _already_sharded(module, group, sizes, **ctx):
    return module


_register_builtin(nn.Linear, _linear_rule)
_register_builtin(nn.Embedding, _embedding_rule)
_register_builtin(nn.Sequential, _sequential_rule)
for _cls in (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding):
    _register_builtin(_cls, _already_sharded)
