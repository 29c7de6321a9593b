"""ZeRO stage 3 over one pipeline stage's data-parallel lanes: parameters sharded, each *unit* gathered before
its forward and its backward and freed after, with uneven, hardware-aware shards (Rajbhandari et al., "ZeRO",
SC 2020; ZeRO-1/2 and the shard sizes: :mod:`whale.parallel.zero`, :mod:`whale.planner.zero`).

Units (what is gathered at once). Without a pipeline the stage module is the user's model: every repeated layer
(each child of a ``ModuleList``/``Sequential`` that holds parameters, e.g. every transformer block:
:func:`whale.memory.checkpointing.repeated_layers`; else every top-level child with parameters) is a unit, and
the rest (embeddings, final norm, a head, parameters used by several units, e.g. an input embedding tied to the
head) form the *root* unit of the stage module. A pipeline stage is a traced graph that reads parameters
directly, not through module calls, so there the whole stage module is one unit.
Each unit's parameters (the stage's replicated ones: not split shards, already cut, and not parameters tied
across stages, whose values stay whole while their gradients and optimizer state are sliced over the tie group
as under ZeRO-2: :attr:`Zero3Shards.tied`, :mod:`whale.parallel.zero_sync`) become views of one flat
buffer; each lane keeps its range of it (sized by free device memory: the plan's ``zero_weights``) in its own
*shard*, and the full buffer's storage exists only while the unit is gathered (layout and collectives:
:mod:`whale.parallel.zero3_unit`).

Per micro-batch (so 1F1B with several micro-batches in flight works: each forward and each backward gathers
again): a forward pre-hook gathers the unit, a forward hook frees it (the root stays gathered from its forward
to its backward, as FSDP2's root, except in a pipeline, where other micro-batches run in between) and hooks
the outputs; the first gradient reaching an output gathers the unit again. The unit is freed once this
backward reads none of its parameters any more: a parameter that requires grad is read last by the op that
makes its gradient, so every one of them must have its gradient; a frozen one (a LoRA base weight, anywhere
in the unit) gives no such signal, so in a unit holding one the call's inputs that need gradients pass through
an identity (:class:`_InputsDone`, as FSDP2's post-backward hook) whose backward runs after every op of the
call that leads to them, and every other op of the unit leads to one of the unit's gradients, already waited
for. So a unit is freed as soon as its backward ends, whatever is frozen in it; the root, which holds the model's other
units, waits with a frozen parameter (e.g. a frozen final norm, needed for the units' gradients) for the end
of the backward, as does a unit with a parameter no path reached. Then the gradients autograd made are copied
into one flat buffer (as FSDP2 does: a buffer allocated up front would hold a unit's whole gradient while its
first parameter's gradient is still being made, e.g. the tied head's), which is reduce-scattered into the
lane's shard gradient (summed over micro-batches; a unit without a parameter that requires grad skips it),
and the unit is freed; the previous reduce-scatter is waited for then, so at most two flat gradient buffers
exist. Which parameters require grad is read at each backward, so freezing or unfreezing between steps works.
A checkpointed unit recomputes in its backward, while gathered for it. After the step's last backward one
all-reduce of "used" flags makes every piece of a parameter no lane used end with ``.grad = None`` (as in one
process; it also carries the lanes' fingerprints of the step's collectives: :mod:`whale.parallel.zero3_check`).
The optimizer steps this lane's *pieces* (views of its shard; the user's
param groups and schedulers kept, as under ZeRO-1/2); nothing is broadcast after the step: the next forward
gathers.

Why Whale's own code and not FSDP2 (``fully_shard``): FSDP2 shards every parameter evenly on dim 0
(``Shard(0)`` DTensors, padded to equal chunks); it cannot give a 32 GB device a larger slice than a 16 GB one,
which is the point of hardware-aware sharding; it also replaces parameters by DTensors, which Whale's split
regions, pipeline stages (traced graphs) and gradient bookkeeping do not expect.

Limits: every lane must call the same units in the same order (same control flow), as for any ZeRO-3: lanes
that do not raise a :class:`Zero3Error` on every rank, naming the units and lanes (in the first steps at the
collective where they part, later at the step's end before the update; :mod:`whale.parallel.zero3_check`); a
unit's parameter must only be read inside that unit's forward (or be left to the root), and a tensor that
needs gradients must reach a unit holding a frozen parameter as an argument of its call (one read from
elsewhere, e.g. an attribute, could let the unit be freed before that parameter's last use), and such a unit
must not modify those arguments in place (autograd refuses in-place changes to a custom function's outputs,
as under FSDP2); one dtype per unit.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from whale.parallel import zero3_unit
from whale.parallel.zero import _Piece, bind_pieces
from whale.parallel.zero3_check import BACKWARD, END_FORWARD, END_STEP, FORWARD, REDUCE, LaneAgreement, Zero3Error
from whale.parallel.zero3_unit import Call, Unit, find_units

__all__ = ["Zero3Error", "Zero3Shards", "find_units"]


class _InputsDone(torch.autograd.Function):
    """Identity on a unit call's inputs that need gradients; its backward runs once every op of the call that
    leads to them has run its backward (so no longer reads the unit's parameters) and calls ``done``."""

    @staticmethod
    def forward(ctx, done, *tensors):
        """The tensors unchanged; remembers ``done``."""
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        """Calls ``done`` and passes the gradients through."""
        ctx.done()
        return (None, *grads)


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
        self.units: list[Unit] = []
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
        self._add("<root>", module, rest, keep=not pipeline, nested=bool(self.units))
        self._index = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        device = self.units[0].flat.device if self.units else torch.device("cpu")
        self.check = LaneAgreement(group, [u.name for u in self.units], self.sources, device)
        self._handles.append(module.register_forward_hook(self._end_forward))
        self._pending: list[tuple] = []
        self._callback_task = None
        self._grad_hooks: dict[int, object] = {}

    # --- building ------------------------------------------------------------------------------------------
    def _add(self, name: str, module: nn.Module, params: list[nn.Parameter], keep: bool, nested=False) -> None:
        """Flatten ``params`` into a new unit gathered around ``module``'s calls (:func:`zero3_unit.make_unit`)."""
        if not params:
            return
        unit, pieces = zero3_unit.make_unit(name, params, self.weights, self.me, len(self.units), keep, nested)
        self.pieces += pieces
        self.units.append(unit)
        self._free(unit)
        self._handles += [module.register_forward_pre_hook(functools.partial(self._pre_forward, unit),
                                                           with_kwargs=True),
                          module.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))]

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """This lane's shard gradients, one per unit (what it holds of the gradients between steps)."""
        return [u.shard_grad for u in self.units] + (self.tied.shard_grads if self.tied is not None else [])

    def shards_to_host(self, pin: bool) -> list[tuple[torch.Tensor, str]]:
        """Keep every unit's shard and shard gradient in host memory (``offload="optimizer+params"``:
        :func:`zero3_unit.shards_to_host`; weights tied across stages stay whole on the device); returns them
        with their host memory categories."""
        for unit in self.units:
            zero3_unit.shards_to_host(unit, self.pieces, self.me, pin)
        return [(u.shard, "host_parameters") for u in self.units] + \
            [(u.shard_grad, "host_gradients") for u in self.units]

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
    def _gather(self, unit: Unit, phase: int | None = None) -> None:
        """Make ``unit``'s parameters whole (collective over the lanes; a no-op when gathered); ``phase``: the
        step's collective to record and check first (:class:`~whale.parallel.zero3_check.LaneAgreement`)."""
        if unit.gathered:
            return
        if phase is not None:
            self.check.before(unit.index, phase)
        zero3_unit.gather(unit, self.group, self.me, self.sources, self.tracker)

    def _free(self, unit: Unit) -> None:
        zero3_unit.free(unit, self.tracker)

    def _pre_forward(self, unit: Unit, module, args, kwargs):
        """Before the unit's forward: gather it; when gradients are on (not a recompute inside backward) and the
        unit holds a frozen parameter, pass the call's inputs that need gradients through :class:`_InputsDone`
        (their backward tells when the call's backward no longer reads the unit's parameters)."""
        self._gather(unit, FORWARD)
        unit.call = None
        if (not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1
                or all(p.requires_grad for p in unit.params)):
            return None
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return None
        call = unit.call = Call()
        for i, t in zip(at, _InputsDone.apply(functools.partial(self._inputs_done, unit, call),
                                              *[leaves[i] for i in at]), strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _post_forward(self, unit: Unit, out) -> None:
        """After the unit's forward: hook its outputs (gather again before their backward) and free it. Inside
        backward (a checkpointed recompute) the unit stays gathered for the backward under way."""
        if torch._C._current_graph_task_id() != -1:
            return
        if torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit, unit.call))
        if not unit.keep:
            self._free(unit)

    def _end_forward(self, module, args, out) -> None:
        """After a forward of the stage module: on the checked steps, every lane must be here too."""
        if torch._C._current_graph_task_id() == -1:
            self.check.before(-1, END_FORWARD)

    def _pre_backward(self, unit: Unit, call: Call | None, grad=None) -> None:
        """A gradient of one of the unit's outputs (of ``call``): gather the unit for its backward (the first)."""
        if not unit.active:
            self._gather(unit, BACKWARD)
            unit.active = True
            unit.arrived.clear()
            unit.open.clear()
            unit.expected = sum(p.requires_grad for p in unit.params)
            unit.hold = unit.nested and unit.expected < len(unit.params)
            task = torch._C._current_graph_task_id()
            if self._callback_task != task:
                self._callback_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if call is not None and not call.done:
            unit.open.add(call)

    def _inputs_done(self, unit: Unit, call: Call) -> None:
        """Every gradient of ``call``'s inputs is made: its ops no longer need the unit."""
        call.done = True
        unit.open.discard(call)
        self._maybe_free(unit)

    def _on_grad(self, p: nn.Parameter) -> None:
        unit, i = self._index[id(p)]
        unit.used[i] = True
        if not unit.active:
            raise Zero3Error(f"ZeRO-3: a gradient reached a parameter of unit {unit.name!r} outside that unit's "
                             "backward (the parameter is read outside the unit's forward); call the module "
                             "instead of reading its parameters, or use Config(zero=2)")
        unit.arrived.add(i)
        self._maybe_free(unit)

    def _maybe_free(self, unit: Unit) -> None:
        """Reduce and free ``unit`` once this backward no longer reads it: every parameter that requires grad
        has its gradient (no op reads those after), and every op reading a frozen one has run: the ops of the
        calls whose inputs need gradients have (their :class:`_InputsDone` ran), and the others lead only to
        those gradients. The root around other units with a frozen parameter waits for the backward's end: its
        ops (e.g. a frozen final norm) also lead to the other units' gradients."""
        if unit.active and not unit.open and not unit.hold and len(unit.arrived) == unit.expected:
            self._post_backward(unit)

    def _post_backward(self, unit: Unit) -> None:
        """Start reduce-scattering the unit's gradients (made by autograd, copied into one flat buffer) into the
        lanes' shards, free the unit; finish the previous reduce-scatter. A unit with no parameter that
        requires grad (frozen on every lane) has nothing to reduce."""
        unit.active = False
        if not unit.expected:
            self._free(unit)
            return
        self.check.before(unit.index, REDUCE)
        out, work, full = zero3_unit.start_reduce(unit, self.group, self.me, len(self.sources))
        self._free(unit)
        self._drain()
        self._pending.append((unit, out, work, full))  # ``full`` stays alive until the collective is done

    def _drain(self) -> None:
        """Wait for the reduce-scatters started and add them to the shard gradients."""
        while self._pending:
            unit, out, work, _ = self._pending.pop(0)
            work.wait()
            unit.shard_grad.add_(out.to(unit.shard_grad.device))  # a host shard gradient under offload

    def _end_backward(self) -> None:
        """End of a backward: reduce the units still gathered for it (some parameter of which got no gradient, or
        held to the end: :meth:`_maybe_free`), in unit order."""
        self._callback_task = None
        for unit in self.units:
            if unit.active:
                self._post_backward(unit)
        self._drain()

    # --- the step ------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Before a step's first backward: hook every parameter that requires grad now (the user may unfreeze
        one between steps); start the step's record of collectives."""
        self.check.start_step()
        for unit in self.units:
            for p in unit.params:
                if p.requires_grad and id(p) not in self._grad_hooks:
                    self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)

    def agree_step(self) -> None:
        """The step's last backward is done: on the checked steps, every lane must be here too (collective; the
        first of the step's end, before any other gradient collective).

        Raises:
            Zero3Error: lanes that called different units (:mod:`whale.parallel.zero3_check`), on every lane.
        """
        self.check.before(-1, END_STEP)

    def finish(self) -> None:
        """After the step's last backward: the pieces get their summed gradients, ``None`` where no lane used
        the parameter (one ``MAX`` all-reduce of the used flags over the lanes, which also compares the lanes'
        fingerprints of the step's collectives).

        Raises:
            Zero3Error: lanes that called different units this step (before any weight changes), on every lane.
        """
        self._drain()
        flags = torch.cat([u.used for u in self.units]).long().tolist() + self.check.fingerprint_pair()
        reduced = torch.tensor(flags, dtype=torch.int64, device=self.units[0].flat.device)  # NCCL: on the device
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.group)
        flags = reduced.tolist()
        self.check.check_fingerprints(flags[-2:])
        self.check.step += 1
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
