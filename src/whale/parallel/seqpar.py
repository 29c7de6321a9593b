"""Sequence parallelism in split regions: the layers a transformer block's shard is built from, and the region.

With ``Config(sequence_parallel=True)`` (recorded as ``Plan.sequence_parallel``) a split region whose shard
declares ``sequence_parallel = True`` (a rule built it with these layers, see below) runs on sequence shards
(Korthikanti et al. 2022, §4.2.2): inside the region the residual stream is ``[B, s/n, h]`` on each of the n
ranks of the split group (B = the group's rows), LayerNorm, dropout and the residual add act on that shard,
:class:`SeqColumnParallelLinear` all-gathers the sequence before its matmul and :class:`SeqRowParallelLinear`
reduce-scatters its partial sums along the sequence in place of the all-reduce. Activation memory per rank is
then the one-process memory divided by n (the formula: :mod:`whale.memory.block_activations`).

:class:`SequenceParallelRegion` bridges a region's rows (the data-parallel layout of the ranks around it, see
:mod:`whale.parallel.bridge`) to sequence shards: in, the rows are all-gathered and each rank keeps its
sequence shard; out, the shards are all-gathered and each rank keeps its rows. Regions whose shard is not
sequence-parallel keep the plain bridges.

Dropout. :class:`SeqDropout` on a shard ``[B, s/n, ...]`` draws the mask of the *whole* ``[B, s, ...]``
tensor from the region's group stream (:mod:`whale.runtime.rng`: the same generator state on every rank of the
split group) and keeps its slice: the n slices put together are exactly the mask ``F.dropout`` draws for the
whole tensor in one process from the same generator state (same ``bernoulli_`` call on the same shape), so
training matches one process mask for mask. The price: every rank draws the whole mask (time, and a transient
of the whole tensor; only the slice is kept for backward).

Replicated parameters on sequence shards (LayerNorm's weight and bias, a row-parallel bias) pass through
:func:`~whale.parallel.split_ops.copy_to_group` in forward: their gradient is the all-reduce over the group
of each shard's partial gradient, the same on every rank (one all-reduce of the parameter per backward).

A custom rule supports sequence parallelism when ``ctx["sequence_parallel"]`` is true by building its shard
from these layers and setting ``sequence_parallel = True`` on the module it returns (see
``examples/gpt/tensor_parallel.py`` for the GPT block).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from whale.parallel.bridge import SplitRegion, _BridgeOut, _map, _tensors
from whale.parallel.seqpar_ops import SEQ_DIM, gather_linear, gather_seq, reduce_scatter_seq, scatter_seq, seq_shard
from whale.parallel.split import ColumnParallelLinear, RowParallelLinear, _Sharded
from whale.parallel.split_ops import copy_to_group, group_size
from whale.parallel.split_state import replicated_param, tied_shard

__all__ = ["SeqColumnParallelLinear", "SeqRowParallelLinear", "SeqLayerNorm", "SeqDropout",
           "SequenceParallelRegion", "is_sequence_parallel"]


def is_sequence_parallel(module: nn.Module) -> bool:
    """Whether a split rule built ``module`` to run on sequence shards (its ``sequence_parallel`` is true)."""
    return bool(getattr(module, "sequence_parallel", False))


class SeqColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel ``nn.Linear`` on a sequence-sharded input: ``[b, s/n, in]`` → ``[b, s, parts × size_r]``.

    ``parts=k``: the output fuses k tensors of ``out / k`` features (a q|k|v projection); each is cut alike by
    ``sizes`` (features per part) and rank r holds its k slices side by side (``fused_parts``, see
    :mod:`whale.parallel.split_state`). Communication: forward all-gather of b·s·in; backward all-gather of
    b·s·in again and reduce-scatter of b·s·in (:func:`~whale.parallel.seqpar_ops.gather_linear`).

    ``sequence_parallel=False``: the plain column-parallel Linear on a replicated input ``[*, in]`` (backward
    all-reduce of the input gradient), kept for its fused layout.

    Raises:
        ValueError: ``out`` not divisible by ``parts``; more shards than features per part; bad ``sizes``.
    """

    def __init__(self, linear: nn.Linear, group=None, sizes: list[int] | None = None, parts: int = 1,
                 weights: list[float] | None = None, sequence_parallel: bool = True) -> None:
        nn.Module.__init__(self)
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.out_features % parts:
            raise ValueError(f"Linear with {self.out_features} output features cannot hold {parts} equal parts")
        self._set_shards(group, self.out_features // parts, sizes, weights)
        self.gather_output, self.fused_parts, self.part_sizes = False, parts, self.sizes
        self.sizes = [parts * s for s in self.part_sizes]  # the local parameters' extent along dim 0
        self.weight = self._slices(linear.weight)
        self.bias = None if linear.bias is None else self._slices(linear.bias)

    def _slices(self, full: torch.Tensor) -> nn.Parameter:
        """This rank's rows of each fused part along dim 0, side by side (one parameter per tied ``full``)."""
        part = full.shape[0] // self.fused_parts

        def make() -> nn.Parameter:
            """The shard parameter, built once per tied ``full``."""
            pieces = [full.detach().narrow(0, j * part + self.shard_start, self.shard_size)
                      for j in range(self.fused_parts)]
            return nn.Parameter(torch.cat(pieces, 0).clone(), requires_grad=full.requires_grad)
        return tied_shard(full, ("fused", 0, self.shard_start, self.shard_size, self.fused_parts), make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s/n, in]`` (this rank's sequence shard) → ``[b, s, parts × size_r]``."""
        if not self.sequence_parallel:
            return F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather_linear(x, self.weight, self.bias, self.group)


class SeqRowParallelLinear(RowParallelLinear):
    """Row-parallel ``nn.Linear`` whose output is sequence-sharded: ``[b, s, size_r]`` → ``[b, s/n, out]``.

    Forward: partial sums reduce-scattered along the sequence (b·s·out), then the replicated bias added to
    the shard; backward: all-gather of the output gradient (b·s·out) and the bias gradient all-reduced.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, size_r]`` → this rank's ``[b, s/n, out]``."""
        y = reduce_scatter_seq(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + copy_to_group(self.bias, self.group)


class SeqLayerNorm(_Sharded):
    """``nn.LayerNorm`` over the last dims of a sequence shard ``[b, s/n, h]``, its weight and bias replicated on
    the group (their gradients all-reduced over it in backward). No communication in forward.
    ``sequence_parallel=False``: on replicated values (every rank then computes the same gradient; no
    communication at all)."""

    LAYOUT = {"weight": None, "bias": None}

    def __init__(self, norm: nn.LayerNorm, group=None, sequence_parallel: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.group, self.sizes = group, [1] * group_size(group)  # sizes: unused by a replicated layout
        self.normalized_shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.weight = None if norm.weight is None else replicated_param(norm.weight, group, None)
        self.bias = None if norm.bias is None else replicated_param(norm.bias, group, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s/n, h]`` → ``[b, s/n, h]``."""
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = None if w is None else copy_to_group(w, self.group)
            b = None if b is None else copy_to_group(b, self.group)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)

    def extra_repr(self) -> str:
        """Shape and epsilon for ``print(module)``."""
        return f"{self.normalized_shape}, eps={self.eps}, sequence-sharded"


class SeqDropout(nn.Module):
    """Dropout of probability ``p`` on a sequence shard ``[b, s/n, ...]`` with one process's mask: the mask of
    the whole ``[b, s, ...]`` tensor is drawn from the current generator (the region's group stream, the same
    on every rank of the group) and this rank keeps its slice (see the module docstring). Identity in eval or
    with ``p = 0``.

    Raises:
        ValueError: ``p`` outside [0, 1).
    """

    def __init__(self, p: float, group=None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1)")
        self.p, self.group = float(p), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s/n, ...]`` → ``[b, s/n, ...]``."""
        if not self.training or self.p == 0.0:
            return x
        n = group_size(self.group)
        shape = list(x.shape)
        shape[SEQ_DIM] *= n
        start, size = seq_shard(shape[SEQ_DIM], self.group)
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - self.p)
        noise = noise.narrow(SEQ_DIM, start, size).clone()  # a fresh tensor: the whole mask is not kept
        return x * noise.div_(1.0 - self.p)

    def extra_repr(self) -> str:
        """Probability for ``print(module)``."""
        return f"p={self.p}, sequence-sharded (one process's mask)"


class SequenceParallelRegion(SplitRegion):
    """A :class:`~whale.parallel.bridge.SplitRegion` whose shard runs on sequence shards.

    Shapes: the hidden states, this rank's rows ``[b_r, s, h]`` (the first positional argument) → all the
    group's rows, this rank's sequence shard ``[B, s/n, h]`` into the shard → its output ``[B, s/n, h]`` →
    this rank's rows ``[b_r, s, h]``. Other arguments are bridged as :class:`SplitRegion` does (whole rows).
    Communication per call: forward all-gather of the rows (B·s·h) and of the output shards (B·s·h); backward
    the same two all-gathers.

    Raises:
        SplitError: (forward) the sequence length is not a multiple of the group size.
        TypeError: (forward) the first argument is not a ``[b, s, ...]`` floating-point tensor.
    """

    def forward(self, *args, **kwargs):
        """This rank's rows in, this rank's rows out (see the class docstring)."""
        if self.rows is None:
            raise RuntimeError("SplitRegion.set_rows was not called: the split runtime sets row counts per step")
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 3):
            raise TypeError(f"sequence parallelism needs {type(self.sharded).__name__}'s first argument to be the "
                            f"hidden states [b, s, ...], got {type(x).__name__}; call it with them first")
        seq_shard(x.shape[SEQ_DIM], self.group)  # refuse an indivisible length before any collective
        local, total = self.rows[dist.get_rank(self.group)], sum(self.rows)
        if len(args) + len(kwargs) > 1:
            self._agree(args, kwargs, local)
        args, kwargs = _map((args, kwargs), lambda t: self._bridge_in(t, local))
        y = self.sharded(scatter_seq(args[0], self.group), *args[1:], **kwargs)
        if not any(t.dim() >= 2 and len(t) == total for t in _tensors(y)):
            raise TypeError(f"{type(self.sharded).__name__} under sequence parallelism returned "
                            f"{type(y).__name__} with no [B, s/n, ...] tensor of the group's {total} rows")
        return _map(y, lambda t: self._out(t, total))

    def _out(self, t: torch.Tensor, total: int) -> torch.Tensor:
        if not (t.dim() >= 2 and len(t) == total):
            return t
        return _BridgeOut.apply(gather_seq(t, self.group), self.group, self.rows)
