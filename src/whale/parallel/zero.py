"""ZeRO stages 1 and 2 over one pipeline stage's data-parallel lanes, with uneven, hardware-aware shards
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020).

Layout. The stage's replicated parameters (those whose gradients :class:`~whale.parallel.data.GradSync` sums
over the stage's lanes; not split shards, whose state is already cut) are bucketed by GradSync; each bucket's
parameters become views of one flat buffer with the bucket's offsets. The bucket's ``N`` elements are cut into
contiguous lane ranges by :func:`whale.plan.shares.whole_shares` of the plan's ``zero_weights`` (sized by each
device's free memory, :mod:`whale.planner.zero`). A lane owns its range of every bucket, so its share of the state
is its weight's share. A parameter tied across stages (an input embedding and LM head) is summed over every
rank of every stage holding it; its bucket is sliced over that group, each rank by its share of its own stage.
A rank's *pieces*: one ``nn.Parameter`` per model parameter overlapping its ranges, a view of that part of the
flat buffer. The user's optimizer keeps its param groups; each group's parameters are replaced by their pieces
on this rank. An elementwise optimizer (SGD, Adam, AdamW, ...) steps a piece exactly as it would
step those elements of the whole parameter; per-parameter state such as Adam's step count stays per parameter,
and a parameter no rank computed a gradient for (frozen, unused) has no gradient on its pieces, so the
optimizer skips it as in one process.

Per step:

- stage 1: buckets are all-reduced as before; each piece's ``.grad`` is a view of its slice of the reduced
  bucket, so only the owner's slice of the optimizer state exists.
- stage 2: each bucket's gradients are reduce-scattered (``dist.reduce_scatter``, list form: uneven slices, on
  gloo and NCCL) into this lane's persistent shard-gradient buffer; the used flags (and the loss riding along)
  are all-reduced. The full-size bucket buffers are freed once reduced and allocated again at the next step's
  start, so between steps and during the optimizer step only the lane's slice of the gradients exists.
  Backward still accumulates whole gradients over a step's micro-batches (reducing once per step, not once per
  micro-batch as DeepSpeed does, keeps the pipeline's traffic as without ZeRO).
- after ``optimizer.step()``: each lane broadcasts its updated ranges to the others (``dist.broadcast`` per lane
  range; gloo's ``all_gather`` refuses uneven sizes), so every lane holds whole parameters again.
- clipping: the global norm adds each rank's pieces (every element counted once over its group).

Why Whale's own code and not FSDP2 (``fully_shard``): FSDP2 shards every parameter evenly on dim 0 (``Shard(0)``
DTensors, padded to equal chunks); it cannot give a 32 GB device a larger slice than a 16 GB one, which is the
point of hardware-aware sharding. It is also ZeRO-3 only (parameters re-gathered in every forward), drives its
own reduction rather than Whale's GradSync (used flags, uneven batch shares, pipeline micro-batches, tied
groups), and DeepSpeed's ZeRO refuses pipelines for stage 2; here every pipeline stage shards over its own lanes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from whale.parallel.data import GradSync, _Bucket
from whale.plan.plan import Plan
from whale.plan.shares import whole_shares
from whale.planner.zero import zero_shard_weights

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop)


class ZeroError(TypeError):
    """An optimizer ZeRO cannot shard; the message names it and the fix."""


def check_optimizer(optimizer) -> None:
    """Refuse an optimizer whose update of an element may depend on other elements.

    Raises:
        ZeroError: ``optimizer`` is not one of :data:`ELEMENTWISE` (or a subclass).
    """
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ZeroError(
            f"Config(zero=...) shards the optimizer elementwise (each lane steps a slice of the parameters), but "
            f"{type(optimizer).__name__} is not an optimizer Whale knows to be elementwise ({names}); a factored "
            "or matrix update (Adafactor, Shampoo, Muon, LBFGS, ...) needs whole parameters. Use one of those "
            "optimizers, or Config(zero=0)")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors of at least one dimension (Adam's moments; 0-dim step counters
    are left out), as held on this rank."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def held_gradient_bytes(grad_sync: GradSync) -> int:
    """Bytes of gradient storage ``grad_sync`` holds right now: its bucket buffers and, under ZeRO-2, the
    shard gradients (between steps ZeRO-2 holds only the shards of the buckets it frees)."""
    zero = getattr(grad_sync, "zero3", None) or getattr(grad_sync, "zero", None)
    shards = zero.shard_grads if zero is not None else []
    return sum(t.numel() * t.element_size() for t in [*(b.buf for b in grad_sync.buckets), *shards])


@dataclass
class _Piece:
    """This lane's part of one parameter: elements ``lo:hi`` of bucket ``bucket``'s flat buffer."""

    param: nn.Parameter  # a view of the flat parameter buffer; the optimizer steps it
    owner: nn.Parameter  # the model parameter it is part of
    bucket: int
    index: int  # the owner's index in its bucket
    lo: int
    hi: int


class _Works:
    """Several collectives waited on as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        """Wait for every collective."""
        for w in self.works:
            w.wait()


def bind_pieces(optimizer: torch.optim.Optimizer, pieces: list[_Piece], managed: set[int]) -> None:
    """Re-point the optimizer's param groups at ``pieces`` in place: each parameter whose ``id`` is in
    ``managed`` is replaced by its pieces on this rank (none: it leaves its group); others stay.

    Raises:
        ZeroError: the optimizer is not elementwise.
    """
    check_optimizer(optimizer)
    of: dict[int, list[nn.Parameter]] = {}
    for pc in pieces:
        of.setdefault(id(pc.owner), []).append(pc.param)
    for group in optimizer.param_groups:
        group["params"] = [q for p in group["params"] for q in (of.get(id(p), []) if id(p) in managed else [p])]


class ZeroShards:
    """This rank's slices of a stage's replicated parameters, gradients (stage 2) and optimizer state.

    Args:
        buckets: GradSync's buckets to shard (their parameters become flat-buffer views), each over its own
            group: the stage's lanes, or the ranks of every stage holding a tied parameter.
        weights: per bucket, the relative slice of each group rank (group rank order; >= 0, positive sum).
        level: the ZeRO stage, 1 or 2.

    Attributes:
        pieces: this rank's parts of parameters (the optimizer's parameters in place of the whole ones).
        bounds: per bucket, the group ranks' ranges (``bounds[k][g]:bounds[k][g + 1]``).
    """

    def __init__(self, buckets: list[_Bucket], weights: list[list[float]], level: int) -> None:
        self.buckets, self.level = buckets, level
        self.sources = [[dist.get_global_rank(b.group, g) for g in range(len(w))]
                        for b, w in zip(buckets, weights, strict=True)]
        self.bounds = [[0, *itertools.accumulate(whole_shares(b.grad_numel, w))]
                       for b, w in zip(buckets, weights, strict=True)]
        me = [dist.get_rank(b.group) for b in buckets]
        self.mine = [(bd[g], bd[g + 1]) for bd, g in zip(self.bounds, me, strict=True)]
        self.sizes = [b.buf.numel() for b in buckets]
        self.flats = [self._flatten(b) for b in buckets]
        self.pieces: list[_Piece] = []
        for k, b in enumerate(buckets):
            a, z = self.mine[k]
            for i, p in enumerate(b.params):
                lo, hi = max(a, b.offsets[i]), min(z, b.offsets[i] + p.numel())
                if lo < hi:
                    self.pieces.append(_Piece(nn.Parameter(self.flats[k][lo:hi]), p, k, i, lo, hi))
        self.managed = {id(p) for b in buckets for p in b.params}
        self.shard_grads = [b.buf.new_zeros(z - a) for b, (a, z) in zip(buckets, self.mine, strict=True)] \
            if level >= 2 else []

    @staticmethod
    @torch.no_grad()
    def _flatten(b: _Bucket) -> torch.Tensor:
        """One flat buffer holding the bucket's parameters at the bucket's offsets; each parameter's ``.data``
        becomes its view (the module keeps the same ``Parameter`` objects)."""
        flat = b.buf.new_empty(b.grad_numel)
        for i, p in enumerate(b.params):
            view = flat[b.offsets[i]: b.offsets[i] + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        return flat

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point the optimizer's param groups at this lane's pieces, in place (same groups, same
        schedulers); a parameter with no piece here leaves its group.

        Raises:
            ZeroError: the optimizer is not elementwise.
        """
        bind_pieces(optimizer, self.pieces, self.managed)

    def release(self) -> None:
        """Nothing to free (ZeRO-1/2 keep whole parameters; ZeRO-3 frees its gathered units here)."""

    def whole(self, write_back: bool = False):
        """A context in which every parameter is whole: always, under ZeRO-1/2 (``write_back`` is unused)."""
        return contextlib.nullcontext()

    def owns(self, b: _Bucket) -> bool:
        """True when ``b`` is one of the buckets sharded here."""
        return any(b is x for x in self.buckets)

    def reduce_scatter(self, b: _Bucket) -> _Works:
        """Stage 2: start summing bucket ``b``'s gradients with each lane's slice landing on that lane (in this
        lane's shard-gradient buffer), and its used flags and loss slot on every lane."""
        k = next(i for i, x in enumerate(self.buckets) if x is b)
        bd = self.bounds[k]
        parts = [b.buf[bd[g]: bd[g + 1]] for g in range(len(self.sources[k]))]
        return _Works([dist.reduce_scatter(self.shard_grads[k], parts, group=b.group, async_op=True),
                       dist.all_reduce(b.buf[b.grad_numel:], group=b.group, async_op=True)])

    def after_reduce(self) -> None:
        """Give every piece its reduced gradient slice (``None`` where no rank used the parameter); stage 2 then
        frees the full-size bucket buffers."""
        flags = [b.flags.tolist() for b in self.buckets]
        for pc in self.pieces:
            b, (a, _) = self.buckets[pc.bucket], self.mine[pc.bucket]
            if not flags[pc.bucket][pc.index]:
                pc.param.grad = None
            elif self.level == 1:
                pc.param.grad = b.buf[pc.lo: pc.hi]
            else:
                pc.param.grad = self.shard_grads[pc.bucket][pc.lo - a: pc.hi - a]
        if self.level >= 2:
            for b in self.buckets:
                for p in b.params:
                    p.grad = None
                b.buf = b.buf.new_empty(0)

    def allocate(self) -> None:
        """Stage 2, at a step's start: full-size gradient buckets again (zeros; backward accumulates in them)."""
        for b, size in zip(self.buckets, self.sizes, strict=True):
            if b.buf.numel() != size:
                b.buf = b.buf.new_zeros(size)
                b.attach()

    def zero_grad(self) -> None:
        """After the step: zero the shard gradients and drop the pieces' gradients."""
        for g in self.shard_grads:
            g.zero_()
        for pc in self.pieces:
            pc.param.grad = None

    @torch.no_grad()
    def gather(self) -> None:
        """After ``optimizer.step()``: every lane broadcasts its updated ranges, so all hold whole parameters
        (collective over the group; every lane calls it)."""
        works = []
        for b, flat, bd, sources in zip(self.buckets, self.flats, self.bounds, self.sources, strict=True):
            for g, src in enumerate(sources):
                if bd[g] < bd[g + 1]:
                    works.append(dist.broadcast(flat[bd[g]: bd[g + 1]], src=src, group=b.group, async_op=True))
        for w in works:
            w.wait()

    def norm_params(self, owners: list[nn.Parameter]) -> list[nn.Parameter]:
        """The tensors whose gradients this rank adds to the global norm: ``owners`` (see
        :func:`whale.runtime.groups.norm_owned_params`) less the sharded parameters, plus this lane's pieces."""
        return [p for p in owners if id(p) not in self.managed] + [pc.param for pc in self.pieces]

    def clip_targets(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The tensors whose gradients clipping scales: ``params``, and the pieces under stage 2 (their
        gradients are not views of the parameters' gradients there)."""
        return list(params) + ([pc.param for pc in self.pieces] if self.level >= 2 else [])


class ShardedGradSync(GradSync):
    """:class:`~whale.parallel.data.GradSync` that hands the buckets of :attr:`zero` to ZeRO: under stage 2
    they are reduce-scattered, freed after the step's reduction and allocated again at the next step's start;
    under both stages the pieces get their gradient slices after :meth:`finish`."""

    zero: ZeroShards | None = None

    def start_step(self) -> None:
        """Allocate the freed buckets (stage 2), then as :meth:`GradSync.start_step`."""
        if self.zero is not None and self.zero.level >= 2:
            self.zero.allocate()
        super().start_step()

    def _reduce(self, b: _Bucket):
        if self.zero is not None and self.zero.level >= 2 and self.zero.owns(b):
            return self.zero.reduce_scatter(b)
        return super()._reduce(b)

    def finish(self) -> None:
        """As :meth:`GradSync.finish`, then the pieces' gradients (and, stage 2, the buckets freed)."""
        super().finish()
        if self.zero is not None:
            self.zero.after_reduce()

    def zero_grad(self) -> None:
        """Zero the buckets that exist (stage 2 frees its own) and the shard gradients."""
        for b in self.buckets:
            if b.buf.numel() == 0:
                continue
            b.buf.zero_()
            if not all(p.grad is not None and b.owns(j, p.grad) for j, p in enumerate(b.params)):
                b.attach()
        if self.zero is not None:
            self.zero.zero_grad()


def shard_buckets(plan: Plan, sync: GradSync, lanes_group, tied_groups: list, own: set[int],
                  level: int) -> ZeroShards | None:
    """ZeRO-``level`` (1 or 2) shards of ``sync``'s buckets over the stage's lanes (``lanes_group``, only
    buckets of parameters whose ``id`` is in ``own``) and over the ranks holding a tied parameter
    (``tied_groups``), as :func:`build_grad_sync` describes; ``None`` when no bucket qualifies."""
    buckets, weights = [], []
    for b in sync.buckets:
        lanes = lanes_group is not None and b.group is lanes_group and all(id(p) in own for p in b.params)
        if not lanes and not any(b.group is g for g in tied_groups if g is not None):
            continue
        buckets.append(b)
        ranks = [plan.coords(dist.get_global_rank(b.group, g)) for g in range(dist.get_world_size(b.group))]
        weights.append([_relative(plan, s, lane) for s, lane in ranks])
    return ZeroShards(buckets, weights, level) if buckets else None


def _relative(plan: Plan, stage: int, lane: int) -> float:
    """A lane's share of its stage's ZeRO state (its weight over the stage's total)."""
    w = zero_shard_weights(plan, stage)
    return w[lane] / sum(w)
