"""Small models for the tests: a GPT-like stack with tied embeddings and an MLP, annotated by arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import whale as wh


class Block(nn.Module):
    """Pre-LN residual block: x + fc2(gelu(fc1(ln(x)))); [B, T, d] -> [B, T, d]."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Token LM [B, T] -> logits [B, T, V]; ``stage_layers`` blocks per replicate stage (of ``stage_widths``
    devices, 1 each by default); tied head."""

    def __init__(self, vocab=32, d=16, stage_layers=(2,), tied=True, seq=8, stage_widths=None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1)
        blocks = []
        for i, n in enumerate(stage_layers):
            if len(stage_layers) > 1:
                with wh.replicate(stage_widths[i] if stage_widths else 1):
                    blocks += [Block(d) for _ in range(n)]
            else:
                blocks += [Block(d) for _ in range(n)]
        self.blocks = nn.ModuleList(blocks)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.size(1)]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def lm_loss(logits, y):
    """Mean token cross-entropy; logits [B, T, V], y [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def lm_batches(steps: int, batch: int, seq: int = 8, vocab: int = 32, seed: int = 1):
    """Deterministic random token batches (x, y), each [batch, seq]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


class _Recording:
    """Keeps a copy of every gradient the optimizer steps on (``self.grads[step][id(param)]``), so tests can
    compare gradients too: Adam normalizes away a constant gradient scale, which parameters alone would hide."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.grads: list[dict[int, torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append({id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                           if p.grad is not None})
        return super().step(closure)


class RecordingAdamW(_Recording, torch.optim.AdamW):
    """AdamW that records the gradients it steps on."""


class RecordingSGD(_Recording, torch.optim.SGD):
    """SGD that records the gradients it steps on."""


class SkipLM(nn.Module):
    """Three stages that pass several values across boundaries: a float activation, a bool mask, an int from
    ``idx.size(1)``, and a skip connection from stage 0 into stage 2 (relayed through stage 1)."""

    def __init__(self, vocab=32, d=16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        with wh.replicate(1):
            self.a = Block(d)
        with wh.replicate(1):
            self.b = Block(d)
        with wh.replicate(1):
            self.c = Block(d)
            self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        mask = (idx > 3).unsqueeze(-1)
        x = self.a(h)
        x = self.b(x) * mask
        t = idx.size(1)
        x = self.c(x + h) / t
        return self.head(x)


class PipeWithSplit(nn.Module):
    """Two stages of width 2: stage 0 an embedding and a block, stage 1 a split MLP (column then row) nested in
    its replicate, a block and a head (tied to the embedding with ``tied``). On 4 ranks: 2 stages x 2
    data-parallel lanes, the MLP split over the lanes."""

    def __init__(self, vocab=16, d=8, tied=False):
        super().__init__()
        with wh.replicate(2):
            self.emb = nn.Embedding(vocab, d)
            self.block0 = Block(d)
        with wh.replicate(2):
            with wh.split(2):
                self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.block1 = Block(d)
            self.head = nn.Linear(d, vocab)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.block0(self.emb(idx))
        x = x + self.mlp(x)
        return self.head(self.block1(x))


def tied_pipe_with_split(seed: int = 0) -> PipeWithSplit:
    """Factory for ``whale plan --model tests.models:tied_pipe_with_split`` (same weights for a seed)."""
    torch.manual_seed(seed)
    return PipeWithSplit(tied=True)


class HeadScopedTie(nn.Module):
    """An unannotated embedding tied to an LM head built inside the LAST stage's scope (as users write it): the
    tie must not drag the embedding, nor stage 0's annotated block after it, into the last stage."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        with wh.replicate(1):
            self.block0 = Block(d)
        with wh.replicate(1):
            self.block1 = Block(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.block1(self.block0(self.emb(idx))))


def reference_step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """One plain-PyTorch training step of the one-process reference on the (just computed) ``loss``."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def mse_side_by_side(engine, ref: nn.Module, ref_opt: torch.optim.Optimizer, steps: int, shape_in, shape_out,
                     after_step=None) -> tuple[list[float], list[float]]:
    """``steps`` MSE steps of ``engine`` and of the one-process ``ref`` on the same random global batches
    (generator seed 0; ``x`` of ``shape_in``, ``y`` of ``shape_out``); ``after_step(x, y)`` runs after each
    engine step. Returns ``(losses, ref_losses)``."""
    g = torch.Generator().manual_seed(0)
    losses, ref_losses = [], []
    for _ in range(steps):
        x, y = torch.randn(*shape_in, generator=g), torch.randn(*shape_out, generator=g)
        losses.append(engine.step((x, y))["loss"])
        if after_step is not None:
            after_step(x, y)
        ref_losses.append(reference_step(ref_opt, F.mse_loss(ref(x), y)))
    return losses, ref_losses


def lm_side_by_side(engine, ref: nn.Module, ref_opt: torch.optim.Optimizer, steps: int,
                    batch: int) -> tuple[list[float], list[float]]:
    """``steps`` steps of ``engine`` and of the one-process ``ref`` (:func:`lm_loss`) on the same
    :func:`lm_batches` ``(x, y)`` of ``batch`` rows. Returns ``(losses, ref_losses)``."""
    losses, ref_losses = [], []
    for x, y in lm_batches(steps, batch):
        losses.append(engine.step((x, y))["loss"])
        ref_losses.append(reference_step(ref_opt, lm_loss(ref(x), y)))
    return losses, ref_losses
