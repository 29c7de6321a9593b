"""The end of a training step: gradients applied and the step's loss summed over the world.

A mixin of :class:`whale.runtime.engine.Engine` (kept apart so the engine file stays an outline of a step): it
reads the engine's parts (``grad_sync``, ``optimizer``, ``precision``, ``zero``, ``plan``, ``split``) and
decides nothing the plan does not say. Order matters for collectives: every rank launches its gradient
collectives first (``grad_sync.finish``), then the loss all-reduce (which, under fp16, also carries every
rank's overflow flag), then clipping's norm all-reduce, so every group sees the same order on all its members.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class GradientUpdate:
    """Loss sum, fp16 unscaling, clipping, the optimizer step and zeroing, for :class:`~whale.runtime.engine.
    Engine`."""

    def _fuse_loss(self) -> bool:
        # one stage, no split, no shared groups: the loss rides on the last gradient bucket (the DP group)
        return (self.plan.num_stages == 1 and not self.split.regions and not self.plan.shared_params
                and self.grad_sync.can_carry_extra  # never in a bf16/fp16 bucket: the loss stays fp32
                and self.precision.scaler is None)  # fp16: the loss's all-reduce also carries the overflow flag

    def _arm(self, loss_sum: float) -> None:
        """Right before this rank's last backward: arm gradient sync; the loss rides on the last bucket, or on
        stage 0 of a pipeline (no transfer follows its last backward, and no tied group joins it to another
        stage) its all-reduce starts now, before every bucket on every rank of its stage, hidden by the
        backward."""
        extra = torch.tensor([loss_sum], dtype=torch.float64) if self._fuse_loss() else None
        if self.stage == 0 and self.plan.is_pipeline and not self.plan.shared_params and self.precision.scaler is None:
            self._loss_started = self._start_sum([loss_sum])
        self.grad_sync.arm(extra)

    def _start_sum(self, values: list[float]) -> Callable[[], list[float]]:
        """Start summing ``values`` over the world (float64, asynchronous); the returned call waits for it."""
        if self.world_size == 1:
            return lambda: list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.ctx.device)
        work = dist.all_reduce(t, async_op=True)

        def result() -> list[float]:
            """The sums, once the all-reduce is done."""
            work.wait()
            return t.tolist()
        return result

    def _global_sum(self, values: list[float]) -> list[float]:
        return self._start_sum(values)()

    def _apply_gradients(self, loss_sum: float) -> tuple[float, float | None, bool]:
        """Unscale (fp16), clip and step with this rank's reduced gradients, zero them, and sum the loss over
        the world. Under fp16 the overflow flags of every rank ride on the loss's all-reduce, so every rank
        skips the same steps and keeps the same scale (:mod:`whale.runtime.precision`).

        Returns:
            ``(global loss, gradient norm before clipping or None, whether the step was skipped)``.
        """
        fused, scaler = self._fuse_loss(), self.precision.scaler
        flags = [] if scaler is None else [scaler.unscale_([p.grad for p in self._grad_holders()
                                                            if p.grad is not None])]
        # overlaps clipping and the update (not fp16); stage 0 of a pipeline may have started it in _arm
        total = None if fused else self._loss_started or self._start_sum([loss_sum] + flags)
        self._loss_started = None
        skipped = False
        if scaler is not None:
            loss, overflows = total()
            skipped = overflows > 0
            scaler.update(skipped)
        norm = self._clip() if self.ctx.config.max_grad_norm and not skipped else None
        if not skipped:
            (self.offload.step if self.offload is not None else self.optimizer.step)()  # offload: on the host
            if self.zero is not None:
                self.zero.gather()  # every lane's updated slices to every lane
        self._zero_grad()
        if scaler is None:
            (loss,) = [float(self.grad_sync.extra[0])] if fused else total()
        return loss, norm, skipped

    def _grad_holders(self) -> list:
        """The tensors whose ``.grad`` unscaling and clipping scale: this rank's parameters, and under ZeRO-2
        its slices (their gradients are no views of the parameters' there: :mod:`whale.parallel.zero`)."""
        params = list(self.module.parameters())
        return self.zero.clip_targets(params) if self.zero is not None else params

    def _zero_grad(self) -> None:
        """Zero the bucketed gradients in place; drop the others (not reduced, e.g. world size 1)."""
        self.grad_sync.zero_grad()
        for p in self._unbucketed:
            p.grad = None

    def _clip(self) -> float:
        """Clip the global gradient norm to ``config.max_grad_norm``; returns the norm before clipping."""
        grads = [p.grad.detach().float() for p in self._norm_owner if p.grad is not None]
        sq = float(torch.stack([g.pow(2).sum() for g in grads]).sum()) if grads else 0.0  # one device sync
        (total,) = self._global_sum([sq])
        norm = total ** 0.5
        coef = self.ctx.config.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self._grad_holders():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm
