"""A GPT-style decoder with Whale annotations in the model code.

Token + learned positional embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention through
``scaled_dot_product_attention``, GELU MLP of width 4x), a final LayerNorm and an LM head whose weight is tied
to the token embedding. ``forward(idx [B, T]) -> logits [B, T, vocab]``; the loss is computed outside.

Pipeline annotations: with ``stages > 1`` the blocks are built in contiguous groups, each group constructed
inside ``with wh.replicate(1):`` so that every group is one TaskGraph (one pipeline stage). Embeddings,
``ln_f`` and the head are built outside any scope (default strategy); the library places them.

The forward is ``torch.fx.symbolic_trace``-able: no unpacking of ``x.size()``, no control flow on tensor values.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from whale.planner.partition import uniform_partition


@dataclass
class GPTConfig:
    """Model sizes. ``block_size`` is the longest context (positional table size)."""

    vocab_size: int = 2048
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    attn_dropout: float | None = None  # attention-probability dropout (None: the same as dropout)
    moe_experts: int = 0  # 0: dense MLP; E > 0: each block's MLP is a wh.MoE of E experts
    moe_top_k: int = 2
    moe_d_ff: int | None = None  # each expert's hidden width (default 4 x n_embd, the dense MLP's)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_coef: float = 0.01  # Switch load-balancing loss weight
    moe_z_coef: float = 0.0  # router z-loss weight

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.moe_experts < 0:
            raise ValueError(f"moe_experts={self.moe_experts} must be >= 0 (0 = dense MLP)")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, 3C] -> [B, T, 3, H, D] -> [3, B, H, T, D]
        qkv = self.c_attn(x).unflatten(-1, (3, self.n_head, -1)).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).flatten(-2)  # [B, H, T, D] -> [B, T, C]
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: [B, T, C] -> [B, T, 4C] (GELU) -> [B, T, C]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


def moe_mlp(cfg: GPTConfig, aux: bool = True, parallel: bool = True) -> nn.Module:
    """A block's MoE feed-forward ``[B, T, C] -> [B, T, C]``: ``wh.MoE`` of ``cfg.moe_experts`` experts of
    hidden width ``cfg.moe_d_ff`` (default 4C), built under ``wh.split()`` when ``parallel`` (expert parallelism
    over the devices of the enclosing replicate scope, docs/moe.md); ``aux=False`` drops its
    auxiliary-loss coefficients (a layer before the last pipeline stage, where the loss cannot reach them)."""
    import whale as wh

    scope = wh.split() if parallel else contextlib.nullcontext()
    with scope:
        return wh.MoE(cfg.n_embd, cfg.moe_d_ff or 4 * cfg.n_embd, cfg.moe_experts, cfg.moe_top_k,
                      cfg.moe_capacity_factor, aux_loss_coef=cfg.moe_aux_coef if aux else 0.0,
                      z_loss_coef=cfg.moe_z_coef if aux else 0.0)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: [B, T, C] -> [B, T, C]; its MLP is an MoE when ``cfg.moe_experts``
    (``moe_aux`` / ``moe_parallel``: see :func:`moe_mlp`)."""

    def __init__(self, cfg: GPTConfig, moe_aux: bool = True, moe_parallel: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = moe_mlp(cfg, moe_aux, moe_parallel) if cfg.moe_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def stage_layer_counts(n_layer: int, stages: int, stage_layers: list[int] | None = None) -> list[int]:
    """Layers per stage: ``stage_layers`` if given (validated), else as even as possible (earlier stages
    get the remainder), e.g. ``(5, 2) -> [3, 2]``."""
    if stage_layers is not None:
        counts = [int(c) for c in stage_layers]
        if len(counts) != stages or sum(counts) != n_layer or min(counts) < 1:
            raise ValueError(f"stage_layers={counts} must be {stages} positive counts summing to n_layer={n_layer}")
        return counts
    if not 1 <= stages <= n_layer:
        raise ValueError(f"stages={stages} must be between 1 and n_layer={n_layer}")
    return uniform_partition(n_layer, stages)


def _stage_scope(stages: int, width: int | None = None, moe: bool = False):
    """The scope a pipeline stage's blocks are built in: ``wh.replicate(width)`` (default 1 device per stage
    and replica), or, not pipelined, none -- except for an MoE model, whose blocks then go in ``wh.replicate()``
    (all devices) so that the MoE layers' nested ``wh.split()`` spreads the experts over them."""
    if stages == 1 and width is None and not moe:
        return contextlib.nullcontext()
    import whale as wh

    return wh.replicate(width if width is not None or stages == 1 else 1)


def _replicated(on: bool, width: int | None):
    """``wh.replicate(width)`` (data parallel; ``None``: over every device) when ``on``, else no scope."""
    if not on:
        return contextlib.nullcontext()
    import whale as wh

    return wh.replicate(width)


def _block(cfg: GPTConfig, moe_aux: bool, split: bool, width: int | None) -> Block:
    """One block, built under ``wh.split(width)`` when ``split``."""
    if not split:
        return Block(cfg, moe_aux=moe_aux)
    import whale as wh

    with wh.split(width):
        return Block(cfg, moe_aux=moe_aux)


class GPT(nn.Module):
    """GPT decoder: ``forward(idx [B, T] int64) -> logits [B, T, vocab_size]``.

    Args:
        cfg: model sizes (``cfg.moe_experts > 0``: MoE blocks, see :func:`moe_mlp`).
        stages: number of pipeline stages; > 1 builds the blocks in that many ``wh.replicate(1)`` scopes.
        stage_layers: optional explicit blocks per stage (e.g. ``[3, 1]``), summing to ``cfg.n_layer``.
        stage_width: devices per stage (``wh.replicate(stage_width)`` per stage; default 1 per replica, or all
            devices for one stage of an MoE model): expert parallelism runs over a stage's devices. MoE layers
            before the last stage get no auxiliary loss (the loss runs on the last stage; Whale refuses one
            there), so pipelined MoE models balance their earlier layers' load without it.
        split_blocks: build every block under ``wh.split(stage_width)`` (tensor parallelism over its stage's devices,
            the rest of the model under ``wh.replicate(stage_width)`` when not pipelined; with
            ``Config(sequence_parallel=True)`` also sequence parallelism). The blocks' split rule lives in
            :mod:`examples.gpt.tensor_parallel`, which must be imported before planning.
    """

    def __init__(self, cfg: GPTConfig, stages: int = 1, stage_layers: list[int] | None = None,
                 stage_width: int | None = None, split_blocks: bool = False):
        super().__init__()
        self.cfg = cfg
        self.stage_layers = stage_layer_counts(cfg.n_layer, stages, stage_layers)
        outer = split_blocks and stages == 1  # replicate around split blocks: Whale's colocated hybrid
        with _replicated(outer, stage_width):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.drop = nn.Dropout(cfg.dropout)
        blocks: list[Block] = []
        for s, count in enumerate(self.stage_layers):
            with _stage_scope(stages, None if outer else stage_width, bool(cfg.moe_experts)):
                blocks.extend(_block(cfg, s == stages - 1, split_blocks, stage_width) for _ in range(count))
        self.blocks = nn.ModuleList(blocks)
        with _replicated(outer, stage_width):
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "mlp.w2")):  # GPT-2: scale residual projections by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif getattr(m, "is_moe", False):  # experts as the dense MLP: N(0, 0.02) weights, zero biases
            for p in (m.w1, m.w2):
                nn.init.normal_(p, mean=0.0, std=0.02)
            for p in (m.b1, m.b2):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: int64 [B, T] with T <= block_size -> logits float [B, T, vocab_size]."""
        pos = torch.arange(idx.size(1), device=idx.device)  # [T]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        """Parameter count, the tied embedding/head weight counted once."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt ``idx`` [B, T0]; returns [B, T0 + max_new_tokens].

        The context is cropped to the last ``block_size`` tokens. ``top_k`` keeps the k most likely tokens.
        """
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :] / max(temperature, 1e-5)  # [B, V]
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # [B, 1]
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx


def for_plan(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, vocab_size: int = 2048, seq_len: int = 128,
             stages: int = 2, batch: int = 32) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor], object]:
    """Factory for ``whale plan --model examples.gpt.model:for_plan``: the model, a sample batch and the
    training loss (token cross-entropy)."""
    from whale.loss import token_cross_entropy

    cfg = GPTConfig(vocab_size=vocab_size, block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    x = torch.zeros(batch, seq_len, dtype=torch.long)
    return GPT(cfg, stages=stages), (x, x), token_cross_entropy()
