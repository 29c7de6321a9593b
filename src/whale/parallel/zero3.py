"""ZeRO stage 3 over one pipeline stage's data-parallel lanes: parameters sharded, each *unit* gathered before
its forward and its backward and freed after, with uneven, hardware-aware shards (Rajbhandari et al., "ZeRO",
SC 2020; ZeRO-1/2 and the shard sizes: :mod:`whale.parallel.zero`, :mod:`whale.plan.zero`).

Units (what is gathered at once). Without a pipeline the stage module is the user's model: every repeated layer
(each child of a ``ModuleList``/``Sequential`` that holds parameters, e.g. every transformer block:
:func:`whale.memory.checkpointing.repeated_layers`; else every top-level child with parameters) is a unit, and
the rest (embeddings, final norm, a head, parameters used by several units, e.g. an input embedding tied to the
head) form the *root* unit of the stage module. A pipeline stage is a traced graph that reads parameters
directly, not through module calls, so there the whole stage module is one unit.
Each unit's parameters (the stage's replicated ones: not split shards, already cut, and not parameters tied
across stages, whose values stay whole while their gradients and optimizer state are sliced over the tie group
as under ZeRO-2: :attr:`Zero3Shards.tied`, :mod:`whale.parallel.zero3_sync`) become views of one flat
buffer of ``N`` elements; lane ``g`` of the stage owns elements ``bounds[g]:bounds[g + 1]`` (
:func:`~whale.plan.zero.whole_shares` of the plan's ``zero_weights``: sized by free device memory) and keeps
them in its own *shard*; the full buffer's storage exists only while the unit is gathered
(``untyped_storage().resize_``, so autograd's saved references to the parameters see the data again in
backward).

Per micro-batch (so 1F1B with several micro-batches in flight works: each forward and each backward gathers
again): a forward pre-hook gathers the unit, a forward hook frees it (the root stays gathered from its forward
to its backward, as FSDP2's root, except in a pipeline, where other micro-batches run in between) and hooks
the outputs; the first gradient reaching an output gathers the unit again; when every parameter of the unit
that requires grad has its gradient (or, for a parameter no path reached, at the end of that backward) the
gradients autograd made are copied into one flat buffer (as FSDP2 does: a buffer allocated up front would
hold a unit's whole gradient while its first parameter's gradient is still being made, e.g. the tied head's),
which is reduce-scattered into the lane's shard gradient (summed over micro-batches), and the unit is freed;
the previous reduce-scatter is waited for then, so at most two flat gradient buffers exist. After the step's
last backward one all-reduce of "used" flags makes every piece of a parameter no lane used end with
``.grad = None`` (as in one process). The optimizer steps this lane's *pieces* (views of its shard; the user's
param groups and schedulers kept, as under ZeRO-1/2); nothing is broadcast after the step: the next forward
gathers.

Collectives: with equal shares one ``all_gather_single`` / ``reduce_scatter_single`` per unit; with uneven
shares gloo's all-gather refuses different sizes, so each lane broadcasts its range in place into the flat
buffer (no padding, no copy afterwards; an all-gather into padded buffers would need a copy out of the
padding) and gradients go through the list form of ``reduce_scatter`` (uneven slices, gloo and NCCL).

Why Whale's own code and not FSDP2 (``fully_shard``): FSDP2 shards every parameter evenly on dim 0
(``Shard(0)`` DTensors, padded to equal chunks); it cannot give a 32 GB device a larger slice than a 16 GB one,
which is the point of hardware-aware sharding; it also replaces parameters by DTensors, which Whale's split
regions, pipeline stages (traced graphs) and gradient bookkeeping do not expect.

Limits: every lane must call the same units in the same order (same control flow), as for any ZeRO-3; a
unit's parameter must only be read inside that unit's forward (or be left to the root); one dtype per unit.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from whale.memory.checkpointing import repeated_layers
from whale.parallel.zero import _Piece, bind_pieces
from whale.plan.zero import whole_shares


class Zero3Error(ValueError):
    """A stage ZeRO-3 cannot shard as asked; the message names the unit and the fix."""


@dataclass(eq=False)
class _Unit:
    """One gathered-at-once group of parameters (see the module docstring)."""

    name: str
    params: list[nn.Parameter]
    views: list[torch.Tensor]  # each parameter's view of ``flat`` (its ``.data`` while gathered)
    flat: torch.Tensor  # N elements; storage resized to 0 while freed
    shard: torch.Tensor  # this lane's range, own storage
    shard_grad: torch.Tensor
    bounds: list[int]
    keep: bool  # stays gathered from forward to backward (the root outside pipelines)
    used: torch.Tensor  # per parameter: got a gradient on this lane this step
    even: bool = False  # equal ranges: one all-gather / reduce-scatter instead of per-lane calls
    gathered: bool = False
    active: bool = False  # inside this unit's backward (gathered, gradients arriving)
    arrived: set[int] = field(default_factory=set)
    expected: int = 0


def find_units(module: nn.Module, pipeline: bool) -> list[tuple[str, nn.Module]]:
    """The units of a stage module other than its root: ``[(fqn, module)]`` (none in a pipeline stage)."""
    if pipeline:
        return []
    names = repeated_layers(module) or [n for n, c in module.named_children() if next(c.parameters(), None)
                                        is not None and not isinstance(c, nn.ModuleList | nn.ModuleDict)]
    return [(n, module.get_submodule(n)) for n in names]


class Zero3Shards:
    """This lane's shards of a stage's parameters, gradients and optimizer state, with the hooks that gather
    and free each unit (see the module docstring).

    Args:
        module: the stage module (hooks are installed on it and on its units).
        params: the parameters to shard (the stage's replicated ones), each in one unit.
        group: the stage's data-parallel lanes (a process group of at least 2 ranks).
        weights: the relative share of each lane (group rank order; >= 0, positive sum).
        pipeline: the stage is a pipeline stage (one unit; the root freed after each forward).

    Attributes:
        pieces: this lane's parts of parameters (the optimizer's parameters in place of the whole ones).
        units: the units, root last.
        tracker: ``None`` or a :class:`whale.memory.tracker.StorageTracker` told of every gather and free.
        tied: ``None`` or the ZeRO-2 :class:`~whale.parallel.zero.ZeroShards` of the parameters tied across
            stages (whole values; gradients and optimizer state sliced over the tie group), driven along.

    Raises:
        Zero3Error: a unit whose parameters mix dtypes or devices.
    """

    level = 3

    def __init__(self, module: nn.Module, params: list[nn.Parameter], group, weights: list[float],
                 pipeline: bool) -> None:
        self.group, self.tracker, self.tied = group, None, None
        self.me = dist.get_rank(group)
        self.sources = [dist.get_global_rank(group, g) for g in range(len(weights))]
        self.weights = list(weights)
        managed = {id(p): p for p in params}
        self.managed = set(managed)
        self.units: list[_Unit] = []
        self.pieces: list[_Piece] = []
        taken: dict[int, int] = {}
        found = find_units(module, pipeline)
        for _, m in found:
            for p in {id(q): q for q in m.parameters()}.values():
                taken[id(p)] = taken.get(id(p), 0) + 1
        self._handles = []
        for name, m in found:
            own = [p for p in {id(q): q for q in m.parameters()}.values() if id(p) in managed and taken[id(p)] == 1]
            self._add(name, m, own, keep=False)
        rest = [p for p in managed.values() if taken.get(id(p), 0) != 1]
        self._add("<root>", module, rest, keep=not pipeline)
        self._index = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._pending: list[tuple] = []
        self._callback_task = None
        self._grad_hooks: dict[int, object] = {}

    # --- building ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _add(self, name: str, module: nn.Module, params: list[nn.Parameter], keep: bool) -> None:
        """Flatten ``params`` into a new unit gathered around ``module``'s calls."""
        if not params:
            return
        if len({(p.dtype, p.device) for p in params}) > 1:
            kinds = sorted({f"{p.dtype}@{p.device}" for p in params})
            raise Zero3Error(f"ZeRO-3 unit {name!r} mixes parameter dtypes/devices {kinds}; give the module's "
                             "parameters one dtype and device, or use Config(zero=2)")
        numel = sum(p.numel() for p in params)
        b = [0, *itertools.accumulate(whole_shares(numel, self.weights))]
        flat = params[0].new_empty(numel)
        views, offset = [], 0
        for p in params:
            views.append(flat[offset: offset + p.numel()].view_as(p))
            views[-1].copy_(p.detach())
            offset += p.numel()
        a, z = b[self.me], b[self.me + 1]
        even = len({y - x for x, y in itertools.pairwise(b)}) == 1
        unit = _Unit(name, params, views, flat, flat[a:z].clone(), flat.new_zeros(z - a), b, keep,
                     torch.zeros(len(params), dtype=torch.bool), even=even)
        offset = 0
        for i, p in enumerate(params):
            lo, hi = max(a, offset), min(z, offset + p.numel())
            if lo < hi:
                self.pieces.append(_Piece(nn.Parameter(unit.shard[lo - a: hi - a]), p, len(self.units), i, lo, hi))
            offset += p.numel()
        self.units.append(unit)
        self._free(unit)
        self._handles += [module.register_forward_pre_hook(lambda m, args, u=unit: self._gather(u)),
                          module.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))]

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """This lane's shard gradients, one per unit (what it holds of the gradients between steps)."""
        return [u.shard_grad for u in self.units] + (self.tied.shard_grads if self.tied is not None else [])

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point the optimizer's param groups at this lane's pieces (see :func:`whale.parallel.zero.
        bind_pieces`).

        Raises:
            ZeroError: the optimizer is not elementwise.
        """
        bind_pieces(optimizer, self.pieces, self.managed)
        if self.tied is not None:
            self.tied.bind(optimizer)

    # --- gathering and freeing -------------------------------------------------------------------------------
    def _resized(self, unit: _Unit, numel: int) -> None:
        unit.flat.untyped_storage().resize_(numel * unit.flat.element_size())
        if self.tracker is not None:
            self.tracker.label(unit.flat, "parameters")

    @torch.no_grad()
    def _gather(self, unit: _Unit) -> None:
        """Make ``unit``'s parameters whole (collective over the lanes; a no-op when gathered)."""
        if unit.gathered:
            return
        self._resized(unit, unit.flat.numel())
        b = unit.bounds
        if unit.even:
            dist.all_gather_single(unit.flat, unit.shard, group=self.group)
        else:
            unit.flat[b[self.me]: b[self.me + 1]].copy_(unit.shard)
            works = [dist.broadcast(unit.shard if g == self.me else unit.flat[b[g]: b[g + 1]], src=src,
                                    group=self.group, async_op=True)
                     for g, src in enumerate(self.sources) if b[g] < b[g + 1]]
            for w in works:
                w.wait()
        for p, view in zip(unit.params, unit.views, strict=True):
            p.data = view
        unit.gathered = True

    def _free(self, unit: _Unit) -> None:
        """Free the unit's full buffer; its parameters become empty tensors (shape ``[0]``: reading a freed
        parameter fails on its shape instead of touching freed memory)."""
        self._resized(unit, 0)
        empty = unit.flat.new_empty(0)
        for p in unit.params:
            p.data = empty
        unit.gathered = False

    def _post_forward(self, unit: _Unit, out) -> None:
        """After the unit's forward: hook its outputs (gather again before their backward) and free it. Inside
        backward (a checkpointed recompute) the unit stays gathered for the backward under way."""
        if torch._C._current_graph_task_id() != -1:
            return
        if torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit))
        if not unit.keep:
            self._free(unit)

    def _pre_backward(self, unit: _Unit, grad=None) -> None:
        """The first gradient of one of the unit's outputs: gather the unit for its backward."""
        if unit.active:
            return
        self._gather(unit)
        unit.active = True
        unit.arrived.clear()
        unit.expected = sum(p.requires_grad for p in unit.params)
        task = torch._C._current_graph_task_id()
        if self._callback_task != task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, p: nn.Parameter) -> None:
        unit, i = self._index[id(p)]
        unit.used[i] = True
        if not unit.active:
            raise Zero3Error(f"ZeRO-3: a gradient reached a parameter of unit {unit.name!r} outside that unit's "
                             "backward (the parameter is read outside the unit's forward); call the module "
                             "instead of reading its parameters, or use Config(zero=2)")
        unit.arrived.add(i)
        if len(unit.arrived) == unit.expected:
            self._post_backward(unit)

    def _post_backward(self, unit: _Unit) -> None:
        """Start reduce-scattering the unit's gradients (made by autograd, copied into one flat buffer) into the
        lanes' shards, free the unit; finish the previous reduce-scatter."""
        b = unit.bounds
        full = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in unit.params])
        for p in unit.params:
            p.grad = None
        out = full.new_empty(b[self.me + 1] - b[self.me])
        if unit.even:
            work = dist.reduce_scatter_single(out, full, group=self.group, async_op=True)
        else:
            parts = [full[b[g]: b[g + 1]] for g in range(len(self.sources))]
            work = dist.reduce_scatter(out, parts, group=self.group, async_op=True)
        unit.active = False
        self._free(unit)
        self._drain()
        self._pending.append((unit, out, work, full))  # ``full`` stays alive until the collective is done

    def _drain(self) -> None:
        """Wait for the reduce-scatters started and add them to the shard gradients."""
        while self._pending:
            unit, out, work, _ = self._pending.pop(0)
            work.wait()
            unit.shard_grad.add_(out)

    def _end_backward(self) -> None:
        """End of a backward: reduce the units some parameter of which got no gradient, in unit order."""
        self._callback_task = None
        for unit in self.units:
            if unit.active:
                self._post_backward(unit)
        self._drain()

    # --- the step ------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Before a step's first backward: hook every parameter that requires grad now."""
        for unit in self.units:
            for p in unit.params:
                if p.requires_grad and id(p) not in self._grad_hooks:
                    self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)

    def finish(self) -> None:
        """After the step's last backward: the pieces get their summed gradients, ``None`` where no lane used
        the parameter (one all-reduce of the used flags over the lanes)."""
        self._drain()
        flags = torch.cat([u.used for u in self.units]).to(self.units[0].flat.device, torch.float32)  # NCCL: device
        dist.all_reduce(flags, group=self.group)
        starts = [0, *itertools.accumulate(len(u.params) for u in self.units)]
        for pc in self.pieces:
            unit = self.units[pc.bucket]
            a = unit.bounds[self.me]
            used = flags[starts[pc.bucket] + pc.index] > 0
            pc.param.grad = unit.shard_grad[pc.lo - a: pc.hi - a] if used else None
        self.release()

    def zero_grad(self) -> None:
        """After the optimizer step: zero the shard gradients (the pieces' gradients, until :meth:`finish` drops
        those of parameters no lane used) and the used flags."""
        for unit in self.units:
            unit.shard_grad.zero_()
            unit.used.zero_()
        for pc in self.pieces:  # the zeroed shard gradients stay visible (to the memory monitor)
            a = self.units[pc.bucket].bounds[self.me]
            pc.param.grad = self.units[pc.bucket].shard_grad[pc.lo - a: pc.hi - a]

    def gather(self) -> None:
        """After ``optimizer.step()``: the tied parameters' slices broadcast back (collective over each tie
        group); the units are not gathered (the next forward gathers each from the updated shards)."""
        if self.tied is not None:
            self.tied.gather()

    def release(self) -> None:
        """Free every unit still gathered (the root after an eval forward)."""
        for unit in self.units:
            if unit.gathered:
                self._free(unit)

    @contextlib.contextmanager
    def whole(self, write_back: bool = False):
        """Every unit gathered inside (collective over the lanes); with ``write_back`` the lane's ranges are
        copied back into its shards at the end (after loading a state dict into the whole parameters)."""
        for unit in self.units:
            self._gather(unit)
        try:
            yield
        finally:
            for unit in self.units:
                if write_back:
                    unit.shard.copy_(unit.flat[unit.bounds[self.me]: unit.bounds[self.me + 1]])
                self._free(unit)

    def norm_params(self, owners: list[nn.Parameter]) -> list[nn.Parameter]:
        """The tensors whose gradients this rank adds to the global norm: ``owners`` less the sharded
        parameters, plus this lane's pieces (each element counted once over the lanes)."""
        out = [p for p in owners if id(p) not in self.managed] + [pc.param for pc in self.pieces]
        return self.tied.norm_params(out) if self.tied is not None else out

    def clip_targets(self, params) -> list[nn.Parameter]:
        """The tensors whose gradients clipping (and fp16 unscaling) scales: ``params`` and the pieces."""
        out = [p for p in params if id(p) not in self.managed] + [pc.param for pc in self.pieces]
        return self.tied.clip_targets(out) if self.tied is not None else out

    def remove(self) -> None:
        """Remove every hook."""
        for h in [*self._handles, *self._grad_hooks.values()]:
            h.remove()
        self._handles, self._grad_hooks = [], {}
