"""The shape of a GPT-style decoder transformer, its parameter count and FLOPs, and the ``gpt:k=v,...`` text
form the command line takes (issue 28).

Sources: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC'21: parameters P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) and FLOPs per iteration (eq. 3, with full
activation recomputation, i.e. four passes through every transformer layer and three through the LM head)
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from whale.planner.model_desc import LayerDesc, ModelDesc, ModelDescError


@dataclass(frozen=True)
class GPTShape:
    """A decoder transformer: ``layers`` blocks of width ``hidden`` with ``heads`` attention heads
    (``kv_heads`` key/value heads, = heads unless grouped-query), FFN width ``ffn`` (4·hidden by default),
    ``seq`` tokens per sample, ``vocab`` tokens in the (tied) embedding / LM head.

    Raises:
        ModelDescError: a size < 1, or heads not a multiple of kv_heads, or hidden not a multiple of heads.
    """

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    kv_heads: int = 0
    ffn: int = 0

    def __post_init__(self) -> None:
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelDescError(f"GPT shape: {f.name}={v!r} must be an integer >= 1")
        if self.heads % self.kv_heads or self.hidden % self.heads:
            raise ModelDescError(f"GPT shape: heads={self.heads} must be a multiple of kv_heads={self.kv_heads} "
                                 f"and hidden={self.hidden} a multiple of heads; fix the description")

    @property
    def layer_params(self) -> int:
        """Parameter elements of one block: attention 4h² (less with grouped KV) + 4h biases, FFN 2·h·ffn +
        ffn + h biases, two layer norms 4h."""
        h, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        return h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + 2 * h * self.ffn + self.ffn + h + 4 * h

    @property
    def params(self) -> int:
        """Parameter elements: blocks + word and position embeddings (the LM head tied) + final layer norm."""
        return self.layers * self.layer_params + (self.vocab + self.seq) * self.hidden + 2 * self.hidden

    def iteration_flops(self, batch: int) -> float:
        """FLOPs of one training iteration on ``batch`` samples by Narayanan et al. eq. 3 (full recompute)."""
        s, h, lyr, v = self.seq, self.hidden, self.layers, self.vocab
        return 96.0 * batch * s * lyr * h * h * (1 + s / (6 * h) + v / (16 * lyr * h))

    def describe(self) -> str:
        """``gpt:layers=..,hidden=..,...`` (what :func:`parse_gpt` reads back)."""
        return "gpt:" + ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    def model_desc(self, act_bytes: int = 2) -> ModelDesc:
        """The layers as a :class:`~whale.planner.model_desc.ModelDesc`: ``embed`` (kind ``"vocab"``), per block
        ``h.i.attn`` and ``h.i.mlp``, ``head`` (``"vocab"``, the tied projection and the loss). Per sample:
        forward+backward FLOPs (3 x forward; recompute is the estimator's), parameter elements, activation
        bytes (Korthikanti et al. 2022, no parallelism, no recompute: attention 11·s·h + 5·a·s², MLP 19·s·h
        bytes at 16-bit; the head's fp32 logits 4·s·V) and output bytes (s·h at ``act_bytes``)."""
        s, h, a, v = self.seq, self.hidden, self.heads, self.vocab
        kv = h * self.kv_heads // self.heads
        out = float(s * h * act_bytes)
        layers = [LayerDesc("embed", 0.0, (v + s) * h, float(s * h), out, "vocab", forward_flops=0.0, split_dims=(v,))]
        att_f = 2.0 * s * h * (h + 2 * kv) + 4.0 * s * s * h + 2.0 * s * h * h
        att_p = h * (h + 2 * kv) + h * h + (h + 2 * kv) + h + 2 * h
        mlp_p = 2 * h * self.ffn + self.ffn + h + 2 * h
        for i in range(self.layers):
            layers.append(LayerDesc(f"h.{i}.attn", 3 * att_f, att_p, float(11 * s * h + 5 * a * s * s), out,
                                    "attention", forward_flops=att_f, split_dims=(a, self.kv_heads, h)))
            mlp_f = 4.0 * s * h * self.ffn
            layers.append(LayerDesc(f"h.{i}.mlp", 3 * mlp_f, mlp_p, float(19 * s * h), out, "dense",
                                    forward_flops=mlp_f, split_dims=(self.ffn, h)))
        head_f = 2.0 * s * h * v
        layers.append(LayerDesc("head", 3 * head_f, 2 * h, float(4 * s * h + 4 * s * v), out, "vocab",
                                forward_flops=head_f, split_dims=(v,)))
        return ModelDesc(tuple(layers), self.describe())


def parse_gpt(text: str) -> GPTShape:
    """A :class:`GPTShape` from ``"gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200"`` (keys: the
    fields of GPTShape; ``layers``, ``hidden``, ``heads`` required).

    Raises:
        ModelDescError: not of that form, an unknown key or a non-integer value.
    """
    kind, _, rest = text.partition(":")
    if kind.strip().lower() != "gpt" or not rest:
        raise ModelDescError(f"model description {text!r} must look like 'gpt:layers=24,hidden=2304,heads=24'")
    names = {f.name for f in fields(GPTShape)}
    kw: dict[str, int] = {}
    for item in rest.split(","):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in names:
            raise ModelDescError(f"model description {text!r}: {item!r} is not key=value with a key among "
                                 f"{sorted(names)}")
        try:
            kw[key] = int(float(val)) if float(val).is_integer() else int(val)
        except ValueError:
            raise ModelDescError(f"model description {text!r}: {key}={val!r} must be an integer") from None
    missing = {"layers", "hidden", "heads"} - kw.keys()
    if missing:
        raise ModelDescError(f"model description {text!r} lacks {sorted(missing)}")
    return GPTShape(**kw)
