"""Models described without weights: a list of layers with their costs, for planning models far larger than
memory (issue 13, part 5).

A :class:`ModelDesc` is what the search (:mod:`whale.planner.search`) needs of a model and nothing more: per layer,
its training FLOPs per sample, parameter elements, activation bytes per sample saved for backward, output bytes
per sample (what crosses a stage boundary) and its kind. It comes from

- :func:`from_profile`: the fake-tensor profile of a real ``nn.Module`` (:mod:`whale.frontend.profile`;
  :func:`whale.frontend.autoplan.describe_module` profiles and describes in one call), which also works for a
  model built on the meta device (``with torch.device("meta"): model = GPT(...)``): nothing is allocated, a
  50B-parameter model profiles on a laptop;
- :func:`transformer`: the analytic shapes of a (MoE) transformer, for 1T- and 10T-parameter models whose
  module objects alone would be too many to build.

Kinds: ``"dense"`` (an MLP or any layer a tensor-parallel split cuts by its width: Megatron-LM's column/row
pair, two all-reduces of the layer's output forward and two backward), ``"attention"`` (the same cut by heads),
``"moe"`` (a mixture-of-experts layer, GShard/Switch: ``experts`` experts, each token goes to ``top_k`` of them;
an expert-parallel split shards the experts over its devices and every token crosses an all-to-all on its way
to its experts and back, forward and backward), ``"other"`` (embeddings, norms, the head: replicated by a
split, never cut), ``"vocab"`` (a vocab-parallel embedding or LM head, Megatron-LM's VocabParallelEmbedding and
parallel cross-entropy: a split cuts its vocabulary rows; what the split rules of :mod:`whale.splitrules` do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LAYER_KINDS = ("dense", "attention", "moe", "other", "vocab")
"""Layer kinds the search knows how to split (see the module docstring)."""


class ModelDescError(ValueError):
    """A layer description with a bad value; the message names the layer, the field and the value."""


@dataclass(frozen=True)
class LayerDesc:
    """One layer (or profiled unit) of a model, costs per sample (one sequence for language models).

    Attributes:
        name: module FQN or a made-up name (``"h.3.moe"``).
        flops: forward + backward FLOPs per sample (backward ~ 2x forward).
        params: parameter elements (fp32 in the memory model: 4 bytes each, :mod:`whale.planner.memory`).
        activation_bytes: bytes per sample saved for backward.
        output_bytes: bytes per sample of the layer's output (sent between stages; what a split all-reduces).
        kind: one of :data:`LAYER_KINDS`.
        experts: experts of a ``"moe"`` layer (1 otherwise).
        top_k: experts each token visits (``"moe"``).
        expert_params: of ``params``, the elements inside the experts (what expert parallelism shards).
        forward_flops: forward FLOPs per sample (what activation checkpointing recomputes); default flops / 3.
        split_dims: sizes a split of this layer cuts (heads, key/value heads, width, vocabulary); a split degree
            must divide each (``whale.planner.steptime.estimate.DefaultEstimator.split_ok``).
        capacity_factor: of a ``"moe"`` layer, expert capacity over the even share (GShard / Switch: each expert
            takes at most ``capacity_factor * tokens * top_k / experts`` tokens, padded to that); scales what
            its all-to-all sends (its FLOPs and activations already include it, :func:`transformer`).
    """

    name: str
    flops: float
    params: int
    activation_bytes: float
    output_bytes: float
    kind: str = "dense"
    experts: int = 1
    top_k: int = 1
    expert_params: int = 0
    forward_flops: float = -1.0
    split_dims: tuple[int, ...] = ()
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        for f in ("flops", "params", "activation_bytes", "output_bytes", "expert_params"):
            v = getattr(self, f)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ModelDescError(f"layer {self.name!r}: {f}={v!r} must be a finite number >= 0")
        if self.kind not in LAYER_KINDS:
            raise ModelDescError(f"layer {self.name!r}: kind={self.kind!r} is unknown; choose one of {LAYER_KINDS}")
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ModelDescError(f"layer {self.name!r}: need experts >= 1 and 1 <= top_k <= experts, got "
                                 f"experts={self.experts}, top_k={self.top_k}")
        if not self.capacity_factor >= 1.0:
            raise ModelDescError(f"layer {self.name!r}: capacity_factor={self.capacity_factor!r} must be >= 1")
        if self.expert_params > self.params:
            raise ModelDescError(f"layer {self.name!r}: expert_params={self.expert_params} exceeds params="
                                 f"{self.params}")
        if self.forward_flops < 0:
            object.__setattr__(self, "forward_flops", self.flops / 3.0)

    @property
    def splittable(self) -> bool:
        """True when a split cuts this layer's work and parameters (dense, attention, MoE)."""
        return self.kind != "other"


@dataclass(frozen=True)
class ModelDesc:
    """A model as layers in forward order (see the module docstring); plain data, nothing allocated.

    Raises:
        ModelDescError: no layers.
    """

    layers: tuple[LayerDesc, ...]
    name: str = "model"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ModelDescError(f"model {self.name!r} has no layers: describe at least one")

    @property
    def params(self) -> int:
        """Parameter elements of the whole model."""
        return sum(x.params for x in self.layers)

    @property
    def flops(self) -> float:
        """Training FLOPs per sample of the whole model."""
        return sum(x.flops for x in self.layers)

    def summary(self) -> str:
        """One line: name, layers, parameters, TFLOPs per sample."""
        moe = sum(x.kind == "moe" for x in self.layers)
        return (f"{self.name}: {len(self.layers)} layers ({moe} MoE), {self.params / 1e9:.4g}B parameters, "
                f"{self.flops / 1e12:.4g} TFLOPs per sample (train)")


def from_profile(prof, name: str = "model") -> ModelDesc:
    """A :class:`ModelDesc` from a :class:`whale.frontend.profile.ModelProfile` (per-unit costs in forward
    order); the work outside every unit (the loss, the root's own ops) joins the last layer. Units holding no
    parameters are kind ``"other"``; the rest ``"dense"`` (a real module's split is decided by its annotation,
    not here)."""
    units = list(prof.units)
    out = []
    for i, u in enumerate(units):
        extra = prof.rest if i == len(units) - 1 else None
        flops = u.train_flops + (extra.train_flops if extra else 0.0)
        fwd = u.forward_flops + (extra.forward_flops if extra else 0.0)
        params = (u.param_bytes + (extra.param_bytes if extra else 0)) // 4
        act = u.activation_bytes + (extra.activation_bytes if extra else 0.0)
        kind = "dense" if u.param_bytes else "other"
        out.append(LayerDesc(u.name, float(flops), int(params), float(act), float(u.output_bytes), kind,
                             forward_flops=float(fwd)))
    return ModelDesc(tuple(out), name)


def transformer(n_layer: int, d_model: int, seq: int, vocab: int, d_ff: int | None = None, experts: int = 0,
                top_k: int = 1, moe_every: int = 1, name: str = "transformer", act_bytes: int = 2,
                heads: int = 0, capacity_factor: float = 1.0) -> ModelDesc:
    """Analytic description of a decoder transformer (GPT-style; MoE FFNs when ``experts > 0``), per sample
    of ``seq`` tokens.

    FLOPs (Kaplan et al. 2020; Narayanan et al. 2021, eq. 3): a matmul of an [seq, a] input by an [a, b]
    weight costs 2·seq·a·b forward, twice that backward; attention scores and values add 4·seq²·d forward.
    Attention: 4d² parameters; FFN: 2·d·d_ff (each expert of an MoE FFN the same, plus a d x E gate); a token
    computes ``top_k`` experts. Activations saved per layer (Korthikanti et al. 2022, no sequence
    parallelism, ``act_bytes`` per element, 16-bit by default): attention ~ seq·d·(11 + 5·heads·seq/d)
    bytes at 2 bytes, simplified here to 12·seq·d + 2·seq² elements; FFN 2·seq·d + 2·seq·d_ff elements.

    ``heads`` (0: unknown) joins the attention layers' ``split_dims`` beside ``d_model``; the FFN's are its
    width, so a split degree must divide them. ``capacity_factor`` (MoE, >= 1): each expert computes and keeps
    activations for ``capacity_factor`` times its even share of the tokens (padded slots cost as real ones),
    and the all-to-all carries as many slots.

    Raises:
        ModelDescError: a size < 1.
    """
    if min(n_layer, d_model, seq, vocab) < 1:
        raise ModelDescError(f"sizes must be >= 1, got n_layer={n_layer}, d_model={d_model}, seq={seq}, "
                             f"vocab={vocab}")
    ff = d_ff or 4 * d_model
    out_b = float(seq * d_model * act_bytes)
    layers = [LayerDesc("embed", 6.0 * seq * d_model, vocab * d_model + seq * d_model, out_b, out_b, "other")]
    for i in range(n_layer):
        att_f = 3 * (2 * seq * 4 * d_model * d_model + 4 * seq * seq * d_model)
        layers.append(LayerDesc(f"h.{i}.attn", float(att_f), 4 * d_model * d_model,
                                float((12 * seq * d_model + 2 * seq * seq) * act_bytes), out_b, "attention",
                                split_dims=(d_model,) + ((heads,) if heads else ())))
        ffn_p = 2 * d_model * ff
        ffn_act = float((2 * seq * d_model + 2 * seq * ff) * act_bytes)
        if experts and i % moe_every == moe_every - 1:
            cf = capacity_factor * top_k
            layers.append(LayerDesc(f"h.{i}.moe", float(3 * 2 * seq * ffn_p * cf),
                                    experts * ffn_p + d_model * experts, ffn_act * cf, out_b, "moe", experts,
                                    top_k, experts * ffn_p, capacity_factor=capacity_factor))
        else:
            layers.append(LayerDesc(f"h.{i}.mlp", float(3 * 2 * seq * ffn_p), ffn_p, ffn_act, out_b, "dense",
                                    split_dims=(ff,)))
    head_f = 3 * 2 * seq * d_model * vocab
    layers.append(LayerDesc("head", float(head_f), 0, float(seq * vocab * 4), float(seq * vocab * 4), "other"))
    return ModelDesc(tuple(layers), name)
