"""Per-module FLOPs and memory without real compute, for the hardware-aware planner (the Whale paper's §3.3).

:func:`profile_model` runs one forward + backward of the model on *fake* tensors (``FakeTensorMode``, CPU
device; nothing is allocated or computed) or on the meta device, under ``torch.utils.flop_counter``, and
reports for each "layer unit" (a module FQN):

- forward and backward FLOPs per sample (matmul, conv and attention ops, as FlopCounterMode counts them;
  elementwise ops, norms and softmax count 0);
- parameter, gradient, optimizer-state and buffer bytes (tied parameters counted once, in the first unit
  that holds them);
- activation bytes per sample: bytes of the tensors autograd saves for backward while the unit's forward
  runs (seen through ``saved_tensors_hooks``), each storage counted once, in the first unit that saves it,
  parameters and buffers excluded. This is what the unit keeps alive per micro-batch until its backward
  (transient forward temporaries and the backward's own workspace are not included);
- output bytes per sample (what a pipeline stage boundary would send).

Attention. On CPU, ``F.scaled_dot_product_attention`` dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``..._backward``), which FlopCounterMode counts as 0
in torch 2.13; :data:`CPU_SDPA_FLOP_FORMULAS` adds them. On the meta device SDPA takes the math path and
decomposes into two ``bmm`` (forward) and four (backward), which FlopCounterMode counts already. To make
both paths agree, the CPU formulas count *model* FLOPs: forward 4·b·h·s_q·s_k·d (``sdpa_flop_count``),
backward 2x forward — without the recomputation of QK^T that torch's formulas for the fused GPU kernels add.
Causal masking is not discounted (the usual Kaplan et al. 2020 accounting: training = 6N + 12·L·T·d per
token).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten, tree_map

from whale.frontend.transient import BackwardTransients

aten = torch.ops.aten


class ProfileError(ValueError):
    """The model or its inputs cannot be profiled; the message names the unit, input or setting at fault."""


def _sdpa_cpu_fwd(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu``: QK^T and AV, 2 FLOPs per multiply-add."""
    return flop_counter.sdpa_flop_count(query, key, value)


def _sdpa_cpu_bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``..._for_cpu_backward``: dV, dP, dQ, dK = 2x forward (model FLOPs, no recompute)."""
    return 2 * flop_counter.sdpa_flop_count(query, key, value)


CPU_SDPA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
}
"""FlopCounterMode ``custom_mapping`` for CPU SDPA (shape-based formulas, like torch's own)."""


def register_cpu_sdpa_flop_formulas() -> None:
    """Add :data:`CPU_SDPA_FLOP_FORMULAS` to torch's global flop registry, so every ``FlopCounterMode`` made
    afterwards counts CPU SDPA. Idempotent; ops torch already counts are left alone."""
    for op, f in CPU_SDPA_FLOP_FORMULAS.items():
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(f)


def flop_counter_mode(**kwargs: Any) -> flop_counter.FlopCounterMode:
    """A ``FlopCounterMode`` (display off) that also counts CPU SDPA (see :data:`CPU_SDPA_FLOP_FORMULAS`)."""
    mapping = {**CPU_SDPA_FLOP_FORMULAS, **kwargs.pop("custom_mapping", {})}
    return flop_counter.FlopCounterMode(display=kwargs.pop("display", False), custom_mapping=mapping, **kwargs)


@dataclass(frozen=True)
class InputSpec:
    """Shape (without the batch dimension) and dtype of one positional model input."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class UnitProfile:
    """Costs of one layer unit. FLOPs and activation/output bytes are per sample; the rest per model copy.

    Attributes:
        name: module FQN (``"<rest>"`` for work outside every unit: the root's own ops and the loss).
        forward_flops, backward_flops: FLOPs per sample.
        param_bytes, grad_bytes, optimizer_state_bytes, buffer_bytes: bytes.
        activation_bytes: bytes saved for backward per sample.
        output_bytes: bytes of the unit's outputs per sample.
        transient_bytes: most bytes of backward temporaries per sample alive while the unit's backward runs
            (gradients of activations, workspaces; :mod:`whale.frontend.transient`), counted from the whole
            model's backward start; ``entry_bytes``: those alive when the unit's backward starts.
        frontier_bytes: bytes per sample of the outputs of the unit's modules that hold parameters directly
            (a Linear, a LayerNorm): the gradients a zero-bubble B pass keeps there for its W pass
            (:mod:`whale.parallel.weight_grad`).
    """

    name: str
    forward_flops: float
    backward_flops: float
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    activation_bytes: float
    output_bytes: float
    transient_bytes: float = 0.0
    entry_bytes: float = 0.0
    frontier_bytes: float = 0.0

    @property
    def train_flops(self) -> float:
        """Forward + backward FLOPs per sample."""
        return self.forward_flops + self.backward_flops

    @property
    def static_bytes(self) -> int:
        """Params + grads + optimizer state + buffers, bytes (independent of the batch)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes + self.buffer_bytes


@dataclass(frozen=True)
class ModelProfile:
    """Per-unit costs in model order, plus ``rest`` (work and state outside every unit).

    Attributes:
        units: one :class:`UnitProfile` per unit, in the order given (default: model order).
        rest: costs outside the units (root's own parameters and ops, the loss).
        batch_size: batch the profile ran with (costs are divided by it).
        device: ``"cpu"`` (fake tensors) or ``"meta"``.
    """

    units: tuple[UnitProfile, ...]
    rest: UnitProfile
    batch_size: int
    device: str

    def _sum(self, attr: str) -> float:
        return sum(getattr(u, attr) for u in (*self.units, self.rest))

    @property
    def forward_flops(self) -> float:
        """Whole-model forward FLOPs per sample (units + rest)."""
        return self._sum("forward_flops")

    @property
    def backward_flops(self) -> float:
        """Whole-model backward FLOPs per sample (units + rest)."""
        return self._sum("backward_flops")

    @property
    def train_flops(self) -> float:
        """Whole-model forward + backward FLOPs per sample."""
        return self.forward_flops + self.backward_flops

    @property
    def static_bytes(self) -> int:
        """Whole-model params + grads + optimizer state + buffers, bytes."""
        return int(self._sum("static_bytes"))

    @property
    def activation_bytes(self) -> float:
        """Whole-model activation bytes saved per sample."""
        return self._sum("activation_bytes")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"units": [asdict(u) for u in self.units], "rest": asdict(self.rest),
                "batch_size": self.batch_size, "device": self.device}


def default_units(model: nn.Module) -> list[str]:
    """The model's layer units: containers (``ModuleList``/``Sequential``/``ModuleDict``) are opened, so each of
    their entries is a unit; a non-container child that directly holds a container (a "trunk" such as
    ``transformer`` holding ``h``) is opened too, unless it is itself an entry of a container; every other
    child is a unit. E.g. ``[wte, wpe, blocks.0, ..., blocks.11, ln_f]``. A model with no children is one
    unit, ``""``."""
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

    def walk(mod: nn.Module, prefix: str, in_container: bool) -> list[str]:
        """Unit names under ``mod`` (recursive walk)."""
        out = []
        for name, child in mod.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, containers):
                out += walk(child, f"{fqn}.", True)
            elif not in_container and any(isinstance(c, containers) for c in child.children()):
                out += walk(child, f"{fqn}.", False)
            else:
                out.append(fqn)
        return out

    return walk(model, "", isinstance(model, containers)) or [""]


def _resolve_units(model: nn.Module, units: Sequence[str] | None) -> dict[str, nn.Module]:
    names = list(units) if units is not None else default_units(model)
    mods = dict(model.named_modules())
    out = {}
    for u in names:
        if u not in mods:
            close = difflib.get_close_matches(u, list(mods), n=3)
            raise ProfileError(f"unit {u!r} is not a module of {type(model).__name__}; closest: {close}")
        out[u] = mods[u]
    for a in names:
        for b in names:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise ProfileError(f"units must not nest, but {b!r} is inside {a!r}; list one or the other")
    if len(out) != len(names):
        raise ProfileError(f"units are listed more than once: {names}")
    return out


def _state_bytes(model: nn.Module, units: dict[str, nn.Module], opt_factor: float) -> dict[str, list[int]]:
    """[param, grad, optimizer-state, buffer] bytes per unit and ``"<rest>"``; shared tensors counted once."""
    seen: set[int] = set()
    out: dict[str, list[int]] = {}
    for name, mod in [*units.items(), ("<rest>", model)]:
        p = g = b = 0
        for t in mod.parameters():
            if id(t) not in seen:
                seen.add(id(t))
                nb = t.numel() * t.element_size()
                p += nb
                g += nb if t.requires_grad else 0
        for t in mod.buffers():
            if id(t) not in seen:
                seen.add(id(t))
                b += t.numel() * t.element_size()
        out[name] = [p, g, int(opt_factor * g), b]
    return out


def _make_inputs(inputs: Callable[[int], Any] | Sequence[InputSpec], batch_size: int, device: str,
                 fake_mode: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` as fake (or meta) tensors; real tensors the callable returns are converted (no copy).
    A callable may return a tensor, a tuple of positional inputs or a dict of keyword inputs."""
    if callable(inputs):
        args = inputs(batch_size)
    else:
        args = tuple(torch.zeros((batch_size, *s.shape), dtype=s.dtype, device=device) for s in inputs)

    def convert(x: Any) -> Any:
        """Real tensor -> fake/meta stand-in."""
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor) or x.device.type == "meta":
            return x
        return fake_mode.from_tensor(x) if fake_mode is not None else x.to("meta")

    if isinstance(args, dict):
        return (), tree_map(convert, args)
    return tree_map(convert, args if isinstance(args, tuple) else (args,)), {}


class _Recorder:
    """Forward hooks on the units + saved-tensor hooks: activation and output bytes per unit (whole batch)."""

    def __init__(self, units: dict[str, nn.Module], static: list[torch.Tensor]) -> None:
        self.units = units
        self.stack: list[str] = ["<rest>"]
        self.seen = {t.untyped_storage()._cdata for t in static}
        self.act = dict.fromkeys([*units, "<rest>"], 0)
        self.out = dict.fromkeys([*units, "<rest>"], 0)
        self.front = dict.fromkeys([*units, "<rest>"], 0)
        self.order: dict[str, None] = {}  # units in the order forward first calls them

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Saved-tensor hook: count the bytes autograd keeps for backward."""
        st = t.untyped_storage()
        if st._cdata not in self.seen:
            self.seen.add(st._cdata)
            self.act[self.stack[-1]] += st.nbytes()
        return t

    def hooks(self, stack: ExitStack, model: nn.Module) -> None:
        """Install the per-unit forward hooks on ``stack``, after those of ``model``'s modules holding parameters
        (registered first, so they run while their unit is still entered)."""
        def front(_m, _a, out) -> None:
            """Forward hook of a module holding parameters: its outputs' bytes (a W pass's frontier)."""
            self.front[self.stack[-1]] += _nbytes(out)

        for mod in model.modules():  # not the root's own (a position table): its output is the model's
            if mod is not model and any(p.requires_grad for p in mod.parameters(recurse=False)):
                stack.callback(mod.register_forward_hook(front).remove)
        for name, mod in self.units.items():
            def pre(_m, _a, name=name) -> None:
                """Forward pre-hook: enter the unit."""
                self.stack.append(name)
                self.order.setdefault(name)

            def post(_m, _a, out, name=name) -> None:
                """Forward hook: leave the unit."""
                self.stack.pop()
                self.out[name] += _nbytes(out)

            stack.callback(mod.register_forward_pre_hook(pre).remove)
            stack.callback(mod.register_forward_hook(post).remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t))


def _nbytes(out) -> int:
    """Bytes of the tensors in ``out`` (any nesting)."""
    return sum(x.numel() * x.element_size() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))


def _run(model, units, params, inputs, batch_size, device, loss_fn, fake_mode):
    """One forward (+ loss) and backward under FlopCounterMode; returns (counts_fwd, counts_all, recorder)."""
    with ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(torch.device(device))
        fakes = {k: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).requires_grad_(t.requires_grad)
                 for k, t in params.items()}
        args, kwargs = _make_inputs(inputs, batch_size, device, fake_mode)
        rec = _Recorder(units, list(fakes.values()))
        transients = BackwardTransients(units, list(fakes.values()), stack)
        counter = stack.enter_context(flop_counter_mode())
        with ExitStack() as fwd:
            rec.hooks(fwd, model)
            out = torch.func.functional_call(model, fakes, args, kwargs, tie_weights=True)
            loss = loss_fn(out, *args, *kwargs.values()) if loss_fn is not None else sum(
                x.float().sum() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.requires_grad)
        forward_counts = counter.get_flop_counts()
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ProfileError("the loss does not require grad: no backward to profile (give loss_fn, check "
                               "that parameters require grad)")
        with transients:
            loss.backward()
        rec.transient, rec.entry = transients.peaks, transients.entry
    return forward_counts, counter.get_flop_counts(), rec


def profile_model(model: nn.Module, inputs: Callable[[int], Any] | Sequence[InputSpec], *, batch_size: int = 2,
                  loss_fn: Callable[..., torch.Tensor] | None = None, units: Sequence[str] | None = None,
                  optimizer_state_factor: float = 2.0, device: str = "cpu") -> ModelProfile:
    """Profile one training step of ``model`` without real compute or memory (see the module docs).

    Args:
        model: any module, on any device (or meta); it is not modified and its data is never read.
        inputs: ``inputs(batch_size)`` returning the positional input(s), called where factory functions make
            fake/meta tensors (e.g. ``lambda b: torch.randint(0, V, (b, T))``; real tensors it returns are
            turned into fake/meta ones, values unread); or per-sample :class:`InputSpec` shapes.
        batch_size: samples in the profiled batch; results are divided by it.
        loss_fn: ``loss_fn(output, *inputs) -> scalar``; default: sum of the floating outputs.
        units: module FQNs to report (disjoint); default :func:`default_units`.
        optimizer_state_factor: optimizer-state bytes per gradient byte (AdamW: 2, exp_avg + exp_avg_sq).
        device: ``"cpu"`` (fake CPU tensors; SDPA takes the CPU flash kernel) or ``"meta"`` (SDPA math path).

    Returns:
        :class:`ModelProfile` with per-sample FLOPs and activation bytes per unit.

    Raises:
        ProfileError: unknown or nested units, bad device or batch size, a loss without grad, or a model
            whose forward reads tensor values (data-dependent control flow cannot run on fake/meta tensors).
    """
    if device not in ("cpu", "meta"):
        raise ProfileError(f"device must be 'cpu' (fake tensors) or 'meta', got {device!r}")
    if batch_size < 1:
        raise ProfileError(f"batch_size must be >= 1, got {batch_size}")
    unit_mods = _resolve_units(model, units)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if device == "cpu" else None
    try:
        fwd, total, rec = _run(model, unit_mods, params, inputs, batch_size, device, loss_fn, fake_mode)
    except (RuntimeError, NotImplementedError) as e:
        raise ProfileError(
            f"profiling {type(model).__name__} on {device!r} {'fake' if fake_mode else 'meta'} tensors failed: {e} "
            "(a forward that reads tensor values, e.g. .item() or data-dependent shapes, cannot be profiled)"
        ) from e
    state = _state_bytes(model, unit_mods, optimizer_state_factor)
    root = type(model).__name__

    def flops(counts: dict, key: str) -> int:
        """FLOPs counted for one unit."""
        return sum(counts.get(key, {}).values())

    def unit(name: str, key: str | None) -> UnitProfile:
        """Profile entry of one unit."""
        if key is None:  # rest = everything minus the units
            f = flops(fwd, "Global") - sum(flops(fwd, f"{root}.{u}") for u in unit_mods)
            a = flops(total, "Global") - sum(flops(total, f"{root}.{u}") for u in unit_mods)
        else:
            f, a = flops(fwd, key), flops(total, key)
        per = [rec.act[name], rec.out[name], rec.transient.get(name, 0), rec.entry.get(name, 0), rec.front[name]]
        return UnitProfile(name, f / batch_size, (a - f) / batch_size, *state[name], *(x / batch_size for x in per))

    # in the order forward calls them (a rotary embedding registered last but called first comes first), so
    # contiguous runs of units are what a pipeline stage can run
    order = [u for u in rec.order if u in unit_mods] + [u for u in unit_mods if u not in rec.order]
    units_out = tuple(unit(u, f"{root}.{u}" if u else "Global") for u in order)
    rest = unit("<rest>", None) if "" not in unit_mods else UnitProfile("<rest>", 0, 0, 0, 0, 0, 0, 0, 0)
    return ModelProfile(units_out, rest, batch_size, device)
