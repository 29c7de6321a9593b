"""Compute time per unit from FLOPs and bytes by a roofline per device type (issue 28, part 1).

Every kernel of a transformer layer takes max(FLOPs / (peak x efficiency), bytes / memory bandwidth) plus a
launch cost (Williams et al., "Roofline", CACM 2009): matrix products are bound by the tensor-core peak at the
device type's one calibrated GEMM efficiency, unless their arithmetic intensity is below the ridge (the
attention score and context products of narrow heads are); layer norms, softmax, dropout, GeLU and the
residual adds are bound by memory bandwidth. This is what makes small models slower per FLOP than large ones
with one efficiency per device type: their attention and element-wise work is a larger share of their time.

Kernels of one layer's forward on one device of a tensor-parallel group of t (16-bit activations, 1-byte
dropout masks; s tokens, b samples, h hidden, a heads, f FFN width; Megatron-LM's fused kernels):

- GEMMs: QKV [s·b, h] x [h, 3h/t], scores and context (b·a/t batched [s, h/a] x [h/a, s] and back),
  projection [s·b, h/t] x [h/t, h], FFN [s·b, h] x [h, f/t] and [s·b, f/t] x [f/t, h]; bytes: inputs and
  output once;
- memory-bound: two layer norms (read and write s·b·h, not split without sequence parallelism), two fused
  bias-dropout-adds (7 bytes per element of s·b·h), fused scale-mask-softmax and dropout of the scores
  (4 + 5 bytes per element of a·s²·b/t), fused bias-GeLU (4 bytes per element of s·b·f/t).

Backward: twice the forward's GEMM FLOPs (two products per forward product) and twice its element-wise bytes;
of it, the weight-gradient products (one per forward product with a weight) are ``PassSeconds.weight``.
LM head: the [s·b, h] x [h, V/t] product and the fp32 cross-entropy (12 bytes per logit forward, 8 backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from whale.cluster import DeviceType


@dataclass(frozen=True)
class Roofline:
    """One device type's roofline: ``peak`` FLOP/s (16-bit tensor cores), ``bandwidth`` bytes/s of device
    memory, ``gemm_efficiency`` (achieved fraction of peak of a large GEMM, calibrated per device type) and
    ``launch`` seconds per kernel.

    Raises:
        ValueError: a non-positive peak, bandwidth or efficiency, or an efficiency > 1.
    """

    name: str
    peak: float
    bandwidth: float
    gemm_efficiency: float = 0.8
    launch: float = 5e-6

    def __post_init__(self) -> None:
        if not (self.peak > 0 and self.bandwidth > 0 and 0 < self.gemm_efficiency <= 1 and self.launch >= 0):
            raise ValueError(f"roofline {self.name!r}: need peak > 0, bandwidth > 0, 0 < gemm_efficiency <= 1, "
                             f"launch >= 0; got {self.peak}, {self.bandwidth}, {self.gemm_efficiency}, {self.launch}")

    @classmethod
    def of(cls, device: DeviceType, gemm_efficiency: float = 0.8, launch: float = 5e-6) -> Roofline:
        """The roofline of a catalog device type (its 16-bit peak and memory bandwidth)."""
        return cls(device.name, device.flops("bf16"), device.mem_bandwidth, gemm_efficiency, launch)

    def kernel(self, flops: float, nbytes: float) -> float:
        """Seconds of one kernel of ``flops`` FLOPs moving ``nbytes`` bytes."""
        return max(flops / (self.peak * self.gemm_efficiency), nbytes / self.bandwidth) + self.launch

    def gemm(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of ``batch`` products [m, k] x [k, n] in 16-bit (2·m·n·k FLOPs each)."""
        return self.kernel(2.0 * batch * m * n * k, 2.0 * batch * (m * k + k * n + m * n))


@dataclass(frozen=True)
class PassSeconds:
    """Forward and backward seconds of one micro-batch through one unit on one device; ``weight``: the part of
    ``backward`` that computes weight gradients (the products with a weight operand: what a zero-bubble W pass
    computes, the rest being the input-gradient chain)."""

    forward: float
    backward: float
    weight: float = 0.0


def attention_seconds(roof: Roofline, s: int, b: int, h: int, a: int, t: int = 1,
                      sequence_parallel: bool = False) -> PassSeconds:
    """The attention half of a transformer layer (layer norm, QKV, scores, softmax + dropout, context,
    projection, bias-dropout-add) for a micro-batch of ``b`` samples on one device of a tensor group of ``t``.

    Raises:
        ValueError: ``t`` does not divide ``a``.
    """
    if a % t:
        raise ValueError(f"split degree {t} must divide heads={a}; choose a divisor of {a}")
    sb, d, ht = float(s) * b, h / a, a // t
    whole = sb * h / (t if sequence_parallel else 1)  # layer norm, residual add: whole on every device
    gemm = roof.gemm(sb, 3 * h / t, h) + roof.gemm(s, s, d, b * ht) + roof.gemm(s, d, s, b * ht) + \
        roof.gemm(sb, h, h / t)
    elem = roof.kernel(0.0, 4 * whole) + roof.kernel(0.0, 7 * whole) + roof.kernel(0.0, 9.0 * ht * s * s * b)
    weights = roof.gemm(sb, 3 * h / t, h) + roof.gemm(sb, h, h / t)  # QKV, projection (scores/context: none)
    return PassSeconds(gemm + elem, 2 * gemm + 2 * elem, weights)


def ffn_seconds(roof: Roofline, s: int, b: int, h: int, f: int, t: int = 1,
                sequence_parallel: bool = False) -> PassSeconds:
    """The FFN half (layer norm, [h, f/t] and [f/t, h] products, bias-GeLU, bias-dropout-add).

    Raises:
        ValueError: ``t`` does not divide ``f``.
    """
    if f % t:
        raise ValueError(f"split degree {t} must divide ffn={f}; choose a divisor of {f}")
    sb = float(s) * b
    whole = sb * h / (t if sequence_parallel else 1)
    gemm = roof.gemm(sb, f / t, h) + roof.gemm(sb, h, f / t)
    elem = roof.kernel(0.0, 4 * whole) + roof.kernel(0.0, 7 * whole) + roof.kernel(0.0, 4 * sb * f / t)
    return PassSeconds(gemm + elem, 2 * gemm + 2 * elem, gemm)


def head_seconds(roof: Roofline, s: int, b: int, h: int, vocab: int, t: int = 1,
                 vocab_parallel: bool = True) -> PassSeconds:
    """The final layer norm, LM head projection and cross-entropy of one micro-batch on one device (vocab
    split over ``t`` when ``vocab_parallel``)."""
    sb, v = float(s) * b, vocab / (t if vocab_parallel else 1)
    proj = roof.gemm(sb, v, h)
    ln = roof.kernel(0.0, 4 * sb * h)
    return PassSeconds(proj + ln + roof.kernel(0.0, 12 * sb * v), 2 * proj + 2 * ln + roof.kernel(0.0, 8 * sb * v),
                       proj)


def embedding_seconds(roof: Roofline, s: int, b: int, h: int, vocab: int, t: int = 1) -> PassSeconds:
    """Word + position embedding lookup, add and dropout of one micro-batch (forward: read rows, write s·b·h;
    backward: the gradient scattered into the device's [V/t, h] table, which is zeroed once per step
    elsewhere)."""
    sb = float(s) * b
    return PassSeconds(roof.kernel(0.0, 9 * sb * h), roof.kernel(0.0, 9 * sb * h), roof.kernel(0.0, 9 * sb * h))

