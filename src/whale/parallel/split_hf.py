"""split rules for Hugging Face ``transformers`` modules: Llama's and GPT-2's attention and MLP.

``wh.annotate(model, {"model.layers.*.mlp": s, "model.layers.*.self_attn": s})`` (with ``s`` a ``split``,
beside or nested in a ``replicate``) shards these modules Megatron-style (Shoeybi et al. 2019): the first
projections column-parallel, the last one row-parallel, one all-reduce per module in forward and one in backward.

Why our own rules rather than torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``:
those shard parameters as DTensors over a DeviceMesh in equal pieces. Whale cuts uneven, hardware-aware shards
(sized by device speed within memory, :mod:`whale.planner.hardware`) and bridges a split region's rows to the
data-parallel ranks around it (:mod:`whale.parallel.bridge`); its split layers
(:class:`~whale.parallel.split.ColumnParallelLinear`, :class:`~whale.parallel.split.RowParallelLinear`) already
do both, so these rules only decide the cuts, in whole heads (see :mod:`whale.parallel.split`'s docstring).

Each shard is a shallow copy of the ``transformers`` module with its projections replaced, so the module's own
forward runs unchanged (attention kernels, rotary embeddings, masks). What each forward reads stays valid:

- ``LlamaMLP`` (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``): gate_proj and up_proj column-sharded along
  the intermediate features with the same sizes, down_proj row-sharded with them; act_fn and the product are
  elementwise. Input ``[*, hidden]`` -> output ``[*, hidden]`` (full, after one all-reduce).
- ``LlamaAttention``: q_proj, k_proj and v_proj column-sharded by whole key/value heads, each with its
  ``num_key_value_groups`` query heads (query head h attends with key/value head h // groups, so a contiguous
  range of key/value heads takes a contiguous range of query heads); o_proj row-sharded over the same query
  features. The forward infers the local head count from the projections' outputs (``view(*shape, -1,
  head_dim)``); ``head_dim``, ``scaling``, ``num_key_value_groups``, ``is_causal`` and ``config`` (shared, never
  modified) are unchanged. Input ``hidden_states [b, s, hidden]`` -> ``(output [b, s, hidden], attention weights
  of this rank's heads or None)``.
- ``GPT2MLP``: ``transformers``' ``Conv1D`` (weight ``[in, out]``, transposed against ``nn.Linear``) c_fc
  column-sharded (weight dim 1, bias dim 0), c_proj row-sharded (weight dim 0, bias replicated).
- ``GPT2Attention`` (self-attention): the fused q|k|v c_attn cut by whole heads, the same heads of q, k and v
  side by side on each rank (a fused layout, ``fused_parts = 3``, that the consolidated model unfuses); c_proj
  row-sharded. Its forward splits c_attn's output by ``split_size`` and reads the head count from the shapes:
  the shard's ``split_size`` and ``num_heads`` are the local ones (``embed_dim``, ``head_dim``, ``scaling``,
  ``layer_idx`` unchanged). Cross-attention (``q_attn``) is refused.

Shard sizes: whole units (key/value heads; features) from the plan's shard weights, or explicit element sizes
that are whole multiples of a unit (:func:`whale.splitrules_hf.unit_shards`; nothing is rounded silently).

Communication per module and step (N rows, fp32, as in :mod:`whale.parallel.split`): forward all-reduce of
N x hidden x 4 bytes (o_proj / down_proj / c_proj); backward one all-reduce of the input gradient per
column-sharded projection (N x hidden x 4 each: 3 for Llama attention, 2 for its MLP, 1 for GPT-2's). Around
each region the bridges of :mod:`whale.parallel.bridge` gather the rows of the data-parallel ranks: for
attention also its keyword tensors (the mask, the rotary ``cos``/``sin`` expanded to the rows, position ids),
after one small all-gather checking that every rank passes the same kinds of arguments.

Limitations: attention dropout inside the kernel draws from the split group's stream (the same mask on every
shard's heads, see :mod:`whale.runtime.rng`), so equality with one process needs ``attention_dropout=0``
(``attn_pdrop=0`` for GPT-2); other architectures (Mistral, Qwen, ...: classes of their own in ``transformers``)
need a rule of their own (``whale.register_split_rule``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from whale.parallel.split import ColumnParallelLinear, RowParallelLinear, _Sharded
from whale.parallel.split_ops import copy_to_group, group_rank, group_size, reduce_from_group
from whale.parallel.split_state import local_param, replicated_param, tied_shard
from whale.splitrules import SplitError, _name, _register_lazy_builtin
from whale.splitrules_hf import HF_TYPES, kv_heads, unit_shards

__all__ = ["shard_llama_mlp", "shard_llama_attention", "shard_gpt2_mlp", "shard_gpt2_attention", "Conv1DColumn",
           "Conv1DRow"]


def _with(module: nn.Module, **children: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose named children are replaced (the original is not modified)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters, clone._buffers = dict(module._parameters), dict(module._buffers)
    clone._modules.update(children)
    return clone


def shard_llama_mlp(module: nn.Module, group, sizes=None, **ctx) -> nn.Module:
    """This rank's shard of a ``LlamaMLP``: gate_proj/up_proj column-sharded and down_proj row-sharded along the
    intermediate features (``sizes``: element sizes of that dim, or ``None`` for ``ctx["weights"]``).

    Shapes: ``[*, hidden]`` -> ``[*, hidden]`` (full on every rank).

    Raises:
        SplitError: fewer intermediate features than ranks, or bad ``sizes``.
    """
    n = group_size(group)
    feats = unit_shards(module.gate_proj.out_features, n, ctx.get("weights"), sizes, 1, "intermediate features",
                        _name(type(module)))
    gate = ColumnParallelLinear(module.gate_proj, group, feats)
    return _with(module, gate_proj=gate, up_proj=ColumnParallelLinear(module.up_proj, group, feats),
                 down_proj=RowParallelLinear(module.down_proj, group, feats))


def shard_llama_attention(module: nn.Module, group, sizes=None, **ctx) -> nn.Module:
    """This rank's shard of a ``LlamaAttention`` by whole key/value heads (with their query-head groups).

    ``sizes``: element sizes along q_proj's output features (each a multiple of ``num_key_value_groups x
    head_dim``), or ``None`` for ``ctx["weights"]`` rounded to whole key/value heads.

    Shapes: ``hidden_states [b, s, hidden]`` -> ``([b, s, hidden], weights of the local heads or None)``.

    Raises:
        SplitError: fewer key/value heads than ranks, projections that are not whole heads, or bad ``sizes``.
    """
    units, groups, hd = kv_heads(module)
    heads = unit_shards(units, group_size(group), ctx.get("weights"), sizes, groups * hd,
                        "key/value heads (with their query heads)", _name(type(module)))
    q = [u * groups * hd for u in heads]
    kv = [u * hd for u in heads]
    return _with(module, q_proj=ColumnParallelLinear(module.q_proj, group, q),
                 k_proj=ColumnParallelLinear(module.k_proj, group, kv),
                 v_proj=ColumnParallelLinear(module.v_proj, group, kv),
                 o_proj=RowParallelLinear(module.o_proj, group, q))


class Conv1DColumn(_Sharded):
    """``transformers``' ``Conv1D`` (``x @ weight + bias``, weight ``[in, out]``) with its output features
    sharded: rank r holds ``weight[:, start:start+size_r]`` and ``bias[start:start+size_r]``. With ``parts=k``
    the output fuses k tensors of ``out / k`` features each (GPT-2's q|k|v): ``sizes`` cut each part alike and
    rank r holds the k slices side by side (``fused_parts``, see :mod:`whale.parallel.split_state`).

    Shapes: ``[*, in]`` (replicated) -> ``[*, k x size_r]``. Communication: backward all-reduce of the input
    gradient, N x in floats.

    Raises:
        ValueError: ``out`` not divisible by ``parts``; more shards than features per part; bad ``sizes``.
    """

    LAYOUT = {"weight": 1, "bias": 0}

    def __init__(self, conv: nn.Module, group=None, sizes=None, parts: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = conv.weight.shape
        if self.out_features % parts:
            raise ValueError(f"Conv1D with {self.out_features} output features cannot hold {parts} equal parts")
        self._set_shards(group, self.out_features // parts, sizes, None)
        self.fused_parts, self.part_sizes = parts, self.sizes
        self.sizes = [parts * s for s in self.part_sizes]  # the local parameters' extent along the cut dim
        self.weight = self._slices(conv.weight, 1)
        self.bias = self._slices(conv.bias, 0)

    def _slices(self, full: torch.Tensor, dim: int) -> nn.Parameter:
        if self.fused_parts == 1:
            return local_param(full, dim, self.shard_start, self.shard_size, 0.0 if dim == 0 else 0.02)
        if full.is_meta:
            raise SplitError("a fused Conv1D (GPT-2's c_attn) built on the meta device cannot be split; build it "
                             "on a real device")
        part = full.shape[dim] // self.fused_parts

        def make() -> nn.Parameter:
            """This rank's rows of each fused part, concatenated (a fresh parameter)."""
            pieces = [full.detach().narrow(dim, j * part + self.shard_start, self.shard_size)
                      for j in range(self.fused_parts)]
            return nn.Parameter(torch.cat(pieces, dim).clone(), requires_grad=full.requires_grad)
        return tied_shard(full, ("fused", dim, self.shard_start, self.shard_size, self.fused_parts), make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[*, in]`` -> ``[*, parts x size_r]``."""
        return torch.addmm(self.bias, copy_to_group(x, self.group).reshape(-1, self.in_features),
                           self.weight).view(*x.shape[:-1], self.weight.shape[1])


class Conv1DRow(_Sharded):
    """``Conv1D`` with its input features sharded: rank r holds ``weight[start:start+size_r, :]``; the bias is
    replicated and added once, after the all-reduce.

    Shapes: ``[*, size_r]`` -> ``[*, out]`` (full on every rank). Communication: forward all-reduce of
    N x out floats.

    Raises:
        ValueError: more shards than input features; bad ``sizes``.
    """

    LAYOUT = {"weight": 0, "bias": None}

    def __init__(self, conv: nn.Module, group=None, sizes=None) -> None:
        super().__init__()
        self.in_features, self.out_features = conv.weight.shape
        self._set_shards(group, self.in_features, sizes, None)
        self.weight = local_param(conv.weight, 0, self.shard_start, self.shard_size, 0.02)
        self.bias = replicated_param(conv.bias, group, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[*, size_r]`` -> ``[*, out]``."""
        y = reduce_from_group(x.reshape(-1, self.shard_size) @ self.weight, self.group)
        return (y + self.bias).view(*x.shape[:-1], self.out_features)


def shard_gpt2_mlp(module: nn.Module, group, sizes=None, **ctx) -> nn.Module:
    """This rank's shard of a ``GPT2MLP``: c_fc column-, c_proj row-sharded along the intermediate features.

    Shapes: ``[*, hidden]`` -> ``[*, hidden]`` (full on every rank; the trailing dropout acts on full values).

    Raises:
        SplitError: fewer intermediate features than ranks, or bad ``sizes``.
    """
    feats = unit_shards(module.c_fc.nf, group_size(group), ctx.get("weights"), sizes, 1, "intermediate features",
                        _name(type(module)))
    return _with(module, c_fc=Conv1DColumn(module.c_fc, group, feats), c_proj=Conv1DRow(module.c_proj, group, feats))


def shard_gpt2_attention(module: nn.Module, group, sizes=None, **ctx) -> nn.Module:
    """This rank's shard of a ``GPT2Attention`` by whole heads: the fused c_attn column-sharded with q, k and v
    each cut alike (``parts=3``), c_proj row-sharded; ``split_size`` and ``num_heads`` set to the local values
    (the forward splits c_attn's output by ``split_size``). ``sizes``: element sizes along each of q, k, v (each a
    multiple of ``head_dim``), or ``None`` for ``ctx["weights"]`` rounded to whole heads.

    Shapes: ``hidden_states [b, s, hidden]`` -> ``([b, s, hidden], weights of the local heads or None)``.

    Raises:
        SplitError: cross-attention (q_attn), fewer heads than ranks, or bad ``sizes``.
    """
    if getattr(module, "is_cross_attention", False):
        raise SplitError(f"split of {_name(type(module))}: cross-attention (q_attn) has no split rule")
    heads = unit_shards(module.num_heads, group_size(group), ctx.get("weights"), sizes, module.head_dim,
                        "attention heads", _name(type(module)))
    feats = [h * module.head_dim for h in heads]
    clone = _with(module, c_attn=Conv1DColumn(module.c_attn, group, feats, parts=3),
                  c_proj=Conv1DRow(module.c_proj, group, feats))
    clone.split_size, clone.num_heads = feats[group_rank(group)], heads[group_rank(group)]
    return clone


_RULES = {
    "transformers.models.llama.modeling_llama:LlamaAttention": shard_llama_attention,
    "transformers.models.llama.modeling_llama:LlamaMLP": shard_llama_mlp,
    "transformers.models.gpt2.modeling_gpt2:GPT2MLP": shard_gpt2_mlp,
    "transformers.models.gpt2.modeling_gpt2:GPT2Attention": shard_gpt2_attention,
}
for _path, _rule in _RULES.items():
    if HF_TYPES.get(_path) is not None:
        _register_lazy_builtin(HF_TYPES[_path], _rule)
for _cls in (Conv1DColumn, Conv1DRow):
    _register_lazy_builtin(_cls, lambda module, group, sizes, **ctx: module)
