"""Mixed precision: bf16 / fp16 autocast with fp32 master weights, and dynamic loss scaling that is identical
on every rank and stage.

What runs in low precision. Each stage's forward runs under ``torch.autocast(device, dtype)``: matmuls and
convolutions compute in bf16/fp16 from fp32 parameters (autocast casts them per op), so parameters, gradients,
the gradient all-reduce and the optimizer step all stay fp32 ("fp32 master weights": Micikevicius et al. 2018,
"Mixed Precision Training", §3.1). On the last stage the model output's low-precision tensors are cast to fp32
and the loss is computed outside autocast, so the reported loss is fp32 (and never scaled).

Dynamic loss scaling (fp16; Micikevicius et al. 2018, §3.2). fp16 gradients underflow below 2^-24, so the loss
is multiplied by a scale S before backward (on the last stage: the gradients sent back across stage boundaries
carry S too, so every stage's gradients are scaled alike), and every gradient is multiplied by 1/S after the
gradient all-reduce, before clipping and the optimizer step. An inf/NaN gradient means S was too large: the
step is skipped and S *= backoff; after ``growth_interval`` finite steps S *= growth.

Why not one ``torch.amp.GradScaler`` per rank: its found-inf flag is per rank. In a pipeline the overflow
happens in one stage's gradients (and a split shard's in one rank's shard), so that rank would skip its step
and halve its scale while the other stages and shards step and keep theirs: the replicas of the model diverge
(different parameters, then different scales, forever). Here each rank computes its local flag with the same
kernel GradScaler uses (``torch._amp_foreach_non_finite_check_and_unscale_``), the flags are summed over the
whole world in the all-reduce that already sums the step's loss, and every rank applies the same global flag
with GradScaler's update rule (``torch._amp_update_scale_``): the same skip and the same scale everywhere.
The non-finite check's loss flag (:mod:`whale.runtime.nonfinite`) rides on that all-reduce too: a NaN/inf loss
(computed in fp32, unscaled) is no overflow a smaller scale cures, so it follows ``Config(nonfinite)``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.utils import _pytree

from whale.config import LossScale

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """Loss scale, growth tracker and the unscale / update steps of ``torch.amp.GradScaler``, driven by a
    found-inf flag the caller makes global (see the module docstring).

    Args:
        config: the scaling rule (:class:`whale.LossScale`).
        device: where the scale lives (the rank's device).

    Attributes:
        scale: the current loss scale, a float32 tensor of shape [1].
    """

    def __init__(self, config: LossScale, device: torch.device) -> None:
        self.config = config
        self.scale = torch.full((1,), float(config.init_scale), dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)

    def unscale_(self, grads: list[torch.Tensor]) -> float:
        """Multiply ``grads`` (on the scale's device) by 1/scale in place; returns 1.0 when any of them holds an
        inf or NaN (this rank only: the caller sums it over the world), else 0.0. One device sync."""
        found = torch.zeros(1, dtype=torch.float32, device=self.scale.device)
        inv = self.scale.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)  # the kernel takes one dtype a call
        for g in grads:
            by_dtype[g.dtype].append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        return float(found.clamp(max=1.0))

    def update(self, overflow: bool) -> None:
        """Apply GradScaler's rule for a step whose gradients (anywhere) did or did not overflow: backoff and
        reset the tracker, or count a finite step and grow after ``growth_interval`` of them."""
        c = self.config
        found = torch.full((1,), float(overflow), dtype=torch.float32, device=self.scale.device)
        torch._amp_update_scale_(self.scale, self._growth_tracker, found, c.growth_factor, c.backoff_factor,
                                 c.growth_interval)

    def state_dict(self) -> dict:
        """``{"scale": float, "growth_tracker": int}`` (plain data, loads with ``weights_only=True``)."""
        return {"scale": float(self.scale), "growth_tracker": int(self._growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))


class MixedPrecision:
    """One rank's precision policy: the autocast context of the forward, the fp32 cast of the model output
    before the loss, and (fp16) the loss scaler.

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (the plan's).
        device: the rank's device (its type picks autocast's backend: ``"cpu"``, ``"cuda"``).
        loss_scale: fp16's scaling rule.

    Attributes:
        dtype: the autocast dtype, ``None`` for fp32.
        scaler: a :class:`DynamicLossScaler` for fp16, else ``None``.
    """

    def __init__(self, precision: str, device: torch.device, loss_scale: LossScale) -> None:
        self.precision, self.device_type = precision, torch.device(device).type
        self.dtype = DTYPES.get(precision)
        self.scaler = DynamicLossScaler(loss_scale, device) if precision == "fp16" else None

    def autocast(self):
        """The context each stage's forward runs in (a no-op for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def fp32(self, output):
        """``output`` (a tensor, or any pytree of them, e.g. a tuple or a Hugging Face ``ModelOutput``) with
        its bf16/fp16 tensors cast to fp32, so the loss computes in fp32; unchanged for fp32."""
        if self.dtype is None:
            return output

        def cast(t):
            """fp32 copy of a low-precision floating tensor (autograd flows back through the cast)."""
            return t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t
        return _pytree.tree_map(cast, output)  # unregistered types (ShardedLogits: fp32 loss anyway) are leaves

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call backward on: ``loss * scale`` under fp16, ``loss`` otherwise."""
        return loss if self.scaler is None else loss * self.scaler.scale.to(loss.dtype).reshape(())
