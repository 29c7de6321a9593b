"""Buffers under activation checkpointing: a recompute sees them, and leaves them, as if it never ran.

Why: ``torch.utils.checkpoint`` runs a checkpointed forward a second time in backward, and restores only the
random generators for it. A forward that updates a buffer in place (BatchNorm's ``running_mean``,
``running_var`` and ``num_batches_tracked``, a user's step counter, an EMA of the inputs) would update it twice,
so the model's buffers (and its eval loss) would differ from one process; and a forward that reads such a
buffer would recompute from the updated value instead of the one the first forward saw.

How, per checkpointed call (:class:`BufferWatch`, one per checkpointed module or stage sub-graph):

- before the first forward, the buffers this module updates are copied (:meth:`BufferWatch.begin`);
- during the recompute each of them is *replaced* by a fresh copy of that value (:meth:`BufferWatch.replay`):
  the recompute computes exactly what the first forward did and updates only the copies, which are dropped;
  afterwards the module's own buffer objects are put back untouched, holding what they hold then (under 1F1B
  that includes the updates of later micro-batches' forwards). Replacing rather than copying values in and out
  keeps the tensors the recompute saved for backward from changing under it, and keeps every buffer's identity
  and version counter, so :class:`whale.runtime.buffers.BufferSync` sees each forward's update once.

Which buffers: learned per module. Its first checkpointed call copies all its buffers and keeps the ones the
forward changed (version counter, or value); later calls copy only those: for BatchNorm a few numbers per
channel, held from forward to backward. A buffer a module first changes in a later call (say, only every 100
steps) is learned then; for that one call the recompute starts from its updated value (its own value is still
left as one forward made it). Buffers are found through the module's ``_buffers`` (under ``torch.export`` a
stage sub-graph reaches them by ``get_attr``, registered as its buffers): an update of a tensor that is not a
buffer of the checkpointed module is not covered.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _slots(owner: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every buffer slot under ``owner``: ``"<module path>.<name>"`` -> ``(module, name)``."""
    return {f"{path}.{name}" if path else name: (m, name)
            for path, m in owner.named_modules() for name, b in m._buffers.items() if b is not None}


def _mark(t: torch.Tensor) -> tuple[int, int]:
    """Identity and version of a tensor (inference tensors keep no version: -1)."""
    try:
        return id(t), t._version
    except RuntimeError:
        return id(t), -1


@dataclass
class Call:
    """One checkpointed call: the slots, the values learned buffers held before its forward (``before``), the
    marks of every buffer then, and (after the forward) the slots it changed."""

    slots: dict[str, tuple[nn.Module, str]]
    before: dict[str, torch.Tensor]
    marks: dict[str, tuple[int, int]]
    changed: set[str] = field(default_factory=set)


class BufferWatch:
    """The buffers of ``owner`` around each checkpointed call (see the module docstring).

    Attributes:
        owner: the checkpointed module (or stage sub-graph) whose buffers (its own and its submodules') count.
        learned: the buffer keys (``"<module path>.<name>"``) its forward has changed so far; ``None``
            before its first call.
    """

    def __init__(self, owner: nn.Module) -> None:
        self.owner = owner
        self.learned: set[str] | None = None

    @torch.no_grad()
    def begin(self) -> Call:
        """Before a first forward: copy the learned buffers (all of them on the first call)."""
        slots = _slots(self.owner)
        tensors = {k: m._buffers[n] for k, (m, n) in slots.items()}
        keep = tensors if self.learned is None else {k: t for k, t in tensors.items() if k in self.learned}
        return Call(slots, {k: t.clone() for k, t in keep.items()}, {k: _mark(t) for k, t in tensors.items()})

    @torch.no_grad()
    def end(self, call: Call) -> None:
        """After a first forward: find what it changed, learn it, and drop the copies not needed."""
        for k, (m, n) in call.slots.items():
            t = m._buffers.get(n)
            old = call.before.get(k)
            if t is None:
                continue
            if _mark(t) != call.marks[k] or (old is not None and not (t.shape == old.shape and torch.equal(t, old))):
                call.changed.add(k)
        self.learned = (self.learned or set()) | call.changed
        call.before = {k: v for k, v in call.before.items() if k in self.learned}

    @contextmanager
    def replay(self, call: Call):
        """Around the recompute of ``call``: its buffers replaced by copies of their values before its forward
        (of their current values where none was kept), the module's own put back afterwards (also when the
        recompute stops early, as ``torch.utils.checkpoint`` does once it has what backward needs)."""
        keys = sorted(set(call.before) | call.changed)
        originals = {k: call.slots[k][0]._buffers.get(call.slots[k][1]) for k in keys}
        copies: dict[int, torch.Tensor] = {}  # one copy per tensor: aliases stay aliases
        with torch.no_grad():
            for k in keys:
                m, n = call.slots[k]
                current = originals[k]
                if current is None:
                    continue
                if id(current) not in copies:
                    copies[id(current)] = call.before.get(k, current).clone()
                m._buffers[n] = copies[id(current)]
        try:
            yield
        finally:
            for k in keys:
                m, n = call.slots[k]
                m._buffers[n] = originals[k]
