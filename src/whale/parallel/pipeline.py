"""Executor of a schedule (see :mod:`whale.parallel.schedule`) for one rank: one stage of one lane.

With one stage, the same executor is plain gradient accumulation: ``F0 B0 F1 B1 ...``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from whale.parallel import p2p
from whale.parallel.schedule import Action


@dataclass
class StageRun:
    """Everything one rank needs to run its stage for one step.

    Attributes:
        module: the stage module; ``module(*inputs)`` returns a tuple of boundary values, or the model output
            on the last stage.
        stage, num_stages: this stage's index and the pipeline depth.
        prev_rank, next_rank: global ranks of the neighbouring stages of this lane (``None`` at the ends).
        inputs: per micro-batch, the model's forward arguments (used on stage 0 only).
        targets: per micro-batch, the loss target (used on the last stage only).
        scales: per micro-batch, ``rows / global_batch``: the weight of its mean loss in the global mean.
        loss_fn: ``loss_fn(output, target) -> scalar`` mean over the micro-batch's samples.
        device: where received tensors are put.
        count_loss: whether this rank's loss counts in the reported sum (ranks of a split group all compute the
            same loss over the group's rows; one of them reports it).
        metric_fns: eval only, ``{name: fn(output, target)}`` averaged like the loss into ``metric_sums``.
        timeline: filled by :func:`execute`: per action ``(label, start, compute_start, compute_end)`` in
            seconds from the start of the step (``start`` includes waiting for inputs).
        emulator: emulation only (``None`` on real hardware): stretches each compute segment to the declared
            device's speed (:class:`whale.runtime.emulation.EmulatedDevice`, DESIGN.md §6).
        before_last_backward: called with this run right before the last micro-batch's backward (arms
            gradient sync).
    """

    module: torch.nn.Module
    stage: int
    num_stages: int
    prev_rank: int | None
    next_rank: int | None
    inputs: list[tuple]
    targets: list
    scales: list[float]
    loss_fn: Callable
    device: torch.device
    before_last_backward: Callable[[StageRun], None] = lambda run: None
    emulator: Any = None
    timeline: list = field(default_factory=list)
    count_loss: bool = True
    metric_fns: dict = field(default_factory=dict)
    metric_sums: dict = field(default_factory=dict)
    busy: float = 0.0
    loss_sum: float = 0.0
    _live: dict = field(default_factory=dict)
    _next_inputs: p2p.PendingRecv | None = None
    _segment: tuple = (0.0, 0.0)
    _sends: list = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        """True on stage 0."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """True on the last stage (computes the loss)."""
        return self.stage == self.num_stages - 1


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _receive_inputs(run: StageRun, mb: int, num_micro_batch: int) -> tuple:
    pending = run._next_inputs or p2p.PendingRecv(run.prev_rank, run.device)
    inputs, meta = pending.wait()
    run._next_inputs = p2p.PendingRecv(run.prev_rank, run.device, meta) if mb + 1 < num_micro_batch else None
    return inputs


def _forward(run: StageRun, mb: int, grad: bool, num_micro_batch: int) -> None:
    inputs = _as_tuple(run.inputs[mb]) if run.is_first else _receive_inputs(run, mb, num_micro_batch)
    start = _clock()
    with torch.set_grad_enabled(grad):
        out = run.module(*inputs)
        if run.is_last:
            out = _loss(run, mb, out)
    _account(run, start, ("F" if grad else "f", bool(run.metric_fns), _shapes(inputs)))
    if not run.is_last:
        run._sends += p2p.send_values(out, run.next_rank, run.device)
    if grad:
        posted = p2p.post_grads(out, run.next_rank) if not run.is_last else []
        run._live[mb] = (inputs, out, posted)


def _loss(run: StageRun, mb: int, out) -> torch.Tensor:
    loss = run.loss_fn(out, run.targets[mb]) * run.scales[mb]
    if run.count_loss:
        run.loss_sum += float(loss.detach())
        for name, fn in run.metric_fns.items():
            value = float(fn(out, run.targets[mb])) * run.scales[mb]
            run.metric_sums[name] = run.metric_sums.get(name, 0.0) + value
    elif run.metric_fns:  # collective metrics (sharded logits) must run on every rank of the group
        for fn in run.metric_fns.values():
            fn(out, run.targets[mb])
    return loss


def _backward(run: StageRun, mb: int, last: bool) -> None:
    inputs, out, posted = run._live.pop(mb)
    if run.is_last:
        tensors, grads = [out], [None]
    else:
        grads = p2p.wait_grads(posted)
        tensors = [v for v in out if isinstance(v, torch.Tensor) and v.requires_grad]
    if last:
        run.before_last_backward(run)
    start = _clock()
    if tensors:
        torch.autograd.backward(tensors, grads if not run.is_last else None)
    _account(run, start, ("B", _shapes(inputs)))
    if not run.is_first:
        run._sends += p2p.send_grads(inputs, run.prev_rank)


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _shapes(values: tuple) -> tuple:
    """What sets a segment's work: tensor shapes and dtypes, and plain values (flags, sizes) among ``values``."""
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                 else v if isinstance(v, bool | int | float | str | type(None)) else type(v).__name__
                 for v in values)


def _account(run: StageRun, start: tuple[float, float], key: tuple) -> None:
    """Add a compute segment to ``busy``. Under emulation, first stretch it to the declared device's speed
    from this thread's CPU time (which runs forward and CPU backward; robust to other processes taking the
    core)."""
    wall0, cpu0 = start
    if run.emulator is not None:
        run.emulator.wait(key, wall0, cpu0, time.thread_time() - cpu0)
    end = time.perf_counter()
    run.busy += end - wall0
    run._segment = (wall0, end)


def _reap(run: StageRun) -> None:
    """Release the buffers of sends that have completed (activation memory is not held to the step's end)."""
    pending = []
    for work, buf in run._sends:
        if work.is_completed():
            work.wait()
        else:
            pending.append((work, buf))
    run._sends = pending


def execute(run: StageRun, actions: list[Action], num_micro_batch: int, train: bool = True) -> StageRun:
    """Run ``actions`` for this rank; returns ``run`` with ``busy`` (seconds of compute) and ``loss_sum``
    (on the last stage: sum of scaled micro-batch losses) filled in. In eval mode only forwards run."""
    t0 = time.perf_counter()
    for a in actions:
        begin = time.perf_counter()
        if a.kind == "F":
            _forward(run, a.mb, grad=train, num_micro_batch=num_micro_batch)
        elif train:
            _backward(run, a.mb, last=a.mb == num_micro_batch - 1)
        else:
            continue
        c0, c1 = run._segment
        run.timeline.append((str(a), begin - t0, c0 - t0, c1 - t0))
        _reap(run)
    for work, _ in run._sends:
        work.wait()
    run._sends.clear()
    return run
