"""Activation bytes of one transformer layer: the formula of Korthikanti et al. and a measurement.

**The paper** (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, §4,
eqs. 1-3; fp16, 1-byte dropout masks, attention materializing the ``[a, s, s]`` scores, no recomputation),
bytes per layer, with s the sequence length, b the micro-batch, h the hidden size, a the heads, t the
tensor-parallel degree:

- one process: ``s·b·h·(34 + 5·a·s/h)``
- tensor parallel: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``
- tensor + sequence parallel: ``s·b·h·(34 + 5·a·s/h) / t``

**Whale's GPT block** (:class:`examples.gpt.model.Block`: pre-LayerNorm, fused q|k|v, PyTorch's fused
``scaled_dot_product_attention``, GELU MLP of width 4h, dropout after each projection; fp32, dropout noise
kept as a float tensor; attention-probability dropout off, so the fused kernel keeps no ``[a, s, s]`` tensor).
What autograd saves, in elements (bytes = elements × 4):

==================================  ==========  =================  ======================================
tensor                              elements    tensor parallel    the paper's fp16 bytes it replaces
==================================  ==========  =================  ======================================
2 LayerNorm inputs                  2·sbh       replicated         4·sbh
2 LayerNorm mean / rstd             4·sb        replicated         (not counted)
q|k|v projection input              sbh         replicated         2·sbh
q, k, v (one storage)               3·sbh       / t                6·sbh (Q, K, V)
attention output = out-proj input   sbh         / t                2·sbh (out-projection input)
attention logsumexp (kernel)        a·sb        / t                (the 5as²b terms of the s² kernel)
MLP input                           sbh         replicated         2·sbh
GELU input, fc2 input               8·sbh       / t                16·sbh
2 dropout masks (float)             2·sbh       replicated         2·sbh
==================================  ==========  =================  ======================================

The attention kernel writes its output as ``[b, s, a, d]`` (returned as a ``[b, a, s, d]`` view), so the
transpose back to ``[b, s, h]`` is a view and the out-projection keeps that same storage. In bytes (itemsize
``e`` = 4):

- one process: ``e·(18·sbh + a·sb + 4·sb)``
- tensor parallel: ``e·((6 + 12/t)·sbh + a·sb/t + 4·sb)`` (the paper's ``10 + 24/t`` in fp16 bytes is
  ``5 + 12/t`` elements; the 6 here counts the two masks as floats)
- tensor + sequence parallel: ``e·(18·sbh + a·sb + 4·sb) / t`` -- every row of the table divided by t: the
  replicated rows run on ``[b, s/t, h]`` sequence shards, and the column-parallel inputs (q|k|v input, MLP
  input) are kept as shards and all-gathered again in backward (:func:`whale.parallel.seqpar_ops.gather_linear`).

Under Whale's split, b is the split group's rows of the micro-batch (a region gathers every row of the group).

:class:`SavedActivations` measures what autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``):
each storage once, parameters excluded.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["gpt_block_activation_bytes", "paper_activation_bytes", "SavedActivations"]


def gpt_block_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                               itemsize: int = 4) -> float:
    """Bytes one rank keeps for backward for one GPT block (the table in the module docstring).

    Args:
        s, b, h, a: sequence length, rows (the split group's), hidden size, attention heads.
        t: tensor-parallel (split) degree; 1 is one process.
        sequence_parallel: activations between the split operators on sequence shards.
        itemsize: bytes per element (4 for fp32).

    Raises:
        ValueError: ``t < 1``.
    """
    if t < 1:
        raise ValueError(f"split degree t={t} must be >= 1")
    sbh, sb = s * b * h, s * b
    whole = 18 * sbh + a * sb + 4 * sb
    if sequence_parallel or t == 1:
        return itemsize * whole / t
    return itemsize * ((6 + 12 / t) * sbh + a * sb / t + 4 * sb)


def paper_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al.'s bytes per layer (fp16, the module docstring's first list)."""
    sbh = s * b * h
    if sequence_parallel or t == 1:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


class SavedActivations:
    """Count the bytes autograd saves for backward while the context is active (each storage once; tensors
    sharing a storage with a parameter of ``exclude`` are not activations).

    Attributes:
        bytes: total bytes of the distinct storages saved.
        count: number of distinct storages.
    """

    def __init__(self, exclude: nn.Module | None = None) -> None:
        self._params = set() if exclude is None else {p.untyped_storage().data_ptr() for p in exclude.parameters()}
        self._seen: set[int] = set()
        self.bytes, self.count = 0, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._params and ptr not in self._seen and storage.nbytes():
            self._seen.add(ptr)
            self.bytes += storage.nbytes()
            self.count += 1
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
