"""Executor of a schedule (see :mod:`whale.plan.schedule`) for one rank: one stage of one lane.

With one stage, the same executor is plain gradient accumulation: ``F0 B0 F1 B1 ...``. The static facts of the
rank (:class:`StageLinks`, the module, the loss) live in the :class:`StageExecutor`; one step's input is a
:class:`MicroBatches`, its output a :class:`StepResult`, and what is in flight during the step (activations
awaiting backward, posted receives, pending sends) lives in a private per-step state that starts empty.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from whale.parallel import p2p, weight_grad
from whale.parallel.rowbridge import join, slice_for
from whale.parallel.stage_links import StageLinks
from whale.plan.layout import Peer
from whale.plan.schedule import Action


@dataclass(frozen=True)
class MicroBatches:
    """One step's work for this rank, per micro-batch.

    Attributes:
        inputs: the model's forward arguments (stage 0 only; empty elsewhere): a tuple of positional arguments,
            or a dict of keyword arguments.
        targets: the loss targets (last stage only).
        scales: the weight of each micro-batch's loss in the global loss: ``rows / global_batch`` for a
            per-sample mean, ``1 / terms of the global batch`` for a token-weighted sum.
        metric_fns: eval only, ``{name: fn(output, target)}``, each a mean over the rows it is given.
        metric_scales: ``rows / global_batch`` per micro-batch (metrics are per-sample means); defaults to
            ``scales``.
        recv_from, send_to: the lanes of the previous / next stage this lane exchanges rows with, each with
            the rows they share (:meth:`whale.plan.layout.PlanLayout.boundary_peers`; empty at the ends).
        rows: this lane's rows in each micro-batch.
        bridged: the neighbouring stages differ in width, so boundary values are re-split by rows
            (:mod:`whale.parallel.rowbridge`); otherwise they pass whole to the one peer.
    """

    inputs: list
    targets: list
    scales: list[float]
    metric_fns: dict = field(default_factory=dict)
    metric_scales: list[float] | None = None
    recv_from: tuple[Peer, ...] = ()
    send_to: tuple[Peer, ...] = ()
    rows: int = 0
    bridged: bool = False


@dataclass
class StepResult:
    """What one step measured on this rank.

    Attributes:
        busy: seconds of compute (forward and backward segments).
        loss_sum: last stage: sum of the scaled micro-batch losses (0 elsewhere, or on a rank that does not
            report it).
        metric_sums: eval: per metric, the scaled sum like ``loss_sum``.
        timeline: per action ``(label, start, compute_start, compute_end)`` in seconds from the start of the
            step (``start`` includes waiting for inputs).
    """

    busy: float = 0.0
    loss_sum: float = 0.0
    metric_sums: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)


@dataclass
class _InFlight:
    """Per-step state: activations awaiting backward, the posted receive of the next inputs, pending sends."""

    live: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)  # zero-bubble: per micro-batch, what its W pass differentiates
    next_inputs: dict = field(default_factory=dict)  # per chunk, the posted receives of its next inputs
    sent_meta: dict = field(default_factory=dict)  # per receiver, this step's first transfer's description
    sends: list = field(default_factory=list)
    segment: tuple = (0.0, 0.0)
    handoff: dict = field(default_factory=dict)  # (model chunk, mb) -> inputs handed over on this rank


@dataclass(frozen=True)
class _LocalGrads:
    """The gradients of outputs handed to the next chunk on the same rank: its input leaves' ``.grad`` after its
    backward (zeros where autograd left none), in the order :func:`whale.parallel.p2p.post_grads` would post."""

    leaves: tuple

    def grads(self) -> list[torch.Tensor]:
        """The gradient of each handed-over tensor that requires one (same shape as the tensor; zeros where the
        next chunk's backward left no gradient), in the order the outputs were handed over."""
        return [v.grad if v.grad is not None else torch.zeros_like(v) for v in self.leaves
                if isinstance(v, torch.Tensor) and v.requires_grad]


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _shapes(values: tuple) -> tuple:
    """What sets a segment's work: tensor shapes and dtypes, and plain values (flags, sizes) among ``values``."""
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                 else v if isinstance(v, bool | int | float | str | type(None)) else type(v).__name__
                 for v in values)


class StageExecutor:
    """Runs a schedule's actions for one rank.

    Args:
        module: the stage module; ``module(*inputs)`` returns a tuple of boundary values, or the model output
            on the last stage.
        links: this rank's place in the pipeline.
        loss_fn: ``loss_fn(output, target) -> scalar`` mean over the micro-batch's samples.
        device: where received tensors are put.
        count_loss: whether this rank's loss counts in the reported sum.
        before_last_backward: called with the loss sum (final: every forward has run) right before the last
            backward, before it waits for its output gradients (arms gradient sync; stage 0 of a pipeline starts
            the loss all-reduce then, in its idle time).

    Attributes:
        precision: ``None`` (fp32), or a :class:`whale.runtime.precision.MixedPrecision`: the forward runs under
            its autocast, the loss on its fp32 cast of the output, backward from its scaled loss.
        emulator: emulation only (``None`` on real hardware): stretches each compute segment to the declared
            device's speed (:class:`whale.runtime.emulation.EmulatedDevice`).
        weight_pass: zero-bubble only: ``"frontier"`` (B keeps the gradients where parameter branches join the
            activation chain, W computes only the parameters' gradients from them:
            :mod:`whale.parallel.weight_grad`) or ``"replay"`` (W differentiates the outputs again with
            ``inputs=`` the parameters; for stages whose hooks on the chain must run in W, such as ZeRO-3's).
        on_phase: called with each phase's name ("forward micro-batch 3", "backward micro-batch 0", "pipeline
            sends") as it starts (the engine's heartbeat: :mod:`whale.runtime.heartbeat`).
    """

    def __init__(self, module: torch.nn.Module, links: StageLinks, loss_fn: Callable, device: torch.device,
                 count_loss: bool = True, before_last_backward: Callable[[float], None] = lambda loss: None) -> None:
        self.module, self.links, self.loss_fn, self.device = module, links, loss_fn, device
        self.modules = list(getattr(module, "chunks", [module]))  # one per chunk (whale.parallel.chunks)
        self.count_loss, self.before_last_backward = count_loss, before_last_backward
        self.emulator = None
        self.on_phase: Callable[[str], None] = lambda phase: None
        self._first_meta: dict[str, dict] = {"sent": {}, "received": {}}  # per peer: previous step's first description
        self.precision = None
        self.weight_pass = "frontier"

    def run(self, actions: list[Action], work: MicroBatches, train: bool = True) -> StepResult:
        """Run ``actions`` (forwards only when not ``train``) and wait for every send; returns the result.

        With ``W`` actions among them (zero-bubble) each ``B`` computes only the gradients of the stage's inputs
        and its ``W`` those of the parameters (:meth:`_weight`). Gradient sync is armed right before the last
        action that accumulates parameter gradients (the last ``W``, else the last ``B``)."""
        result, state = StepResult(), _InFlight()
        split = any(a.kind == "W" for a in actions)
        arm_at = max((i for i, a in enumerate(actions) if a.kind == ("W" if split else "B")), default=-1)
        t0 = time.perf_counter()
        for i, a in enumerate(actions):
            begin = time.perf_counter()
            self.on_phase(_phase(a, train))
            if a.kind == "F":
                self._forward(a.mb, a.chunk, work, train, state, result)
            elif not train:
                continue
            elif a.kind == "B":
                self._backward((a.chunk, a.mb), i == arm_at, state, result, split)
            else:
                self._weight((a.chunk, a.mb), i == arm_at, state, result)
            c0, c1 = state.segment
            result.timeline.append((str(a), begin - t0, c0 - t0, c1 - t0))
            state.sends = [(w, b) for w, b in state.sends if not _reaped(w)]
        self.on_phase("pipeline sends")
        for work_item, _ in state.sends:
            work_item.wait()
        return result

    def _peers(self, chunk: int, work: MicroBatches) -> tuple[tuple, tuple]:
        """``(receive from, send to)`` of one chunk: the step's batch-bridge peers, or across the interleaved
        wrap-around (last stage to stage 0) this lane's rank on the other end, all rows."""
        links, wrap = self.links, lambda rank: (Peer(rank, 0, work.rows),)
        if links.chunk_stages:  # any map: the lane's rank on the neighbouring chunk's stage; none when local
            g, at = links.virtual(chunk), links.chunk_stages
            recv = wrap(links.lane_ranks[at[g - 1]]) if g > 0 and not links.local(g - 1) else ()
            send = wrap(links.lane_ranks[at[g + 1]]) if g < links.total - 1 and not links.local(g + 1) else ()
            return recv, send
        recv = work.recv_from if links.stage > 0 else wrap(links.wrap_from) if chunk > 0 else ()
        send = work.send_to if not links.is_last else wrap(links.wrap_to) if chunk < links.chunks - 1 else ()
        return recv, send

    def _tag(self, virtual: int, grad: bool) -> int:
        """The p2p channel of transfers INTO virtual stage ``virtual`` (activations) or back to it (``grad``):
        0 with one chunk per rank, else one channel per virtual stage and direction."""
        return 0 if self.links.total == self.links.num_stages else 2 * virtual + int(grad)

    def _receive(self, mb: int, chunk: int, peers: tuple, work: MicroBatches, state: _InFlight) -> list[tuple]:
        """This micro-batch's pieces from every sending lane (in row order); posts the next receives. A step's
        first receive from a lane is posted from that lane's previous first description (``guess``), so no
        header is needed while it stays the same."""
        guesses, tag = self._first_meta["received"], self._tag(self.links.virtual(chunk), False)
        pending = state.next_inputs.get(chunk) or [
            p2p.PendingRecv(p.rank, self.device, guess=guesses.get((p.rank, tag)), tag=tag) for p in peers]
        got = [p.wait() for p in pending]
        if mb == 0:
            guesses.update({(p.rank, tag): meta for p, (_, meta) in zip(peers, got, strict=True)})
        more = mb + 1 < len(work.scales)
        state.next_inputs[chunk] = [p2p.PendingRecv(p.rank, self.device, meta, tag=tag)
                                    for p, (_, meta) in zip(peers, got, strict=True)] if more else None
        return [values for values, _ in got]

    def _forward(self, mb: int, chunk: int, work: MicroBatches, grad: bool, state: _InFlight,
                 result: StepResult) -> None:
        links, (recv, send) = self.links, self._peers(chunk, work)
        first, last, g = links.first(chunk), links.last(chunk), links.virtual(chunk)
        if links.local(g - 1):  # the previous chunk ran here: its outputs, as leaves of this chunk's graph
            pieces = [state.handoff.pop((g, mb))]
        else:
            pieces = [] if first else self._receive(mb, chunk, recv, work, state)
        start = self._clock()
        module = self.modules[chunk]
        with torch.set_grad_enabled(grad):
            given = work.inputs[mb] if first else join(pieces)  # pieces joined in the stage's graph
            inputs = tuple(given.values()) if isinstance(given, dict) else _as_tuple(given)
            with self.precision.autocast() if self.precision is not None else contextlib.nullcontext():
                out = module(**given) if isinstance(given, dict) else module(*inputs)
            if last:
                out = self._loss(mb, out, work, result)
        self._account(start, lambda: ("F" if grad else "f", chunk, bool(work.metric_fns), _shapes(inputs)), state,
                      result)
        outgoing, to = [], links.virtual(chunk) + 1
        for peer in () if last else send:
            values = slice_for(_as_tuple(out), peer, work.rows, work.bridged)
            key = (peer.rank, self._tag(to, False))
            works, meta = p2p.send_values(values, peer.rank, self.device, state.sent_meta.get(key),
                                          self._first_meta["sent"].get(key), tag=key[1])
            state.sent_meta[key] = self._first_meta["sent"][key] = meta
            state.sends += works
            outgoing.append((values, p2p.post_grads(values, peer.rank, self._tag(to - 1, True)) if grad else []))
        if not last and links.local(to):  # the next chunk runs here: hand the outputs over, no send
            values = _as_tuple(out)
            leaves = tuple(v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                           for v in values)
            state.handoff[(to, mb)] = leaves
            outgoing.append((values, _LocalGrads(leaves)))
        if grad:
            state.live[(chunk, mb)] = (inputs, pieces, out, outgoing, recv)

    def _loss(self, mb: int, out, work: MicroBatches, result: StepResult) -> torch.Tensor:
        if self.precision is not None:  # the loss in fp32, outside autocast
            out = self.precision.fp32(out)
        loss = self.loss_fn(out, work.targets[mb])
        loss = (loss.float() if loss.dtype in (torch.bfloat16, torch.float16) else loss) * work.scales[mb]  # fp32
        if self.count_loss:
            result.loss_sum += float(loss.detach())
            weight = work.metric_scales[mb] if work.metric_scales is not None else work.scales[mb]
            for name, fn in work.metric_fns.items():
                value = float(fn(out, work.targets[mb])) * weight
                result.metric_sums[name] = result.metric_sums.get(name, 0.0) + value
        else:  # collective metrics (sharded logits) must run on every rank of the group
            for fn in work.metric_fns.values():
                fn(out, work.targets[mb])
        return loss

    def _backward(self, key: tuple[int, int], last: bool, state: _InFlight, result: StepResult,
                  split: bool = False) -> None:
        """The backward of ``key = (chunk, micro-batch)``; with ``split`` only the gradients of the received
        inputs (``torch.autograd.grad`` on them, keeping the graph and, under ``weight_pass == "frontier"``, the
        gradients the W pass starts from: :func:`whale.parallel.weight_grad.backward_input`), parameters
        untouched."""
        inputs, pieces, out, outgoing, recv = state.live[key] if split else state.live.pop(key)
        if last:  # before waiting for its output gradients: stage 0 starts its loss all-reduce while idle
            self.before_last_backward(result.loss_sum)
        if self.links.last(key[0]):
            tensors, grads = [out if self.precision is None else self.precision.scale_loss(out)], None
        else:  # one gradient per piece sent (autograd sums the pieces of one output)
            tensors, grads = [], []
            for values, posted in outgoing:
                grads += posted.grads() if isinstance(posted, _LocalGrads) else p2p.wait_grads(posted)
                tensors += [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
        start = self._clock()
        if split:
            leaves = [v for piece in pieces for v in piece if isinstance(v, torch.Tensor) and v.requires_grad]
            if self.weight_pass == "replay" or not tensors:
                got = torch.autograd.grad(tensors, leaves, grads, retain_graph=True,
                                          allow_unused=True) if tensors and leaves else ()
                state.weights[key] = (tensors, grads)
            else:  # W from the gradients kept at the frontier (whale.parallel.weight_grad)
                got, state.weights[key] = weight_grad.backward_input(tensors, grads, leaves, self._params(key[0]))
            for leaf, g in zip(leaves, got, strict=False):
                leaf.grad = g  # None: unused, sent as zeros
        elif tensors:
            torch.autograd.backward(tensors, grads)
        self._account(start, lambda: ("Bi" if split else "B", key[0], _shapes(inputs)), state, result)
        back = self._tag(self.links.virtual(key[0]) - 1, True)
        for peer, piece in zip(recv, pieces if recv else [], strict=True):  # none to send for a local hand-off
            state.sends += p2p.send_grads(piece, peer.rank, back)

    def _weight(self, key: tuple[int, int], last: bool, state: _InFlight, result: StepResult) -> None:
        """Zero-bubble W pass of ``key = (chunk, micro-batch)``: the parameters' gradients, accumulated into
        ``.grad`` through their ``AccumulateGrad`` nodes as in a plain backward (gradient-sync hooks fire), from
        the frontier gradients its B pass kept (:func:`whale.parallel.weight_grad.backward_weight`), or under
        ``weight_pass == "replay"`` from the outputs and output gradients again (``inputs=`` the parameters).
        The graph is freed after it."""
        inputs = state.live.pop(key)[0]
        kept = state.weights.pop(key)
        if last:
            self.before_last_backward(result.loss_sum)
        start = self._clock()
        if isinstance(kept, weight_grad.WeightWork):
            weight_grad.backward_weight(kept)
        elif kept[0] and (params := self._params(key[0])):
            torch.autograd.backward(kept[0], kept[1], inputs=params)
        self._account(start, lambda: ("W", key[0], _shapes(inputs)), state, result)

    def _params(self, chunk: int) -> list[torch.Tensor]:
        """The parameters of ``chunk`` that require gradients."""
        return [p for p in self.modules[chunk].parameters() if p.requires_grad]

    def _clock(self) -> tuple[float, float]:
        """Wall time, and this thread's CPU time when emulating (0.0 otherwise: not needed)."""
        return time.perf_counter(), time.thread_time() if self.emulator is not None else 0.0

    def _account(self, start: tuple[float, float], key: Callable[[], tuple], state: _InFlight,
                 result: StepResult) -> None:
        """Add a compute segment to ``busy``. Under emulation, first stretch it to the declared device's speed
        from this thread's CPU time (which runs forward and CPU backward; robust to other processes taking the
        core); ``key()`` names the segment's work (only computed when emulating)."""
        wall0, cpu0 = start
        if self.emulator is not None:
            self.emulator.wait(key(), wall0, cpu0, time.thread_time() - cpu0)
        end = time.perf_counter()
        result.busy += end - wall0
        state.segment = (wall0, end)


def _phase(a: Action, train: bool) -> str:
    """The heartbeat's name of an action: "forward micro-batch 3", "weight-gradient micro-batch 0", ..."""
    what = {"F": "forward" if train else "eval forward", "B": "backward", "W": "weight-gradient"}[a.kind]
    return f"{what} micro-batch {a.mb}" + (f" of chunk {a.chunk}" if a.chunk else "")


def _reaped(work) -> bool:
    """True (and the send's buffer released) when a send has completed: activation memory is not held to the
    step's end."""
    if work.is_completed():
        work.wait()
        return True
    return False
