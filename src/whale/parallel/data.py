"""replicate -> data parallelism: bucketed gradient all-reduce, overlapped with the last backward.

Exact weighting with uneven batch shares: every rank scales its micro-batch loss by ``rows / global_batch``
(the runtime does this), so summing gradients across ranks (``ReduceOp.SUM``) yields exactly the gradient of
the mean loss over the global batch: a rank holding b_i of B samples contributes b_i / B of the average. No
division by the world size happens here.

Buckets are filled in reverse parameter order (roughly the order backward produces gradients) up to
``bucket_cap_mb``; a bucket's all-reduce starts as soon as it and every earlier bucket are complete, so every
rank of a group launches its collectives in the same order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class _Bucket:
    """One flat buffer: every parameter's gradient, then one "used" flag per parameter, then (last bucket only)
    the loss slot."""

    params: list[torch.nn.Parameter]
    group: object
    buf: torch.Tensor
    offsets: list[int]
    grad_numel: int
    ready: set[int] = field(default_factory=set)
    needed: int = 0
    work: object = None

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's slice of the buffer, shaped like the parameter."""
        p = self.params[i]
        return self.buf[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    @property
    def flags(self) -> torch.Tensor:
        """One element per parameter: 1 where this rank computed a gradient for it this step; after the
        all-reduce, how many ranks did."""
        return self.buf[self.grad_numel: self.grad_numel + len(self.params)]

    def owns(self, i: int, grad: torch.Tensor) -> bool:
        """True when ``grad`` is parameter i's slice of this bucket."""
        return grad.data_ptr() == self.buf.data_ptr() + self.offsets[i] * self.buf.element_size()

    def attach(self) -> None:
        """Make every parameter's ``.grad`` its slice of the bucket. No other reference to the views is kept:
        autograd accumulates in place only into a gradient nobody else holds."""
        for i, p in enumerate(self.params):
            p.grad = self.view(i)


def _make_bucket(params: list[torch.nn.Parameter], group, loss_slot: bool) -> _Bucket:
    """A persistent flat buffer for ``params`` whose slices are the parameters' ``.grad`` (backward accumulates
    straight into the bucket), followed by the used flags and, with ``loss_slot``, one spare element."""
    p0 = params[0]
    offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    grad_numel = sum(p.numel() for p in params)
    buf = torch.zeros(grad_numel + len(params) + int(loss_slot), dtype=p0.dtype, device=p0.device)
    bucket = _Bucket(params, group, buf, offsets, grad_numel)
    bucket.attach()
    return bucket


class GradSync:
    """Sums gradients of parameter sets over their process groups, with one-process semantics for parameters
    that get no gradient.

    Gradients live in persistent flat bucket buffers (each parameter's ``.grad`` is a view of its bucket, as
    DDP's ``gradient_as_bucket_view``), so backward accumulates into the bucket and the all-reduce runs in
    place: no copies and no allocation per step. :meth:`zero_grad` zeroes the buckets (use it instead of the
    optimizer's ``zero_grad(set_to_none=True)``; a gradient replaced by other code is copied back in).

    Parameters that get no gradient. Every bucket carries one flag per parameter (1 where this rank's backward
    produced a gradient for it during the step), summed by the same all-reduce. A parameter no rank used
    (a layer skipped this step, a layer never called, a frozen parameter) ends the step with ``.grad = None``,
    so the optimizer leaves it alone exactly as in one process (AdamW does not decay it); one used on some
    ranks only gets the sum of the gradients that exist (the others contribute zeros). Frozen parameters are
    bucketed too, so unfreezing one later (gradual unfreezing) reduces its gradients like any other:
    :meth:`start_step` hooks parameters that require grad since the last step. Like DDP's
    ``find_unused_parameters``, at the price of ``len(params)`` extra elements per bucket (a bucket whose
    parameters are not all used in the last micro-batch is reduced after backward instead of during it).

    Args:
        param_groups: ``[(group, params), ...]``; ``group`` is a ``ProcessGroup`` or ``None`` (no reduction,
            e.g. a group of one rank). Each parameter appears in exactly one entry.
        bucket_cap_mb: bucket size in MiB (2**20 bytes); the first bucket of each group is capped at
            ``first_bucket_mb`` so that communication starts early in backward (as DDP does).
        first_bucket_mb: cap of each group's first bucket, MiB.

    Attributes:
        scheduler: ``None``, or an object with ``defer(fn)`` and ``flush()`` that starts each bucket's all-reduce
            later (emulation: at the emulated time its gradients are ready,
            :class:`whale.runtime.emulation.EmulatedDevice`); launch order is kept.
        bytes_reduced: gradient bytes handed to all-reduce so far (flags and the loss riding along excluded).
        flag_bytes: bytes of used flags handed to all-reduce so far.

    Usage per step: ``start_step()`` before the first backward, ``arm()`` before the last backward, then
    ``finish()`` after it, ``zero_grad()`` after the optimizer step. ``arm(extra)`` puts one float in the spare
    slot of the last bucket, summed over that bucket's group for free (the step's loss; only when that
    bucket is fp32 or fp64, so the sum keeps its precision: see :attr:`can_carry_extra`).
    """

    def __init__(self, param_groups: list[tuple[object, list[torch.nn.Parameter]]], bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0) -> None:
        plans: list[tuple[object, list[torch.nn.Parameter]]] = []
        for group, params in param_groups:
            if group is not None:
                plans += self._fill(group, list(reversed(params)), int(bucket_cap_mb * 2**20),
                                    int(min(first_bucket_mb, bucket_cap_mb) * 2**20))
        self.buckets = [_make_bucket(ps, g, i == len(plans) - 1) for i, (g, ps) in enumerate(plans)]
        self._index = {id(p): b for b in self.buckets for p in b.params}
        self._armed = False
        self._next = 0
        self._used: set[int] = set()
        self._extra: torch.Tensor | None = None
        self.extra: torch.Tensor | None = None
        self.bytes_reduced = 0
        self.flag_bytes = 0
        self.scheduler = None
        self._handles: dict[int, object] = {}
        self.start_step()

    @staticmethod
    def _fill(group, params, cap, first_cap) -> list[tuple[object, list[torch.nn.Parameter]]]:
        out, cur = [], []
        size, limit = 0, first_cap
        for p in params:
            if cur and p.dtype != cur[0].dtype:
                out.append((group, cur))
                cur, size, limit = [], 0, cap
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                out.append((group, cur))
                cur, size, limit = [], 0, cap
        if cur:
            out.append((group, cur))
        return out

    @property
    def can_carry_extra(self) -> bool:
        """Whether :meth:`arm` can carry a float in the last bucket without losing precision (fp32/fp64)."""
        return bool(self.buckets) and self.buckets[-1].buf.dtype in (torch.float32, torch.float64)

    def start_step(self) -> None:
        """Begin a step: forget which parameters were used, and hook parameters that require grad now (those
        unfrozen since the last step included)."""
        self._used.clear()
        for b in self.buckets:
            b.needed = sum(p.requires_grad for p in b.params)  # frozen ones never report: do not wait for them
            for p in b.params:
                if p.requires_grad and id(p) not in self._handles:
                    self._handles[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self, extra: torch.Tensor | None = None) -> None:
        """Let gradient hooks launch all-reduces during the coming backward; ``extra`` (one float) rides along
        with the last bucket and is summed over its group (read it with :attr:`extra`).

        Raises:
            ValueError: ``extra`` while the last bucket cannot carry it (see :attr:`can_carry_extra`).
        """
        if extra is not None and not self.can_carry_extra:
            raise ValueError("the last gradient bucket is not fp32/fp64: reduce the loss separately")
        self._extra = extra
        self._armed = True
        self._next = 0
        for b in self.buckets:
            b.ready.clear()

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        self._used.add(id(p))
        if not self._armed:
            return
        self._index[id(p)].ready.add(id(p))
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < b.needed:
                break
            if self.scheduler is not None:
                self.scheduler.defer(functools.partial(self._launch, b))
            else:
                self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        for i, p in enumerate(b.params):
            if p.grad is None:  # reset by other code: contributes zeros
                b.view(i).zero_()
                p.grad = b.view(i)
            elif not b.owns(i, p.grad):  # replaced by other code (or accumulated out of place): copy back in
                b.view(i).copy_(p.grad)
                p.grad = b.view(i)
        b.flags.copy_(torch.tensor([float(id(p) in self._used) for p in b.params], dtype=b.buf.dtype))
        if b is self.buckets[-1]:
            b.buf[-1] = float(self._extra.reshape(-1)[0]) if self._extra is not None else 0.0
        self.bytes_reduced += b.grad_numel * b.buf.element_size()
        self.flag_bytes += len(b.params) * b.buf.element_size()
        b.work = self._reduce(b)

    def _reduce(self, b: _Bucket):
        """Start summing bucket ``b`` over its group; returns the work to ``wait()`` on. (ZeRO-2 sums each
        lane's slice onto that lane instead: :class:`whale.parallel.zero.ShardedGradSync`.)"""
        return dist.all_reduce(b.buf, op=dist.ReduceOp.SUM, group=b.group, async_op=True)

    def finish(self) -> None:
        """Launch what the hooks did not, wait for all, and drop the gradient of every parameter no rank used
        (``.grad = None``, as in one process)."""
        if self.scheduler is not None:
            self.scheduler.flush()
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for b in self.buckets:
            b.work.wait()
            b.work = None
            for p, used in zip(b.params, b.flags.tolist(), strict=True):
                if not used:
                    p.grad = None
        if self._extra is not None and self.buckets:
            self.extra = self.buckets[-1].buf[-1:].clone()
        self._armed = False

    def zero_grad(self) -> None:
        """Zero every bucket (gradients stay views of their buckets)."""
        for b in self.buckets:
            b.buf.zero_()
            if not all(p.grad is not None and b.owns(i, p.grad) for i, p in enumerate(b.params)):
                b.attach()

    def remove(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles.values():
            h.remove()
        self._handles.clear()


def broadcast_params(param_groups: list[tuple[object, list[torch.nn.Parameter]]], src_of: dict) -> None:
    """Make replicas identical at start: broadcast every parameter from its group's first rank.

    ``src_of[group]`` is that group's source as a global rank.
    """
    with torch.no_grad():
        for group, params in param_groups:
            if group is None:
                continue
            for p in params:
                dist.broadcast(p.data, src=src_of[group], group=group)
