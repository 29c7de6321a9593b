"""The end of a training step: gradients applied and the step's loss summed over the world.

A mixin of :class:`whale.runtime.engine.Engine` (kept apart so the engine file stays an outline of a step): it
reads the engine's parts (``grad_sync``, ``optimizer``, ``precision``, ``zero``, ``plan``, ``split``) and
decides nothing the plan does not say. Order matters for collectives: every rank launches its gradient
collectives first (``grad_sync.finish``), then the loss all-reduce (which, under fp16, also carries every
rank's overflow flag), then clipping's norm all-reduce, so every group sees the same order on all its members.
Before any update every rank checks its losses and gradients for NaN/inf (:mod:`whale.runtime.nonfinite`); the
flag rides on one of those all-reduces (the rule, the same on every rank, is in :meth:`_apply_gradients`).
"""

from __future__ import annotations

import functools
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

    def _loss_early(self) -> bool:
        """Whether pipeline stage 0 starts the loss all-reduce before its last backward, while it waits for that
        backward's output gradients (the same on every rank)."""
        return self.plan.is_pipeline and not self.plan.shared_params and self.precision.scaler is None

    @functools.cached_property
    def _own_params(self) -> list:
        """This rank's parameters (its stage module's, fixed for the engine's life)."""
        return list(self.module.parameters())

    def _arm(self, loss_sum: float) -> None:
        """Right before this rank's last backward (in a pipeline before it waits for its output gradients, every
        forward done): arm gradient sync; the loss rides on the last bucket, or on stage 0 of a pipeline (no
        transfer follows its last backward, and no tied group joins it to another stage) its all-reduce starts
        now, in stage 0's idle time, before every bucket on every rank of its stage."""
        extra = torch.tensor([loss_sum], dtype=torch.float64) if self._fuse_loss() else None
        if self.stage == 0 and self._loss_early():
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
        """Check (:mod:`whale.runtime.nonfinite`), unscale (fp16), clip and step with this rank's reduced
        gradients, zero them, and sum the loss over the world. Under fp16 the overflow flags of every rank ride
        on the loss's all-reduce, so every rank skips the same steps and keeps the same scale
        (:mod:`whale.runtime.precision`); the non-finite flag rides on it too, or on clipping's.

        Returns:
            ``(global loss, gradient norm before clipping or None, whether the step was skipped)``.

        Raises:
            NonFiniteError, LossShapeError: on every rank, before the optimizer step.
        """
        fused, scaler, clip = self._fuse_loss(), self.precision.scaler, self.ctx.config.max_grad_norm
        same = fused and self.plan.zero < 2  # every rank holds the whole reduced gradients and the global loss
        checked = [] if scaler is not None else self._own_params if same else self._norm_owner
        flags = [] if scaler is None else [scaler.unscale_([p.grad for p in self._grad_holders()
                                                            if p.grad is not None])]
        flags.append(self.nonfinite.local(checked, float(self.grad_sync.extra[0]) if same else None))
        ride = scaler is not None or not (same or clip or fused or self._loss_early())  # on the loss all-reduce
        # overlaps clipping and the update unless it carries the flags; stage 0 of a pipeline may have started it
        total = None if fused else self._loss_started or self._start_sum([loss_sum] + (flags if ride else []))
        self._loss_started = None
        loss, norm = None, None
        if ride:
            loss, *flags = total()
        elif clip:
            norm, flags[-1] = self._global_norm(flags[-1])
        elif not same:
            flags[-1:] = self._global_sum(flags[-1:])
        skipped = flags[-1] > 0
        if skipped:
            if not (ride or fused):
                loss = total()[0]  # no collective left pending
            self._act(checked)
        if scaler is not None:
            skipped = skipped or flags[0] > 0
            scaler.update(flags[0] > 0)
        if clip and not skipped:
            norm = self._clip(norm if norm is not None else self._global_norm()[0])
        self._step_unless(skipped)
        if loss is None:
            (loss,) = [float(self.grad_sync.extra[0])] if fused else total()
        return loss, norm, skipped

    def _act(self, checked: list) -> None:
        """The rare path, on every rank alike: name the first non-finite tensor over the world, then raise or
        skip (:meth:`whale.runtime.nonfinite.NonFiniteGuard.act`); the gradients are zeroed either way (also when
        raising: the next step starts clean)."""
        try:
            self.nonfinite.act(checked, self.steps_done)
        finally:
            self._zero_grad()

    def _step_unless(self, skipped: bool) -> None:
        """The optimizer step (under offload on the host; under ZeRO every lane's updated slices then gathered
        to every lane) unless ``skipped``, then the gradients zeroed."""
        if not skipped:
            (self.offload.step if self.offload is not None else self.optimizer.step)()
            if self.zero is not None:
                self.zero.gather()
        self._zero_grad()

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

    def _global_norm(self, flag: float | None = None) -> tuple[float, float | None]:
        """The global gradient norm (every distinct gradient element once over the world), and ``flag`` (when
        given) summed over the world in the same all-reduce."""
        grads = [p.grad.detach().float() for p in self._norm_owner if p.grad is not None]
        sq = float(torch.stack([g.pow(2).sum() for g in grads]).sum()) if grads else 0.0  # one device sync
        total, *flags = self._global_sum([sq] + ([] if flag is None else [flag]))
        return total ** 0.5, flags[0] if flags else None

    def _clip(self, norm: float) -> float:
        """Clip the gradients to global norm ``config.max_grad_norm`` given their global ``norm``; returns it."""
        coef = self.ctx.config.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self._grad_holders():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm
