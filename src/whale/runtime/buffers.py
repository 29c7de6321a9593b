"""Buffers across data-parallel lanes: global-batch BatchNorm, and buffers that never drift between replicas.

**BatchNorm.** Each lane of a stage holds its own rows of every micro-batch, so a plain ``nn.BatchNorm*`` would
normalize by its lane's statistics and update its running statistics from them: training would differ from one
process and the replicas' buffers would drift apart. :class:`BufferSync` makes every ``_BatchNorm`` of this
rank's stage (outside split regions) compute its batch statistics over the whole micro-batch, i.e. over every
lane of the stage (``Mesh.lanes``), with ``torch.nn.SyncBatchNorm`` semantics: per channel, the mean and biased
variance of all ``N x spatial`` values of the micro-batch (a lane with 5 of 8 rows counts 5/8, whatever the
shares), the running mean and *unbiased* variance updated from them, and a backward through the global
statistics. Training then equals one process on the whole batch (with micro-batches: one process doing the same
gradient accumulation), and running statistics are computed identically on every lane. In ``eval()`` the running
statistics are used and nothing is communicated; a BatchNorm without running statistics
(``track_running_stats=False``) uses global batch statistics in ``eval()`` too, so ``eval_step`` equals one
process (this communicates, so such a module must be run by every lane together, as ``eval_step`` does).

Why not ``torch.nn.SyncBatchNorm``: in torch 2.13 its forward refuses CPU inputs ("SyncBatchNorm expected input
tensor to be on GPU") and its kernels (``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
``batch_norm_backward_reduce``) exist for CUDA only, so it cannot run on Whale's CPU/gloo ranks. The autograd
function here does the same math with plain tensor ops on any device: forward one all-reduce of ``2C + 1``
float64 values (per-channel sums of x and x^2, built from each lane's stable fp32 ``var_mean``, and the count),
backward one all-reduce of ``2C`` (per-channel sums of dy and dy * x_hat). Modules are converted in place by
swapping their class for a subclass of their own type (as ``torch.nn.utils.parametrize`` does), so parameter and
buffer names, the very same tensors, ``isinstance`` checks and hooks are kept. Its collectives run on a
dedicated copy of the lanes group: gradient buckets are all-reduced asynchronously on ``Mesh.lanes`` during
backward (at emulated times under emulation), and collectives of one group must be issued in the same order on
every rank.

**Other buffers** (anything a model updates in forward, e.g. a counter or an EMA of its inputs): after every
optimizer step, :meth:`BufferSync.after_step` broadcasts from lane 0 every buffer that changed on any lane
(tracked by the tensors' version counters; one small all-reduce of flags finds them), coalesced per dtype.
Lane 0's value wins, as with ``DistributedDataParallel(broadcast_buffers=True)``; a module that needs global
semantics must communicate itself, as BatchNorm here does. Buffers of split shards are broadcast over the
ranks holding the same shard in every replica (``Mesh.shard_replicas``). All buffers are broadcast once at
start. BatchNorm inside a split region (only possible through a custom split rule) keeps local statistics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from whale.plan.plan import Plan
from whale.runtime.mesh import Mesh

_GROUPS: dict[tuple, object] = {}


class _GlobalBatchNormFn(torch.autograd.Function):
    """Batch norm with statistics over every rank of ``group`` (see the module docstring).

    Shapes: ``x [N, C, *]``; ``weight``, ``bias``, running statistics ``[C]`` or ``None``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group):
        """Normalize ``x`` by the global per-channel mean and variance; update the running statistics."""
        c, shape = x.size(1), [1, x.size(1)] + [1] * (x.dim() - 2)
        dims = [0, *range(2, x.dim())]
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        var, mean = torch.var_mean(xf, dim=dims, correction=0)
        n = xf.numel() // c
        mean64 = mean.double()
        stats = torch.cat([mean64 * n, (var.double() + mean64 ** 2) * n, mean64.new_full((1,), n)])
        dist.all_reduce(stats, group=group)
        count = stats[-1]  # >= 2: every lane holds >= 1 row (the plan's rows), and a group has >= 2 lanes
        g_mean = stats[:c] / count
        g_var = (stats[c:2 * c] / count - g_mean ** 2).clamp_(min=0)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((g_mean * momentum).to(running_mean.dtype))
        if running_var is not None:
            running_var.mul_(1 - momentum).add_((g_var * (count / (count - 1)) * momentum).to(running_var.dtype))
        invstd = (g_var + eps).rsqrt().to(xf.dtype)
        xhat = (xf - g_mean.to(xf.dtype).view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.group, ctx.count, ctx.has_bias = group, count, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        """dx = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), means over all lanes; dw, db local
        (summed over lanes by the gradient sync like every replicated parameter's)."""
        xhat, invstd, weight = ctx.saved_tensors
        c, shape = xhat.size(1), [1, xhat.size(1)] + [1] * (xhat.dim() - 2)
        dims = [0, *range(2, xhat.dim())]
        dyf = dy.to(xhat.dtype)
        sum_dy, sum_dy_xhat = dyf.sum(dims), (dyf * xhat).sum(dims)
        dx = None
        if ctx.needs_input_grad[0]:
            red = torch.cat([sum_dy, sum_dy_xhat]).double()
            dist.all_reduce(red, group=ctx.group)
            mean_dy = (red[:c] / ctx.count).to(xhat.dtype).view(shape)
            mean_dy_xhat = (red[c:] / ctx.count).to(xhat.dtype).view(shape)
            scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
            dx = ((dyf - mean_dy - xhat * mean_dy_xhat) * scale.view(shape)).to(dy.dtype)
        dw = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy.to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None


def _restore(cls: type, state: dict) -> nn.Module:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


class GlobalBatchNorm:
    """Mixin put in front of a BatchNorm's own class (``Global<Class>``): training statistics over
    ``whale_group`` (``None``: this rank's rows only, plain BatchNorm). Everything else is the original class.
    Copies and pickles are plain modules of the original class: global statistics belong to a running engine,
    and a copy outside it must not communicate (nor could a process group be pickled)."""

    whale_group = None
    _whale_base: type = _BatchNorm

    def __reduce_ex__(self, protocol):
        """Pickle / ``copy.deepcopy`` as the original class, without the process group."""
        return _restore, (self._whale_base, {k: v for k, v in self.__dict__.items() if k != "whale_group"})

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``[N, C, *] -> [N, C, *]``, normalized by global batch statistics when they are used."""
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if self.whale_group is None or not batch_stats:
            return _BatchNorm.forward(self, input)  # running statistics (or a lone lane): no communication
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        track = self.training and self.track_running_stats
        if track:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        return _GlobalBatchNormFn.apply(input, self.weight, self.bias, self.running_mean if track else None,
                                        self.running_var if track else None, factor, self.eps, self.whale_group)


_CLASSES: dict[type, type] = {}


def _global_class(cls: type) -> type:
    if issubclass(cls, GlobalBatchNorm):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Global{cls.__name__}", (GlobalBatchNorm, cls),
                             {"__module__": __name__, "_whale_base": cls})
    return _CLASSES[cls]


def convert_batchnorm(module: nn.Module, group, skip: set[int] = frozenset()) -> list[str]:
    """Make every ``_BatchNorm`` in ``module`` (except those whose ``id`` is in ``skip``) use global batch
    statistics over ``group``, in place; returns their names.

    Raises:
        ValueError: a BatchNorm subclass with its own ``forward`` (its statistics cannot be made global;
            the message names it and the fix).
    """
    names = []
    check_batchnorms(module, skip)
    for name, m in module.named_modules():
        if not isinstance(m, _BatchNorm) or id(m) in skip:
            continue
        m.__class__ = _global_class(type(m))
        m.whale_group = group
        names.append(name)
    return names


def check_batchnorms(module: nn.Module, skip: set[int] = frozenset()) -> None:
    """Refuse a BatchNorm whose statistics cannot be made global (see :func:`convert_batchnorm`). No
    communication: the engine calls it on every rank before it makes any process group, so every rank raises.

    Raises:
        ValueError: a BatchNorm subclass with its own ``forward``, named with the fix.
    """
    for name, m in module.named_modules():
        if not isinstance(m, _BatchNorm) or id(m) in skip:
            continue
        if type(m).forward not in (_BatchNorm.forward, nn.SyncBatchNorm.forward, GlobalBatchNorm.forward):
            raise ValueError(
                f"BatchNorm {name!r} ({type(m).__name__}) overrides forward, so Whale cannot make its statistics "
                "span the data-parallel lanes (each lane would normalize by its own rows and the replicas' "
                "running statistics would drift). Fix: use torch's BatchNorm classes (subclasses that keep "
                "forward are fine), or give this stage a single lane.")


def _lane_group(model: nn.Module, plan: Plan, stage: int):
    """A dedicated process group over ``stage``'s lanes for BatchNorm statistics (``None`` when no BatchNorm
    or a single lane). Collective over the world: the decision reads the full model, the same on every rank,
    and every rank creates every stage's group in order (cached per world and ranks across engines)."""
    if plan.world_size == 1 or plan.max_lanes == 1 or not any(isinstance(m, _BatchNorm) for m in model.modules()):
        return None
    mine = None
    for s in range(plan.num_stages):
        ranks = tuple(plan.stage_ranks(s))
        key = (dist.group.WORLD, tuple(sorted(ranks)))
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(list(key[1]))
        if s == stage:
            mine = _GROUPS[key]
    return mine


def _mark(t: torch.Tensor) -> tuple[int, int]:
    """Identity and version of a buffer: it changed (in place, or was replaced) when this changes."""
    try:
        return id(t), t._version
    except RuntimeError:  # inference tensors keep no version: always sync them
        return id(t), -1


class _BufferSet:
    """Buffers kept equal over ``group`` by broadcasts from its first rank."""

    def __init__(self, group, slots: list[tuple[nn.Module, str]]) -> None:
        self.group, self.slots = group, slots
        self.src = Mesh.source(group)
        self.seen = [None] * len(slots)

    def tensors(self) -> list[torch.Tensor]:
        """The slots' current tensors (a module may have replaced one)."""
        return [m._buffers[n] for m, n in self.slots]

    def sync(self, everything: bool = False) -> int:
        """Broadcast the buffers that changed on any rank since the last sync (all with ``everything``);
        returns how many were sent. Collective over the group."""
        tensors = self.tensors()
        changed = [everything or _mark(t) != s for t, s in zip(tensors, self.seen, strict=True)]
        if not everything:
            flags = torch.tensor(changed, dtype=torch.int32, device=tensors[0].device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            changed = [bool(f) for f in flags.tolist()]
        _broadcast([t for t, c in zip(tensors, changed, strict=True) if c], self.src, self.group)
        self.seen = [_mark(t) for t in tensors]
        return sum(changed)


@torch.no_grad()
def _broadcast(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` from global rank ``src``, one flat message per dtype (bools as bytes)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    unique = {id(t): t for t in tensors}
    for t in unique.values():
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        views = [t.view(torch.uint8) if t.dtype == torch.bool else t for t in ts]
        flat = torch.cat([v.reshape(-1) for v in views])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for v in views:
            v.copy_(flat[offset: offset + v.numel()].view_as(v))
            offset += v.numel()


class BufferSync:
    """Global-batch BatchNorm and drift-free buffers for one rank's stage (see the module docstring).

    Args:
        model: the full model, identical on every rank (decides, the same way everywhere, whether BatchNorm
            groups are needed: creating them is collective over the world).
        module: this rank's stage module, split regions installed, on its device.
        plan, mesh: the plan and this rank's groups.
        regions: the installed split regions (their modules' buffers follow ``mesh.shard_replicas``).

    Attributes:
        group: the dedicated lanes group of the BatchNorm statistics (``None``: none needed).
        batchnorms: names of the converted BatchNorm modules.

    Raises:
        ValueError: a BatchNorm that cannot be made global (see :func:`convert_batchnorm`).
    """

    def __init__(self, model: nn.Module, module: nn.Module, plan: Plan, mesh: Mesh, regions: list) -> None:
        in_regions = {id(m) for r in regions for m in r.modules()}
        self.group = _lane_group(model, plan, mesh.stage)
        self.batchnorms = convert_batchnorm(module, self.group, in_regions) if self.group is not None else []
        global_bn = {id(module.get_submodule(n)) for n in self.batchnorms}
        lane_slots, shard_slots = [], []
        for m in module.modules():
            for name, buf in m._buffers.items():
                if buf is not None:
                    (shard_slots if id(m) in in_regions else lane_slots).append((m, name))
        pairs = [(g, slots) for g, slots in ((mesh.lanes, lane_slots), (mesh.shard_replicas, shard_slots))
                 if g is not None and slots]
        for g, slots in pairs:  # every buffer once at start
            _BufferSet(g, slots).sync(everything=True)
        # after each step: not the global BatchNorms' statistics (equal on every lane by construction)
        pairs = [(g, [(m, n) for m, n in slots if id(m) not in global_bn]) for g, slots in pairs]
        self.sets = [_BufferSet(g, slots) for g, slots in pairs if slots]
        for s in self.sets:  # what is there now is in sync: later syncs send what changes from here
            s.seen = [_mark(t) for t in s.tensors()]

    def after_step(self) -> int:
        """Broadcast every buffer that changed on any lane since the last call from lane 0 (collective over
        the stage's lanes; call it on every rank after the optimizer step). Returns how many were sent."""
        return sum(s.sync() for s in self.sets)
