"""The end of a training step: gradients applied and the step's loss summed over the world.

A mixin of :class:`whale.runtime.engine.Engine` (kept apart so the engine file stays an outline of a step): it
reads the engine's parts (``grad_sync``, ``optimizer``, ``precision``, ``zero``, ``plan``, ``split``) and
decides nothing the plan does not say. Order matters for collectives: every rank launches its gradient
collectives first (``grad_sync.finish``), then the loss all-reduce (which, under fp16, also carries every
rank's overflow flag), then clipping's norm all-reduce, so every group sees the same order on all its members.
Before any update every rank checks its losses and gradients for NaN/inf (:mod:`whale.runtime.nonfinite`); the
flag rides on one of those all-reduces (the rule, the same on every rank, is in :meth:`_apply_gradients`). In a
plain pipeline (:meth:`_flag_early`) stage 0, whose last backward ends the step, decides without waiting for
anyone: the other ranks' flags arrive on the loss all-reduce during that backward (:meth:`_apply_early`).
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

    def _loss_early(self) -> bool:
        """Whether pipeline stage 0 starts the loss all-reduce in its last backward (the same on every rank)."""
        return self.plan.is_pipeline and not self.plan.shared_params and self.precision.scaler is None

    def _flag_early(self) -> bool:
        """Whether stage 0 decides the step's NaN/inf check alone (:meth:`_apply_early`; the same on every rank):
        :meth:`_loss_early`, no clipping (its norm all-reduce carries the flag), no ZeRO, and every stage one
        device wide with no split region or expert layer in any stage (read from the plan, never from this rank's
        stage: every rank takes the same route), so every rank of stage 0 holds the same reduced gradients and
        checks all of them."""
        plan = self.plan
        return (self._loss_early() and not self.ctx.config.max_grad_norm and not plan.zero
                and all(w == 1 for w in plan.stage_widths) and not plan.moe_layers
                and not any(plan.split_targets(s) for s in range(plan.num_stages)))

    def _arm(self, loss_sum: float) -> None:
        """Right before this rank's last backward: arm gradient sync; the loss rides on the last bucket, or on
        stage 0 of a pipeline (no transfer follows its last backward, and no tied group joins it to another
        stage) its all-reduce starts now, before every bucket on every rank of its stage, hidden by the
        backward."""
        extra = torch.tensor([loss_sum], dtype=torch.float64) if self._fuse_loss() else None
        if self.stage == 0 and self._loss_early():  # _flag_early: this rank's losses are all computed by now
            self._loss_started = self._start_sum([loss_sum] + ([self.nonfinite.local([])] if self._flag_early()
                                                              else []))
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
        if self._flag_early():
            return self._apply_early(loss_sum)
        fused, scaler, clip = self._fuse_loss(), self.precision.scaler, self.ctx.config.max_grad_norm
        same = fused and self.plan.zero < 2  # every rank holds the whole reduced gradients and the global loss
        checked = [] if scaler is not None else list(self.module.parameters()) if same else self._norm_owner
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
        if skipped:  # the rare path: every rank names the first non-finite tensor, then raises or skips
            if not (ride or fused):
                loss = total()[0]  # no collective left pending
            try:
                self.nonfinite.act(checked, self.steps_done)
            finally:
                self._zero_grad()  # also when raising: the next step starts clean
        if scaler is not None:
            skipped = skipped or flags[0] > 0
            scaler.update(flags[0] > 0)
        if clip and not skipped:
            norm = self._clip(norm if norm is not None else self._global_norm()[0])
        if not skipped:
            (self.offload.step if self.offload is not None else self.optimizer.step)()  # offload: on the host
            if self.zero is not None:
                self.zero.gather()  # every lane's updated slices to every lane
        self._zero_grad()
        if loss is None:
            (loss,) = [float(self.grad_sync.extra[0])] if fused else total()
        return loss, norm, skipped

    def _apply_early(self, loss_sum: float) -> tuple[float, None, bool]:
        """:meth:`_apply_gradients` of a plain pipeline (:meth:`_flag_early`), with no round trip after stage 0's
        last backward, which ends the step. Every other rank joins the loss all-reduce after its own last backward
        with its NaN/inf flag on it (stage 0 started it before that backward, with its losses' flag), so the sum
        has arrived when stage 0's backward ends: stage 0 adds its gradients' flag and decides. Its flag follows
        to the others in a second all-reduce that stage 0 starts and waits for only after its optimizer step (the
        others wait, while stage 0 steps and starts the next forward). Every rank sums the same flags: the same
        decision, before any optimizer step."""
        if self.stage == 0:
            checked = list(self.module.parameters())  # the same reduced gradients on every lane of stage 0
            own = self.nonfinite.local(checked)
            started = self._loss_started or self._start_sum([loss_sum, self.nonfinite.local([])])
            loss, others = started()
            self._loss_started = None
            told = self._start_sum([own])
            skipped = own + others > 0
        else:
            checked = self._norm_owner
            loss, _ = found = self._start_sum([loss_sum, self.nonfinite.local(checked)])()
            told = self._start_sum([0.0])
            skipped = found[1] + told()[0] > 0
        if skipped:  # the rare path, as in _apply_gradients
            told()
            try:
                self.nonfinite.act(checked, self.steps_done)
            finally:
                self._zero_grad()
        else:
            (self.offload.step if self.offload is not None else self.optimizer.step)()
        self._zero_grad()
        told()
        return loss, None, skipped

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
