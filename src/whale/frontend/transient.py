"""Backward temporaries per layer unit, measured on the profile's fake tensors.

While one micro-batch runs backward a device holds, besides the activations saved for backward, the gradients
of activations flowing between layers and each operation's workspace (for a language model's head, the
gradient of the logits: as large as the logits). :class:`BackwardTransients` is the storage tracker
(:class:`whale.memory.tracker.StorageTracker`, live storage by category; storages of fake tensors have sizes
too) entered around the profile's ``loss.backward()``: it labels each parameter's gradient as ``gradients``
when it is accumulated and records, per unit, the most ``temporaries`` bytes alive while that unit's backward
runs (a gradient hook on the unit's forward outputs names the unit when backward reaches it, so the hooks are
installed before the forward; before the first unit, the loss: ``"<rest>"``).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from whale.memory.tracker import StorageTracker


class BackwardTransients(StorageTracker):
    """Peak ``temporaries`` bytes per unit during backward (see the module docstring).

    Attributes:
        peaks: unit name (or ``"<rest>"``) -> most temporaries bytes alive during its backward (whole batch).
        entry: unit name -> temporaries bytes alive when its backward starts (its outputs' gradients included).
    """

    def __init__(self, units: dict[str, nn.Module], params: list[torch.Tensor], stack: ExitStack) -> None:
        super().__init__()
        self.unit = "<rest>"
        self.peaks: dict[str, int] = dict.fromkeys([*units, "<rest>"], 0)
        self.entry: dict[str, int] = dict.fromkeys([*units, "<rest>"], 0)
        for name, mod in units.items():
            def enter(_g, name=name) -> None:
                """Gradient hook on an output: this unit's backward starts."""
                if self.unit != name:
                    self.unit = name
                    self.entry[name] = self.peaks[name] = self.current["temporaries"]

            def mark(_m, _a, out, enter=enter) -> None:
                """Forward hook: hook the outputs' gradients."""
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(enter)
            stack.callback(mod.register_forward_hook(mark).remove)
        for p in params:
            if p.requires_grad:
                stack.callback(p.register_post_accumulate_grad_hook(lambda t: self.label(t.grad, "gradients"))
                               .remove)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run ``func`` under the tracker, then note the unit's peak of temporaries. An input whose storage the
        tracker has not seen was made before the backward (a saved activation, a parameter: everything the
        backward makes is seen as it is made), so it is not a temporary: without this, a view of it (autograd
        unpacking a saved output with ``detach``) would be counted as a new temporary of its full size."""
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not self.seen(t):
                self.label(t, "activations")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        now = self.current["temporaries"]
        if now > self.peaks[self.unit]:
            self.peaks[self.unit] = now
        return out
