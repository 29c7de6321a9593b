"""The GPT job's training losses: token cross-entropy, plus the MoE layers' auxiliary losses for an MoE model."""

from __future__ import annotations

import torch

import whale as wh
from examples.gpt.model import GPT

loss_fn = wh.token_cross_entropy()
"""Next-token cross-entropy averaged over the target tokens of the whole global batch (logits [b, T, V],
y [b, T]); ``ignore_index=-100`` targets (padding) would not count."""


def moe_loss_fn(model: GPT) -> wh.SumOverCount:
    """:data:`loss_fn` plus ``wh.moe_aux_loss(model)`` when training (under autograd; a held-out loss stays the
    plain cross-entropy). The token-sum form adds the aux loss (a mean over the micro-batch's samples) times the
    micro-batch's target tokens, so after Whale divides by the global batch's tokens the step's loss is the
    token-mean cross-entropy + the samples' mean aux loss (every sample has ``seq_len`` targets), as in one
    process."""
    def sum_fn(out, y):
        ce = loss_fn(out, y)
        if not torch.is_grad_enabled():
            return ce
        return ce + wh.moe_aux_loss(model) * loss_fn.count_fn(y)  # a 0-dim tensor: no value read (profiling)

    return wh.SumOverCount(sum_fn, loss_fn.count_fn)
