"""The GPT job's MoE variant (``--moe-experts N``): its flags, the model sizes from the flags, and the training
loss with the MoE layers' auxiliary losses."""

from __future__ import annotations

import argparse

import torch

import whale as wh
from examples.gpt.model import GPT, GPTConfig


def add_moe_args(p: argparse.ArgumentParser) -> None:
    """The ``--moe-*`` flags (``--moe-experts 0``, the default, keeps the dense MLPs)."""
    a = p.add_argument
    a("--moe-experts", type=int, default=0, help="0: dense MLPs; N > 0: each block's MLP is a wh.MoE of N experts, "
      "expert parallel over the devices of its pipeline stage (each stage then world/stages devices wide)")
    a("--moe-top-k", type=int, default=2, help="experts per token (1 = Switch, 2 = GShard)")
    a("--moe-d-ff", type=int, default=None, help="hidden width of each expert (default 4 x --n-embd, the dense MLP's)")
    a("--moe-capacity-factor", type=float, default=None,
      help="expert capacity per sample = ceil(factor x tokens x top_k / experts); default: dropless")
    a("--moe-aux-coef", type=float, default=0.01, help="load-balancing loss weight (Switch); applied to the MoE "
      "layers of the last pipeline stage only (the loss runs there; use --stages 1 to give every layer one)")


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The model sizes from the flags (``--moe-*``: MoE blocks)."""
    return GPTConfig(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dropout=args.dropout, moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                     moe_d_ff=args.moe_d_ff, moe_capacity_factor=args.moe_capacity_factor,
                     moe_aux_coef=args.moe_aux_coef)


def moe_loss_fn(model: GPT, loss_fn: wh.SumOverCount) -> wh.SumOverCount:
    """The token cross-entropy ``loss_fn`` plus ``wh.moe_aux_loss(model)`` when training (under autograd; a
    held-out loss stays the plain cross-entropy). The token-sum form adds the aux loss (a mean over the
    micro-batch's samples) times the micro-batch's target tokens, so after Whale divides by the global batch's
    tokens the step's loss is the token-mean cross-entropy + the samples' mean aux loss (every sample has
    ``seq_len`` targets), as in one process."""
    def sum_fn(out, y):
        ce = loss_fn(out, y)
        if not torch.is_grad_enabled():
            return ce
        return ce + wh.moe_aux_loss(model) * loss_fn.count_fn(y)  # a 0-dim tensor: no value read (profiling)

    return wh.SumOverCount(sum_fn, loss_fn.count_fn)
