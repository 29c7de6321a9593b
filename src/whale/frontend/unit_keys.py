"""The calibration cache's keys of a model's layer units (:func:`unit_keys`): what the front end needs to read
cached calibration data (:mod:`whale.planner.calibration_cache`) without measuring anything.

A unit's key is :func:`whale.planner.calibration_cache.unit_key` of its class, parameter elements and per-sample
input shapes; the shapes come from one real forward of the model on one row of the sample batch with a
forward pre-hook on every unit (:func:`capture_unit_inputs`). The measuring code (:mod:`whale.calibration.units`)
captures the same way, so the keys it stores are the keys read here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from whale.frontend.hwplan import sample_rows
from whale.frontend.memplan import _inside
from whale.frontend.profile import ModelProfile, default_units
from whale.planner import calibration_cache as cal


def cut_rows(x, rows: int, full: int):
    """The first ``rows`` rows of ``x`` (detached) when it is a tensor of ``full`` rows in dim 0, else ``x``."""
    return x[:rows].detach() if isinstance(x, torch.Tensor) and x.dim() and x.size(0) == full else x


def rows_of(inputs, rows: int, full: int):
    """``inputs`` (any pytree) with every tensor of ``full`` rows cut to its first ``rows`` (:func:`cut_rows`)."""
    return tree_map(lambda x: cut_rows(x, rows, full), inputs)


def capture_unit_inputs(model: nn.Module, names: list[str], inputs) -> dict[str, tuple[tuple, dict]]:
    """Every unit's ``(args, kwargs)`` in one real forward of ``model`` on ``inputs`` (no grad), and the model's
    output under ``"<output>"``."""
    seen: dict[str, tuple[tuple, dict]] = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, k, n=n: seen.setdefault(n, (a, k)) and None, with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            out = model(*inputs) if isinstance(inputs, tuple) else model(**inputs) if isinstance(inputs, dict) \
                else model(inputs)
    finally:
        for h in hooks:
            h.remove()
    seen["<output>"] = ((out,), {})
    return seen


def keys_of(model: nn.Module, names: list[str], seen: dict, loss_fn=None, tracked: bool = False) -> dict[str, str]:
    """Calibration key of each unit in ``names`` from its captured inputs ``seen`` (:func:`capture_unit_inputs`),
    and of the loss under ``"<rest>"``; ``|tracked`` appended with ``tracked``."""
    tail = "|tracked" if tracked else ""

    def shapes(args):
        """Per-sample shapes (batch dim dropped) of the tensors in ``args``."""
        return tuple(tuple(t.shape[1:]) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor))

    out = {}
    for n in names:
        mod = model.get_submodule(n)
        out[n] = cal.unit_key(type(mod), sum(p.numel() for p in mod.parameters()), shapes(seen.get(n, ((), {})))) + tail
    loss_type = type(loss_fn) if loss_fn is not None else type(None)
    out["<rest>"] = cal.unit_key(loss_type, 0, shapes(seen["<output>"])) + tail
    return out


def variant_keys(keys: dict[str, str], precision: str = "fp32", checkpointed: tuple[str, ...] = ()) -> dict[str, str]:
    """The keys of ``keys`` (by unit name) for a unit timed as the plan runs it: ``|bf16`` / ``|fp16`` appended
    under mixed precision (the unit's forward under CPU autocast, on this machine 1.5-2x slower than fp32),
    ``|ckpt`` for a unit inside one of the ``checkpointed`` modules (timed under the runtime's checkpoint wrapper,
    its backward then holding the recompute and the wrapper's fixed cost). The loss (``"<rest>"``) runs in fp32
    outside autocast and is never checkpointed: its key stays."""
    out = {}
    for n, k in keys.items():
        if n == "<rest>":
            out[n] = k
            continue
        out[n] = k + (f"|{precision}" if precision != "fp32" else "") + ("|ckpt" if _inside(n, checkpointed) else "")
    return out


def unit_keys(model: nn.Module, sample_batch, prof: ModelProfile | None = None, loss_fn=None,
              tracked: bool = False) -> dict[str, str]:
    """Calibration key (:func:`whale.planner.calibration_cache.unit_key`) of every profiled unit by name,
    ``"<rest>"`` for the loss (``|tracked`` appended with ``tracked``): one forward on one row of
    ``sample_batch``."""
    names = [u.name for u in (prof.units if prof else ())] or default_units(model)
    seen = capture_unit_inputs(model, names, rows_of(sample_batch[0], 1, sample_rows(sample_batch)))
    return keys_of(model, names, seen, loss_fn, tracked)
