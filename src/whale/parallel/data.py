"""replicate -> data parallelism: bucketed gradient all-reduce, overlapped with the last backward.

Exact weighting with uneven batch shares: every rank scales its micro-batch loss by ``rows / global_batch``
(the runtime does this), so summing gradients across ranks (``ReduceOp.SUM``) yields exactly the gradient of
the mean loss over the global batch (DESIGN.md §5, "Correctness with uneven shares"). No division by the
world size happens here.

Buckets are filled in reverse parameter order (roughly the order backward produces gradients) up to
``bucket_cap_mb``; a bucket's all-reduce starts as soon as it and every earlier bucket are complete, so every
rank of a group launches its collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    group: object
    ready: set[int] = field(default_factory=set)
    buf: torch.Tensor | None = None
    work: object = None


class GradSync:
    """Sums gradients of parameter sets over their process groups.

    Args:
        param_groups: ``[(group, params), ...]``; ``group`` is a ``ProcessGroup`` or ``None`` (no reduction,
            e.g. a group of one rank). Each parameter appears in exactly one entry.
        bucket_cap_mb: bucket size in MiB (2**20 bytes); the first bucket of each group is capped at
            ``first_bucket_mb`` so that communication starts early in backward (as DDP does).
        overlap: start all-reduces from gradient hooks during the armed backward.

    Usage per step: ``arm()`` before the last backward, then ``finish()`` after it. ``arm(extra)`` appends a
    small float tensor to the last bucket, summed over that bucket's group for free (the step's loss).
    """

    def __init__(self, param_groups: list[tuple[object, list[torch.nn.Parameter]]], bucket_cap_mb: float = 25.0,
                 overlap: bool = True, first_bucket_mb: float = 1.0) -> None:
        self.buckets: list[_Bucket] = []
        for group, params in param_groups:
            if group is None:
                continue
            self._fill(group, [p for p in reversed(params) if p.requires_grad],
                       int(bucket_cap_mb * 2**20), int(min(first_bucket_mb, bucket_cap_mb) * 2**20))
        self._index = {id(p): (i, b) for i, b in enumerate(self.buckets) for p in b.params}
        self._armed = False
        self._next = 0
        self._extra: torch.Tensor | None = None
        self.extra: torch.Tensor | None = None
        self.bytes_reduced = 0
        """Gradient bytes handed to all-reduce so far (the loss riding along is not counted)."""
        self._handles = []
        if overlap:
            for b in self.buckets:
                for p in b.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _fill(self, group, params, cap, first_cap) -> None:
        cur: list[torch.nn.Parameter] = []
        size, limit = 0, first_cap
        for p in params:
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(_Bucket(cur, group))
                cur, size, limit = [], 0, cap
        if cur:
            self.buckets.append(_Bucket(cur, group))

    def arm(self, extra: torch.Tensor | None = None) -> None:
        """Let gradient hooks launch all-reduces during the coming backward; ``extra`` (1-D float tensor)
        rides along with the last bucket and is summed over its group (read it with :attr:`extra`)."""
        self._extra = extra
        self._armed = True
        self._next = 0
        for b in self.buckets:
            b.ready.clear()
            b.work = None

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        _, bucket = self._index[id(p)]
        bucket.ready.add(id(p))
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                break
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params]
        if self._extra is not None and b is self.buckets[-1]:
            grads.append(self._extra.to(grads[0].dtype))
        b.buf = torch.cat(grads)
        extra = 0 if b is not self.buckets[-1] or self._extra is None else self._extra.numel()
        self.bytes_reduced += (b.buf.numel() - extra) * b.buf.element_size()
        b.work = dist.all_reduce(b.buf, op=dist.ReduceOp.SUM, group=b.group, async_op=True)

    def finish(self) -> None:
        """Launch what the hooks did not (unused parameters get zero gradients), wait, write gradients back."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for b in self.buckets:
            b.work.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                view = b.buf[offset: offset + n].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += n
            if self._extra is not None and b is self.buckets[-1]:
                self.extra = b.buf[offset:].clone()
            b.buf, b.work = None, None
        self._armed = False

    def remove(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
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
