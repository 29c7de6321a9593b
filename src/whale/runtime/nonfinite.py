"""Non-finite losses and gradients, and losses that are not scalars: found on every rank, acted on alike.

A NaN or inf loss or gradient would otherwise be stepped into the weights (a NaN sum of a batch's values
also made the first steps' batch check report "different batches": :func:`whale.runtime.batch.fingerprint`
now sums the finite values). Each training step, before the optimizer step, every rank checks what it holds:

- the losses: :class:`LossCheck` wraps ``loss_fn`` and keeps each micro-batch's loss (a 0-dim tensor, no sync);
  a loss that is not one element is refused there (torch would fail with "only one element tensors can be
  converted to Python scalars" on the last stage only, its peers left waiting): it is replaced by a NaN-valued
  stand-in with zero gradients, so the step completes on every rank and the refusal is found like a NaN loss;
- the gradients (after their reduction, before clipping): one ``torch._foreach_norm(grads, inf)`` over the
  gradients this rank counts in the global norm (each element once over the world), stacked with the losses
  and tested with ``isfinite`` (max-abs norms: exact, no overflow of a sum of squares): one device sync. On
  CPU a plain sum per gradient first, the norm only where a sum is not finite (:func:`_max_abs`).

Cost per step: that one reduction over this rank's share of the gradients, and one flag that rides on a
collective the step makes anyway: under fp16 the loss all-reduce (which carries the scaler's overflow flag),
under clipping the norm all-reduce, otherwise the loss all-reduce when it runs after backward. With the loss
fused into the last gradient bucket (one stage, no split, ZeRO 0/1) no flag is sent: every rank holds the same
reduced gradients and global loss (a NaN or inf survives the sum), so every rank's own check agrees. Only a
pipeline whose stage 0 starts the loss all-reduce during its last backward (no clipping, not fp16) sends one
extra 8-byte all-reduce. When something is found (the rare path), one all-gather of a fixed 2 KiB row per rank
names the first non-finite tensor: the earliest micro-batch's loss, else the gradient nearest the loss in
backward order (the latest stage's last parameter: where the NaN/inf entered backward). Then, per
``Config(nonfinite)``: ``"raise"``: every rank raises :class:`NonFiniteError` before the optimizer step (the
weights and optimizer state are those before the step); ``"skip"``: every rank skips the optimizer step, the
gradients are zeroed, rank 0 warns; the step counts in ``engine.steps_done``. The learning-rate scheduler is the
user's: like ``torch.amp.GradScaler``'s skipped steps, a ``scheduler.step()`` after it still advances.

Under fp16 a gradient inf/NaN with finite losses is the loss scaler's overflow (skipped, scale backed off:
:mod:`whale.runtime.precision`), never raised; a non-finite loss (computed in fp32, unscaled) is not an overflow
the scale can cure and follows the policy. A refused (non-scalar) loss always raises :class:`LossShapeError`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from whale.runtime.batch import tensors
from whale.runtime.fqn_state import model_slots

_SHAPE, _LOSS, _GRAD = 0, 1, 2  # kinds, in order of precedence: the lowest code over the world is named
_SPAN = 2.0 ** 30  # codes: kind * _SPAN + position (exact in float64)
_TEXT = 240  # bytes of a description in the rare path's all-gather
TOKEN_CE_HINT = ("a mean loss is NaN on a micro-batch whose targets are all ignored "
                 "(F.cross_entropy(ignore_index=...)): use wh.token_cross_entropy (token-weighted: such a "
                 "micro-batch adds 0)")


class NonFiniteError(FloatingPointError):
    """A training step's loss or gradient is NaN/inf (``Config(nonfinite="raise")``); raised on every rank before
    the optimizer step. The message names the step, the first non-finite tensor and the fix."""


class LossShapeError(ValueError):
    """``loss_fn`` returned something that is not a one-element tensor; raised on every rank."""


def _max_abs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Max-abs norms (0-dim) of ``grads``: finite exactly where a gradient has no NaN/inf element. On CPU only
    of the gradients whose plain sum is not finite (a NaN or inf element makes the sum NaN or inf; a finite sum
    rules both out, and a sum that overflows is checked exactly): ``_foreach_norm(inf)`` has no fused CPU kernel
    and took ~13 ms for 2 M fp32 elements where the sums take ~0.15 ms (one thread; one more sync, free on CPU).
    """
    if grads and grads[0].device.type == "cpu":
        sums = torch.stack([g.sum() for g in grads]).isfinite().tolist()
        grads = [g for g, ok in zip(grads, sums, strict=True) if not ok]
    return list(torch._foreach_norm(grads, math.inf)) if grads else []


class LossCheck:
    """``loss_fn`` wrapped for the executor: each micro-batch's loss kept for the step's check, a non-scalar
    result refused (see the module docstring).

    Args:
        loss_fn: the user's ``loss_fn(output, target)``.
        where: this rank's place for messages, e.g. ``" of lane 1"`` (``""`` with one lane).
        lane: this rank's data-parallel lane (in the codes: micro-batch ``k`` of lane ``l`` is ``k * 4096 + l``).
    """

    def __init__(self, loss_fn: Callable, where: str, lane: int) -> None:
        self.loss_fn, self.where, self.lane = loss_fn, where, lane
        self.start()

    def start(self) -> None:
        """Forget the previous step's losses (called before each step's schedule)."""
        self.losses: list[torch.Tensor] = []
        self.refused: tuple[float, str] | None = None

    def __call__(self, output, target):
        """The loss of the next micro-batch (a NaN-valued stand-in with zero gradients when refused)."""
        loss = self.loss_fn(output, target)
        mb = len(self.losses)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            if self.refused is None:
                self.refused = (_SHAPE * _SPAN + mb * 4096 + self.lane,
                                f"loss_fn returned {got} for micro-batch {mb}{self.where}")
            loss = _stand_in(loss, output)
        self.losses.append(loss.detach().reshape(()))
        return loss


def _stand_in(loss, output) -> torch.Tensor:
    """NaN, connected to the autograd graph with zero gradients (so every rank's backward completes)."""
    for t in ([loss] if isinstance(loss, torch.Tensor) else []) + tensors(output):
        if t.requires_grad and t.is_floating_point():
            return t.reshape(-1)[:0].sum().float() + math.nan
    return torch.full((), math.nan)


def param_names(module: torch.nn.Module, zero) -> dict[int, str]:
    """``id(tensor) -> FQN in the unannotated model`` for this rank's parameters (a split shard's with its
    position, e.g. ``head.weight (shard 1)``) and, under ZeRO, its pieces (named by their owner)."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    for slot in reversed(model_slots(module)):  # the first of a tied parameter's names wins
        names[id(slot.tensor)] = slot.name + (f" (shard {slot.pos})" if slot.dim is not None else "")
    for shards in (zero, getattr(zero, "tied", None)):
        for pc in getattr(shards, "pieces", ()):
            names[id(pc.param)] = names.get(id(pc.owner), "a tied parameter")
    return names


class NonFiniteGuard:
    """One rank's checks of a step's losses and gradients and the policy's action (module docstring).

    Args:
        policy: ``"raise"`` or ``"skip"`` (``Config.nonfinite``).
        loss_fn: the user's loss (wrapped in :attr:`loss_fn`).
        names: :func:`param_names` of this rank.
        rank, world_size, device: this rank's, for the rare path's all-gather (on the world).
        stage, num_stages, lane: this rank's place (codes and messages).
        lanes: data-parallel lanes of the widest stage (1: messages name no lane).

    Attributes:
        loss_fn: the :class:`LossCheck` the executor calls.
        found: the step's first non-finite tensor when it was skipped, else ``None``.
    """

    def __init__(self, policy: str, loss_fn: Callable, names: dict[int, str], rank: int, world_size: int,
                 device: torch.device, stage: int, num_stages: int, lane: int, lanes: int) -> None:
        self.policy, self.names, self.rank, self.world_size, self.device = policy, names, rank, world_size, device
        self.stage, self.num_stages = stage, num_stages
        self.loss_fn = LossCheck(loss_fn, f" of lane {lane}" if lanes > 1 else "", lane)
        self.found: str | None = None

    def start(self) -> None:
        """Before a step's (or an eval's) schedule."""
        self.loss_fn.start()
        self.found = None

    def local(self, params: list, loss: float | None = None) -> float:
        """1.0 when a gradient of ``params`` or a loss is NaN/inf here, else 0.0 (one device sync).

        ``loss``: the global loss when every rank holds it (then this rank's own losses are not checked),
        ``None``: check this rank's micro-batch losses."""
        if loss is not None and not math.isfinite(loss):
            return 1.0
        grads = [p.grad.detach() for p in params if p.grad is not None]
        values = [n.float().reshape(()) for n in _max_abs(grads)]
        values += [x.float().to(self.device) for x in self.loss_fn.losses] if loss is None else []
        return float(not bool(torch.stack(values).isfinite().all())) if values else 0.0

    def refused(self) -> float:
        """1.0 when this rank refused a loss this step (for eval's all-reduce), else 0.0."""
        return float(self.loss_fn.refused is not None)

    def act(self, params: list, step: int, losses: bool = True) -> None:
        """Collective, on every rank once any rank found something: name the first non-finite tensor over the
        world, then raise, or (``"skip"``) warn on rank 0 and record it in :attr:`found`.

        Args:
            params: the tensors whose gradients this rank checked (``[]``: none, e.g. under fp16).
            step: the step's index (``engine.steps_done`` before it, from 0).
            losses: whether non-finite losses count (``False`` in eval: only a refused loss raises).

        Raises:
            LossShapeError: some rank's ``loss_fn`` returned a non-scalar.
            NonFiniteError: under ``"raise"``, a loss or gradient is NaN/inf.
        """
        code, text = self._first_local(params, losses)
        code, text = self._first_global(code, text)
        kind = int(code // _SPAN) if text else _LOSS  # none found: finite losses summed to inf
        text = text or "the step's loss summed over the ranks is not finite"
        if kind == _SHAPE:
            raise LossShapeError(f"step {step}: {text}; loss_fn must return a scalar (one element): reduce it, "
                                 "e.g. with .mean() over the rows it is given, or use wh.token_cross_entropy for a "
                                 "token-mean loss")
        if kind == _LOSS:
            what = (f"the loss is not finite: {text}. Check the batch for NaN/inf (torch.isfinite(x).all() on "
                    f"the inputs and targets); {TOKEN_CE_HINT}; or the forward overflows (lower the learning rate)")
        else:
            what = (f"a gradient is not finite (the losses are): {text}. Lower the learning rate, or find the op "
                    "whose backward is not finite at these values (sqrt/log/pow near 0, a division by 0): "
                    "torch.autograd.set_detect_anomaly(True) names it")
        if self.policy == "raise":
            raise NonFiniteError(f"step {step}: {what}. The optimizer step was not taken (the weights are those "
                                 "before this step); Config(nonfinite='skip') skips such steps instead")
        self.found = text
        if self.rank == 0:
            warnings.warn(f"whale: step {step} skipped (no optimizer step, gradients zeroed): {what}",
                          RuntimeWarning, stacklevel=6)  # at the caller of engine.step

    def after_eval(self, refused: float, step: int) -> None:
        """Collective when ``refused`` (the world's sum of :meth:`refused`) is > 0: raise LossShapeError on every
        rank (a NaN/inf eval loss is reported, not raised)."""
        if refused > 0:
            self.act([], step, losses=False)

    def metrics(self, skipped: bool, scaler: bool) -> dict:
        """The step's ``"skipped"`` (under fp16 or ``"skip"``) and ``"nonfinite"`` (what a skip named)."""
        out = {"skipped": skipped} if scaler or self.policy == "skip" else {}
        return out | ({"nonfinite": self.found} if self.found is not None else {})

    def _first_local(self, params: list, losses: bool) -> tuple[float, str]:
        """This rank's first non-finite tensor: ``(code, description)``, ``(inf, "")`` when none."""
        check = self.loss_fn
        if check.refused is not None:
            return check.refused
        for mb, loss in enumerate(check.losses if losses else []):
            if not math.isfinite(float(loss)):
                return _LOSS * _SPAN + mb * 4096 + check.lane, f"the loss of micro-batch {mb}{check.where} is " \
                                                               f"{float(loss)}"
        held = [p for p in params if p.grad is not None]
        for i in range(len(held) - 1, -1, -1):  # backward order: the last parameter first
            g = held[i].grad
            if not bool(g.isfinite().all()):
                kinds = [k for k, bad in (("NaN", g.isnan().any()), ("inf", g.isinf().any())) if bool(bad)]
                stage = f" (stage {self.stage})" if self.num_stages > 1 else ""
                code = _GRAD * _SPAN + (self.num_stages - 1 - self.stage) * 2.0 ** 20 + len(held) - 1 - i
                return code, f"the gradient of '{self.names.get(id(held[i]), 'a parameter')}'{stage} holds " \
                             f"{' and '.join(kinds)}"
        return math.inf, ""

    def _first_global(self, code: float, text: str) -> tuple[float, str]:
        """The lowest ``(code, description)`` over the world (ties: the lowest rank); one all-gather."""
        if self.world_size == 1:
            return code, text
        raw = text.encode()[:_TEXT]
        row = torch.zeros(2 + _TEXT, dtype=torch.float64, device=self.device)
        row[0], row[1] = code if math.isfinite(code) else 4 * _SPAN, len(raw)
        row[2: 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row)
        best = min(range(self.world_size), key=lambda r: (float(rows[r][0]), r))
        got = rows[best].cpu()
        return float(got[0]), bytes(int(b) for b in got[2: 2 + int(got[1])]).decode(errors="replace")


def nonfinite_guard(engine, loss_fn: Callable) -> NonFiniteGuard:
    """The guard of ``engine`` (a :class:`whale.Engine` whose module, ZeRO shards and plan are built)."""
    plan, ctx = engine.plan, engine.ctx
    return NonFiniteGuard(ctx.config.nonfinite, loss_fn, param_names(engine.module, engine.zero), ctx.rank,
                          ctx.world_size, ctx.device, engine.stage, plan.num_stages, engine.lane, plan.max_lanes)
