"""Memory accounting of real transformers: activations per layer by Korthikanti et al. 2022 and model state by
precision and ZeRO stage (issue 28, part 2).

Activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
Table 2; 16-bit activations, 1-byte dropout masks; s sequence, b micro-batch, h hidden, a heads, t tensor
parallel degree), bytes per transformer layer:

=====================================  ==========================================
no parallelism, no recompute           s·b·h·(34 + 5·a·s/h)
tensor parallel                        s·b·h·(10 + 24/t + 5·a·s/(h·t))
tensor + sequence parallel             s·b·h·(34/t + 5·a·s/(h·t))
tensor parallel + selective recompute  s·b·h·(10 + 24/t)
tensor + sequence + selective          s·b·h·34/t
full recompute                         2·s·b·h (the layer's input; /t with sequence parallel)
=====================================  ==========================================

Under full recompute the layer being recomputed holds its whole (no-recompute) activations once, on top of the
checkpoints. Embedding: its dropout mask, s·b·h bytes (/t with sequence parallel). LM head (§4.3): the final
layer norm's and the projection's 16-bit inputs, 4·s·b·h (/t with sequence parallel), and the fp32 logits of
the vocab-parallel cross-entropy, 4·s·b·V/t (4·s·b·V when the head is not split).

Model state per parameter element (mixed-precision Adam, Micikevicius et al. 2018 / Rajbhandari et al. 2020):
16-bit weights 2, gradients 2 (4 with fp32 gradient accumulation), fp32 master weights 4, Adam moments 4 + 4:
16 bytes per element (18 with fp32 gradients). fp32 training: 4 + 4 + 8 = 16. ZeRO stage 1 divides the
optimizer state (master weights and moments) by the data-parallel degree, stage 2 also the gradients, stage 3
also the weights. The planner's totals multiply by :data:`ALLOCATOR_OVERHEAD`.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
"""Activation recompute modes: none, selective (attention scores and softmax recomputed), full (each layer)."""
PRECISIONS = ("mixed", "fp32")
"""Training precisions the model-state accounting knows."""
ALLOCATOR_OVERHEAD = 1.10
"""Reserved over allocated bytes of PyTorch's caching allocator (fragmentation), a stated planning factor: the
planner's memory check multiplies every predicted total by it (not measured here)."""


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch of ``b`` samples of ``s`` tokens
    (the module docstring's table).

    Raises:
        ValueError: a size < 1 or an unknown ``recompute``.
    """
    if min(s, b, h, a, t) < 1 or recompute not in RECOMPUTE:
        raise ValueError(f"need sizes >= 1 and recompute in {RECOMPUTE}; got s={s}, b={b}, h={h}, a={a}, t={t}, "
                         f"recompute={recompute!r}")
    sbh = float(s) * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    scores = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    split = 34.0 / t if sequence_parallel else 10.0 + 24.0 / t
    return sbh * (split + scores)


def embedding_activation_bytes(s: int, b: int, h: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes the input embedding keeps for backward: its dropout mask, s·b·h (/t with sequence parallel)."""
    return float(s) * b * h / (t if sequence_parallel else 1)


def head_activation_bytes(s: int, b: int, h: int, vocab: int, t: int = 1, sequence_parallel: bool = False,
                          vocab_parallel: bool = True) -> float:
    """Bytes the final layer norm, LM head and loss keep: 4·s·b·h of 16-bit inputs (/t with sequence parallel)
    + 4·s·b·V of fp32 logits (/t when the head is vocab-parallel)."""
    return 4.0 * s * b * h / (t if sequence_parallel else 1) + 4.0 * s * b * vocab / (t if vocab_parallel else 1)


@dataclass(frozen=True)
class ModelState:
    """Bytes of one device's model state: ``weights``, ``gradients``, ``optimizer`` (fp32 master + moments)."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        """Sum, bytes."""
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(elements: float, precision: str = "mixed", zero_stage: int = 0, dp: int = 1,
                      fp32_grads: bool = False) -> ModelState:
    """Model-state bytes of ``elements`` parameter elements on one device (the module docstring's rules).

    Raises:
        ValueError: an unknown precision, a ZeRO stage outside 0..3, dp < 1 or negative elements.
    """
    if precision not in PRECISIONS or zero_stage not in (0, 1, 2, 3) or dp < 1 or elements < 0:
        raise ValueError(f"need precision in {PRECISIONS}, zero_stage 0..3, dp >= 1, elements >= 0; got "
                         f"{precision!r}, {zero_stage}, {dp}, {elements}")
    w, g, o = (2.0, 4.0 if fp32_grads else 2.0, 12.0) if precision == "mixed" else (4.0, 4.0, 8.0)
    return ModelState(elements * w / (dp if zero_stage >= 3 else 1), elements * g / (dp if zero_stage >= 2 else 1),
                      elements * o / (dp if zero_stage >= 1 else 1))


def in_flight_layers(stage: int, stages: int, micro_batches: int, layers_per_stage: int,
                     virtual: int = 1) -> float:
    """Layer-activations (one layer of one micro-batch each) that pipeline stage ``stage`` holds at its peak
    under 1F1B (``virtual`` = 1: min(p - s, m) micro-batches of its layers) or Megatron-LM's interleaved 1F1B
    (v chunks of l/(p·v) layers: (p - s - 1)·2 + (v - 1)·p warm-up chunks + 1, at most m·v).

    Raises:
        ValueError: stage outside [0, stages) or a count < 1.
    """
    if not 0 <= stage < stages or min(micro_batches, layers_per_stage, virtual) < 1:
        raise ValueError(f"need 0 <= stage < stages and counts >= 1; got stage={stage}, stages={stages}, "
                         f"micro_batches={micro_batches}, layers_per_stage={layers_per_stage}, virtual={virtual}")
    if virtual == 1:
        return float(min(stages - stage, micro_batches) * layers_per_stage)
    chunks = min((stages - stage - 1) * 2 + (virtual - 1) * stages + 1, micro_batches * virtual)
    return chunks * layers_per_stage / virtual


@dataclass(frozen=True)
class StagePeak:
    """Peak bytes of one device of a pipeline stage by category, and their sum (before the allocator factor)."""

    state: ModelState
    activations: float
    working: float

    @property
    def total(self) -> float:
        """Model state + activations held + the working set of the layer in backward, bytes."""
        return self.state.total + self.activations + self.working


def stage_peak(s: int, b: int, h: int, a: int, vocab: int, elements: float, layers: int, held_layers: float,
               in_flight: int, first: bool, last: bool, t: int = 1, sequence_parallel: bool = False,
               recompute: str = "full", vocab_parallel: bool = True, precision: str = "mixed",
               zero_stage: int = 0, dp: int = 1, fp32_grads: bool = False) -> StagePeak:
    """Peak bytes of one device of a stage of ``layers`` transformer layers holding ``held_layers``
    layer-activations (:func:`in_flight_layers`) of micro-batches of ``b`` samples and ``elements`` parameter
    elements (its shard), ``in_flight`` micro-batches (for the embedding's masks); ``first``/``last``: it holds
    the embedding / the head. Under full recompute the layer in backward holds its whole activations once.

    Raises:
        ValueError: as :func:`layer_activation_bytes` and :func:`model_state_bytes`.
    """
    act = held_layers * layer_activation_bytes(s, b, h, a, t, sequence_parallel, recompute) if layers else 0.0
    if first:
        act += in_flight * embedding_activation_bytes(s, b, h, t, sequence_parallel)
    work = layer_activation_bytes(s, b, h, a, t, sequence_parallel, "none") if recompute == "full" and layers else 0.0
    if last:
        work += head_activation_bytes(s, b, h, vocab, t, sequence_parallel, vocab_parallel)
    return StagePeak(model_state_bytes(elements, precision, zero_stage, dp, fp32_grads), act, work)
