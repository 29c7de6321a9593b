"""One rank's training state as whole tensors keyed by the unannotated model's FQNs, and back.

This is what makes a checkpoint independent of the plan that saved it. A rank holds its pipeline stage's
parameters, some of them as split shards (uneven ``sizes`` along one ``dim``, possibly ``k`` fused blocks) and,
under ZeRO, its optimizer state only for slices of flat buffers (ZeRO-1/2 buckets, ZeRO-3 units; under ZeRO-3
its parameters are whole only inside ``engine.zero.whole()``, which the engine's checkpoint calls wrap around
these functions). :func:`whole_state` turns all of it into

- ``model/<fqn>``: every state-dict entry of the stage under its original name (a tied weight under each of
  its names, as the unannotated model's ``state_dict()`` lists it), whole;
- ``optim/<canonical fqn>/<key>``: each optimizer state entry of each parameter (Adam's ``exp_avg``,
  ``exp_avg_sq``, ``step``), whole. A tied parameter's canonical name is the smallest of its names (in this
  stage, or across stages through :attr:`Plan.shared_params`), the same under every plan.

Split shards are all-gathered over their split group (collective) and ZeRO slices broadcast over their buffer's
group (:mod:`whale.runtime.zero_state`): the gathered tensors are exact copies, so a reload is bitwise. Why
whole tensors and not DCP's ``ShardedTensor``/``DTensor`` chunks: shards are uneven and fused parameters
(q|k|v) are non-contiguous in the whole tensor, which DCP's chunk metadata cannot express; and a different plan
needs different cuts anyway.
:func:`load_whole_state` is the reverse: each rank takes from the whole tensors the slices its new stage,
shard and ZeRO range need (no collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from whale.parallel.bridge import SplitRegion
from whale.parallel.split_ops import all_gather
from whale.parallel.split_state import _fused_parts, _unfuse, declared_layout
from whale.plan.plan import Plan
from whale.runtime.zero_state import piece_ranges, whole_zero_state

MODEL, OPTIM = "model/", "optim/"


class StateMismatchError(RuntimeError):
    """A saved tensor that cannot fill this rank's tensor (missing, or of another shape)."""


@dataclass
class Slot:
    """Where one local tensor lies in its whole tensor.

    Attributes:
        name: FQN in the unannotated model.
        tensor: the local parameter or buffer.
        dim: the dim it is cut along (``None``: it is whole).
        sizes: every group rank's size along ``dim`` (sum: the whole dim).
        pos: this rank's index into ``sizes``.
        parts: fused blocks per shard (1: none).
        group: the split group (for gathering).
    """

    name: str
    tensor: torch.Tensor
    dim: int | None = None
    sizes: tuple[int, ...] = ()
    pos: int = 0
    parts: int = 1
    group: object = None

    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``whole`` (a tensor shaped like the unsharded parameter)."""
        if self.dim is None:
            return whole
        start, size, k = sum(self.sizes[: self.pos]), self.sizes[self.pos], self.parts
        if k == 1:
            return whole.narrow(self.dim, start, size)
        return torch.cat([b.narrow(self.dim, start // k, size // k) for b in whole.chunk(k, self.dim)], self.dim)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every group rank's ``local`` (collective over the split group)."""
        if self.dim is None:
            return local.detach()
        full = all_gather(local.detach(), self.group, self.dim, list(self.sizes), kind="checkpoint")
        return _unfuse(full, self.dim, list(self.sizes), self.parts)


def model_slots(module: nn.Module) -> list[Slot]:
    """One :class:`Slot` per ``module.state_dict()`` entry (tied parameters once per name), in state-dict
    order; split regions' ``<prefix>.sharded.<name>`` entries under their original ``<prefix>.<name>``."""
    regions = [(p, r) for p, r in module.named_modules() if isinstance(r, SplitRegion)]
    layouts = {p: declared_layout(r.sharded) for p, r in regions}
    slots = []
    for key, t in module.state_dict(keep_vars=True).items():
        slot = Slot(key, t)
        for prefix, region in regions:
            head = f"{prefix}.sharded." if prefix else "sharded."
            if key.startswith(head):
                inner = key[len(head):]
                slot.name = f"{prefix}.{inner}" if prefix else inner
                dim, sizes = layouts[prefix].get(inner, (None, ()))
                if isinstance(t, nn.Parameter) and dim is not None:
                    slot.dim, slot.sizes, slot.group = dim, sizes, region.group
                    slot.pos = dist.get_rank(region.group) if region.group is not None else 0
                    slot.parts = _fused_parts(region.sharded, inner)
                break
        slots.append(slot)
    return slots


def canonical_names(slots: list[Slot], plan: Plan) -> dict[int, str]:
    """``id`` of each local parameter -> its canonical FQN: the smallest of all its names (local aliases and,
    for a weight tied across stages, :attr:`Plan.shared_params`)."""
    names: dict[int, set[str]] = {}
    for s in slots:
        if isinstance(s.tensor, nn.Parameter):
            names.setdefault(id(s.tensor), set()).add(s.name)
    for group in names.values():
        for sp in plan.shared_params:
            if group & set(sp.names):
                group |= set(sp.names)
    return {k: min(v) for k, v in names.items()}


def _param_slots(slots: list[Slot]) -> dict[int, Slot]:
    out: dict[int, Slot] = {}
    for s in slots:
        out.setdefault(id(s.tensor), s)
    return out


def _piece_ranges(zero) -> dict[int, tuple[nn.Parameter, int, int]]:
    """Under ZeRO (any stage), :func:`whale.runtime.zero_state.piece_ranges`; else ``{}``."""
    return {} if zero is None else piece_ranges(zero)


def whole_model_state(slots: list[Slot]) -> dict[str, torch.Tensor]:
    """``{"model/<fqn>": whole CPU tensor}`` (collective over each split group; a tied shard gathered once)."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    for s in slots:
        if id(s.tensor) not in done:
            done[id(s.tensor)] = s.gather(s.tensor).cpu().clone()
        out[MODEL + s.name] = done[id(s.tensor)]
    return out


def whole_optim_state(optimizer: torch.optim.Optimizer, slots: list[Slot], plan: Plan,
                      zero=None) -> dict[str, torch.Tensor]:
    """``{"optim/<canonical fqn>/<key>": whole CPU tensor}`` for every optimizer state tensor (collective over
    each split group, and under ZeRO over each bucket's group). Non-tensor state entries are not supported.

    Raises:
        TypeError: an optimizer state entry that is not a tensor.
    """
    by_id, canon = _param_slots(slots), canonical_names(slots, plan)
    out: dict[str, torch.Tensor] = {}
    pieces = _piece_ranges(zero)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in pieces:
                continue
            slot = by_id[id(p)]
            for key, v in optimizer.state.get(p, {}).items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"optimizer state {key!r} of {slot.name} is a {type(v).__name__}; Whale's "
                                    "checkpoints hold tensor state only")
                whole = slot.gather(v) if v.shape == p.shape else v.detach()
                out[f"{OPTIM}{canon[id(p)]}/{key}"] = whole.cpu().clone()
    if zero is not None:
        out.update({OPTIM + key: v for key, v in whole_zero_state(optimizer, zero, canon).items()})
    return out


def optim_requests(optimizer: torch.optim.Optimizer, slots: list[Slot], plan: Plan, saved: dict[str, tuple],
                   zero=None) -> list[tuple[nn.Parameter, str, Callable[[torch.Tensor], torch.Tensor]]]:
    """What this rank's optimizer needs from a checkpoint: ``(parameter, saved key, cut)`` per state entry,
    where ``cut(whole)`` gives the local part. ``saved``: key -> (shape, dtype) of the checkpoint."""
    by_id, canon = _param_slots(slots), canonical_names(slots, plan)
    managed = _piece_ranges(zero)
    wanted = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in managed:
                owner, lo, hi = managed[id(p)]
                slot = by_id[id(owner)]
                cut = (lambda w, lo=lo, hi=hi, p=p: w.reshape(-1)[lo:hi].view_as(p))
            else:
                slot = by_id[id(p)]
                cut = slot.cut
            prefix = f"{OPTIM}{canon[id(slot.tensor)]}/"
            for key, (shape, _) in saved.items():
                if key.startswith(prefix) and "/" not in key[len(prefix):]:
                    whole_shaped = len(shape) > 0
                    wanted.append((p, key, cut if whole_shaped else (lambda w: w)))
    return wanted


def check_model_shapes(slots: list[Slot], saved: dict[str, tuple], where: str) -> None:
    """Refuse a checkpoint that lacks one of this rank's tensors or holds it in another whole shape.

    Raises:
        StateMismatchError: naming the first missing/misshapen FQNs, the shapes and ``where``.
    """
    missing = [s.name for s in slots if MODEL + s.name not in saved]
    if missing:
        raise StateMismatchError(f"checkpoint {where} has no tensor for {missing[:5]} ({len(missing)} missing): "
                                 "it was saved from another model (or another version of it); load it into the "
                                 "model it was trained with")
    for s in slots:
        shape = tuple(saved[MODEL + s.name][0])
        local = tuple(s.cut(torch.empty(shape, device="meta")).shape)
        if local != tuple(s.tensor.shape):
            raise StateMismatchError(f"checkpoint {where} holds {s.name} as {list(shape)}, which does not fit "
                                     f"this model's {list(s.tensor.shape)} (after sharding); build the model with "
                                     "the sizes it was trained with")


@torch.no_grad()
def load_whole_state(slots: list[Slot], optimizer: torch.optim.Optimizer, plan: Plan,
                     read: Callable[[dict[str, torch.Tensor]], None], saved: dict[str, tuple], where: str,
                     zero=None) -> None:
    """Fill this rank's parameters, buffers and optimizer state from whole tensors.

    Args:
        slots: :func:`model_slots` of the stage module.
        read: fills a ``{key: preallocated whole tensor}`` request in place (DCP load).
        saved: every key of the checkpoint -> ``(shape, dtype)``.
        where: the checkpoint's path, for messages.

    Raises:
        StateMismatchError: see :func:`check_model_shapes`.
    """
    check_model_shapes(slots, saved, where)
    opt = optim_requests(optimizer, slots, plan, saved, zero)
    request: dict[str, torch.Tensor] = {}
    for key in {MODEL + s.name for s in slots} | {k for _, k, _ in opt}:
        shape, dtype = saved[key]
        request[key] = torch.empty(shape, dtype=dtype)
    read(request)
    for s in slots:
        s.tensor.detach().copy_(s.cut(request[MODEL + s.name]))
    optimizer.state.clear()
    for p, key, cut in opt:
        part = cut(request[key])
        value = part.clone() if part.dim() == 0 else part.to(p.device).clone(memory_format=torch.contiguous_format)
        optimizer.state.setdefault(p, {})[key.rsplit("/", 1)[1]] = value
