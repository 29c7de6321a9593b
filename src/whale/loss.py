"""Losses normalised over the whole global batch by a count of terms (token-weighted losses).

A language model's loss is the mean over *valid tokens* of the global batch, not over samples: rows hold
different numbers of valid tokens (padding, ``ignore_index``). A loss given as a plain callable is taken as a
per-sample mean and weighted by rows (``rows / global batch``). A :class:`SumOverCount` instead gives, for the
rows it sees, the sum of its terms; Whale counts the terms of the whole global batch once per step (every rank
holds the global batch, so no communication is needed) and scales every micro-batch's sum by ``1 / count``.
The step then computes exactly ``Σ terms / Σ counts`` over every micro-batch, lane and stage, as one process
would with ``reduction="mean"`` on the whole batch; a micro-batch with no terms contributes zero (never NaN),
and a global batch with no terms gives loss 0 and zero gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SumOverCount:
    """A loss = (sum of terms) / (count of terms over the global batch).

    Args:
        sum_fn: ``sum_fn(output, target) -> scalar``: the SUM of the loss terms over the rows it is given.
        count_fn: ``count_fn(target) -> int or 0-dim tensor``: how many terms those rows hold (e.g.
            ``(target != -100).sum()``). Called once per step on the global target.
    """

    sum_fn: Callable
    count_fn: Callable

    def __call__(self, output, target) -> torch.Tensor:
        """The sum of the terms over the given rows."""
        return self.sum_fn(output, target)

    def count(self, target) -> float:
        """The number of terms in ``target`` (a float, identical on every rank for the same target)."""
        return float(self.count_fn(target))


def _ce_sum(output, target: torch.Tensor, ignore_index: int, label_smoothing: float) -> torch.Tensor:
    output = getattr(output, "logits", output)  # a Hugging Face ModelOutput
    if isinstance(output, torch.Tensor):
        return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), target.reshape(-1),
                               ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum")
    sharded = getattr(output, "sharded_cross_entropy", None)  # whale.parallel.bridge.ShardedLogits of a split head
    if sharded is None:
        raise TypeError(f"token_cross_entropy takes [..., C] logits (a tensor, an object with .logits, or the "
                        f"class-sharded logits of a split head), got {type(output).__name__}")
    return sharded(target.reshape(-1), ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum")


def _count_valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (target != ignore_index).sum()


def token_cross_entropy(ignore_index: int = -100, label_smoothing: float = 0.0) -> SumOverCount:
    """Cross-entropy averaged over the valid targets (``!= ignore_index``) of the global batch: a language
    model's token-mean loss. ``output`` is ``[..., C]`` logits (or class-sharded logits of a split head, or an
    object with a ``.logits`` attribute such as a Hugging Face ``CausalLMOutput``),
    ``target`` the matching ``[...]`` class ids; computed in fp32.

    One process equivalent: ``F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=...)``
    on the whole global batch.
    """
    return SumOverCount(functools.partial(_ce_sum, ignore_index=ignore_index, label_smoothing=label_smoothing),
                        functools.partial(_count_valid, ignore_index=ignore_index))
