"""Pipeline stages hold the model's state dict entries, exactly: each persistent buffer and parameter once, read by
forward or not, and nothing else.

A stage module is a ``GraphModule`` that holds what its graph reads (``torch.fx`` and ``torch.export`` alike),
which leaves two gaps between the stages' state dicts and the model's:

- **Unread tensors.** A persistent buffer or a parameter that forward never reads (a frozen table, a buffer kept
  for later, an unused head, the unread name of a tied tensor) is in no graph, so no stage held it:
  ``full_state_dict()`` and checkpoints lacked it and a strict ``load_state_dict`` of them failed.
- **Persistence.** A ``GraphModule`` registers every tensor it reads as a persistent buffer, so a non-persistent
  buffer (a causal mask, a rotary table) or a plain tensor attribute entered the stage's state dict, which a
  strict load into the model then refused as an unexpected key.

:func:`complete_state` closes both, in place, from the model and the stage modules alone (so every rank, and the
front end recording the plan's stage cut, does the same): each model entry no stage holds is registered, as the
model's very tensor, in one stage under its own name: the stage holding the same tensor under another name (so
its value is the one that stage updates), else the stage its annotation gives it (at the front end; the plan's
cut records it for the runtime), else the lowest stage holding a tensor of its nearest enclosing module, else
stage 0. A parameter stays a
parameter of that stage (its optimizer steps it as one process would: frozen or without a gradient, not at
all). A stage buffer is persistent exactly when the model's buffer of that name is.
"""

from __future__ import annotations

import torch
from torch import nn


def model_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model.state_dict()`` by name: every parameter and persistent buffer, tied ones under
    each name (``_extra_state`` and custom state-dict hooks are not covered)."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for path, mod in model.named_modules(remove_duplicate=False):
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{path}.{name}" if path else name] = b
    return out


def _held(stage: nn.Module) -> dict[str, torch.Tensor]:
    return dict(stage.named_parameters(remove_duplicate=False)) | dict(stage.named_buffers(remove_duplicate=False))


def _home(name: str, tensor: torch.Tensor, held: list[dict[str, torch.Tensor]], home: dict[str, int]) -> int:
    """The stage to hold the unheld entry ``name`` (see the module docstring)."""
    alias = next((s for s, h in enumerate(held) if any(t is tensor for t in h.values())), None)
    if alias is not None:
        return alias
    if 0 <= home.get(name, -1) < len(held):
        return home[name]
    parts = name.split(".")[:-1]
    while parts:
        prefix = ".".join(parts) + "."
        stage = next((s for s, h in enumerate(held) if any(n.startswith(prefix) for n in h)), None)
        if stage is not None:
            return stage
        parts.pop()
    return 0


def _container(stage: nn.Module, path: list[str], originals: set[int]) -> nn.Module | None:
    """The stage's module at ``path``, made (an empty ``nn.Module``) where missing; ``None`` when the path runs
    into one of the model's own modules (which holds all its tensors already: nothing to add there)."""
    mod = stage
    for item in path:
        child = mod._modules.get(item)
        if child is None:
            child = nn.Module()
            mod.add_module(item, child)
        mod = child
        if id(mod) in originals:
            return None
    return mod


def complete_state(model: nn.Module, stages: list[nn.Module], home: dict[str, int] | None = None) -> None:
    """Make the stages' state dicts together hold exactly ``model.state_dict()``'s entries (see the module
    docstring), in place.

    Args:
        model: the full model.
        stages: the pipeline's stage modules over ``model``'s tensors (a
            :class:`~whale.frontend.export.ModalStage` is completed through its train graph, whose containers
            it shares).
        home: tensor FQN -> stage, where known: the annotations' (front end) or the plan's cut (runtime), so
            both place an unread tensor alike.
    """
    entries = model_entries(model)
    originals = {id(m) for m in model.modules()}
    roots = [getattr(s, "_whale_train", s) for s in stages]
    held = [_held(s) for s in stages]
    for name, tensor in entries.items():
        if any(name in h for h in held):
            continue
        s = _home(name, tensor, held, home or {})
        *path, field = name.split(".")
        mod = _container(roots[s], path, originals)
        if mod is None:
            continue
        if isinstance(tensor, nn.Parameter):
            mod.register_parameter(field, tensor)
        else:
            mod.register_buffer(field, tensor)
        held[s][name] = tensor
    for root in roots:  # persistent exactly when the model's buffer of that name is
        for path, mod in root.named_modules(remove_duplicate=False):
            if id(mod) in originals:
                continue
            for field in mod._buffers:
                if (f"{path}.{field}" if path else field) not in entries:
                    mod._non_persistent_buffers_set.add(field)
