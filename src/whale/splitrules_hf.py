"""Plan-time side of the split rules for Hugging Face ``transformers`` modules: how many whole units (heads,
features) each module type cuts, how those units are shared out over a split group, and the refusals.

Loaded lazily by :mod:`whale.splitrules` the first time a ``transformers`` module type is checked (so neither
Whale nor ``whale plan`` imports ``transformers`` for other models), it imports nothing of Whale's above
:mod:`whale.splitrules` and :mod:`whale.plan.shares` (planning must not import :mod:`whale.parallel`). The
sharded modules themselves are in :mod:`whale.parallel.split_hf`, which uses the helpers below so that the plan
and the runtime agree.

Units. A Llama attention is cut by whole key/value heads, each with the ``num_key_value_groups`` query heads that
attend with it (grouped-query attention keeps its grouping on every shard); a GPT-2 attention by whole heads
(self-attention only); a Llama or GPT-2 MLP by intermediate features. Shard sizes in units come from the split's
shard weights by Whale's one apportionment (:func:`whale.plan.shares.whole_shares`: the slowest shard as
fast as whole units allow, every shard at least one unit), so hardware-aware shares are rounded to whole
key/value heads. Explicit element sizes (``shard_module(..., sizes=...)``) must be whole multiples of a unit;
they are never rounded (that would silently change the split asked for): anything else is refused with
:class:`~whale.splitrules.SplitError`.
"""

from __future__ import annotations

import importlib

from torch import nn

from whale.plan.shares import whole_shares
from whale.splitrules import SplitError, _bound, _name, _register_builtin_check, _where

__all__ = ["kv_heads", "unit_shards", "HF_TYPES"]


def kv_heads(attn: nn.Module) -> tuple[int, int, int]:
    """``(key/value heads, query heads per key/value head, head_dim)`` of a Llama-style attention, read from
    its projections (so a config edited after construction cannot mislead).

    Raises:
        SplitError: the projections' shapes are not whole heads of ``head_dim``, or the query heads are not a
            whole number of groups per key/value head.
    """
    hd = int(attn.head_dim)
    q, k = attn.q_proj.out_features, attn.k_proj.out_features
    if q % hd or k % hd or attn.v_proj.out_features != k or attn.o_proj.in_features != q or (q // hd) % (k // hd):
        raise SplitError(
            f"split cannot cut {_name(type(attn))} by heads: q_proj has {q} and k_proj {k} output features, "
            f"v_proj {attn.v_proj.out_features}, o_proj {attn.o_proj.in_features} input features, head_dim {hd}; "
            "expected whole heads, the query heads a multiple of the key/value heads")
    return k // hd, (q // hd) // (k // hd), hd


def unit_shards(units: int, n: int, weights=None, sizes=None, unit: int = 1, what: str = "units",
                where: str = "the module") -> list[int]:
    """Shard sizes in whole units for ``n`` ranks: from explicit element ``sizes`` (each a multiple of
    ``unit`` elements), else proportional to ``weights`` (``None``: equal), every shard at least one unit.

    Args:
        units: units the dim holds (e.g. key/value heads).
        n: ranks of the split group.
        weights: relative shard weights per rank (the plan's shard weights) or ``None``.
        sizes: element sizes per rank along the dim of ``units * unit`` elements, or ``None``.
        unit: elements per unit (e.g. ``num_key_value_groups * head_dim`` query features per key/value head).
        what, where: for messages (``"key/value heads"``, ``"module 'layers.0.attn' (LlamaAttention)"``).

    Raises:
        SplitError: fewer units than ranks; ``sizes`` not ``n`` positive multiples of ``unit`` adding up to
            ``units * unit`` (names the sizes, the unit and the fix); bad ``weights``.
    """
    if units < n:
        raise SplitError(f"split over {n} devices cannot shard {where}: it cuts whole {what}, and it has {units}; "
                         f"use at most {units} device(s) for this split, or a model with more {what}")
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if len(sizes) != n or min(sizes) < unit or any(s % unit for s in sizes) or sum(sizes) != units * unit:
            raise SplitError(
                f"split of {where} got shard sizes {sizes}, but it cuts whole {what} of {unit} element(s) each: "
                f"give {n} sizes, each a positive multiple of {unit}, adding up to {units * unit} (sizes are never "
                "rounded), or pass shard weights instead (rounded to whole units)")
        return [s // unit for s in sizes]
    weights = [1.0] * n if weights is None else [float(w) for w in weights]
    if len(weights) != n or min(weights) < 0 or not sum(weights) > 0:
        raise SplitError(f"split of {where} got shard weights {weights}; give {n} non-negative numbers with a "
                         "positive sum")
    return whole_shares(units, weights, min_share=1)


# --- plan-time checks (called with the module, its FQN and the split's device count) ----------------------
def _attention_dims(attn: nn.Module, fqn: str, n: int) -> None:
    where = f"{_where(fqn)} ({_name(type(attn))})"
    try:
        units, groups, _ = kv_heads(attn)
    except SplitError as e:
        raise SplitError(f"{where}: {e}") from None
    what = f"key/value heads (each with its {groups} query head(s))" if groups > 1 else "attention heads"
    unit_shards(units, n, what=what + "; config.num_key_value_heads", where=where)


def _gated_mlp_dims(mlp: nn.Module, fqn: str, n: int) -> None:
    _bound(mlp.gate_proj, fqn, "intermediate features (gate_proj/up_proj out_features)", mlp.gate_proj.out_features,
           n, note=", a gated MLP")


def _gpt2_mlp_dims(mlp: nn.Module, fqn: str, n: int) -> None:
    _bound(mlp.c_fc, fqn, "intermediate features (c_fc's nf)", mlp.c_fc.nf, n, note=", a GPT-2 MLP")


def _gpt2_attention_dims(attn: nn.Module, fqn: str, n: int) -> None:
    where = f"{_where(fqn)} ({_name(type(attn))})"
    if getattr(attn, "is_cross_attention", False):
        raise SplitError(f"split over {n} devices cannot shard {where}: cross-attention (q_attn) has no split "
                         "rule; keep it outside the split or register one with whale.register_split_rule")
    unit_shards(attn.num_heads, n, what="attention heads (config.n_head)", where=where)


def _types() -> dict[str, tuple]:
    """``"module:Class" -> (plan-time check)`` of the types with a rule (imported where present)."""
    return {
        "transformers.models.llama.modeling_llama:LlamaAttention": _attention_dims,
        "transformers.models.llama.modeling_llama:LlamaMLP": _gated_mlp_dims,
        "transformers.models.gpt2.modeling_gpt2:GPT2MLP": _gpt2_mlp_dims,
        "transformers.models.gpt2.modeling_gpt2:GPT2Attention": _gpt2_attention_dims,
    }


def _resolve(path: str) -> type | None:
    mod, _, cls = path.partition(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError):  # an older or newer transformers without this class
        return None


HF_TYPES: dict[str, type | None] = {path: _resolve(path) for path in _types()}
"""The ``transformers`` classes these rules know, by ``"module:Class"`` (``None``: absent in this version)."""

for _path, _check in _types().items():
    if HF_TYPES[_path] is not None:
        _register_builtin_check(HF_TYPES[_path], _check)
