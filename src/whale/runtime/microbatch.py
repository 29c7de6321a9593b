"""A step's work for one rank: its slices of the global batch per micro-batch, from the plan's rows, with the loss
scales that make the step equal one process training on the whole batch (rows over the global batch for a
per-sample mean; one over the global count of terms for a token-weighted :class:`whale.loss.SumOverCount`)."""

from __future__ import annotations

from whale.loss import SumOverCount
from whale.parallel.pipeline import MicroBatches
from whale.runtime.batch import batch_size, slice_rows
from whale.runtime.local import local_take


def _layout(engine, total: int) -> tuple[list, tuple]:
    """This stage's rows per lane and micro-batch (the stages differ in width), and this lane's batch-bridge
    peers: pure functions of the plan and the batch size, so kept while both stay (the plan object changes
    when its shares do), which saves ~0.2 ms of Python a step."""
    plan, memo = engine.plan, engine._layout_memo
    if memo is None or memo[0] is not plan or memo[1] != total:
        memo = engine._layout_memo = (plan, total, plan.micro_batch_rows(total, engine.stage),
                                      plan.boundary_peers(total, engine.stage, engine.lane))
    return memo[2], memo[3]


def micro_batches(engine, batch, metrics: dict | None = None, global_batch: int | None = None) -> MicroBatches:
    """This rank's slices of the global ``batch`` per micro-batch, from the plan's rows; with ``global_batch``,
    ``batch`` holds only this lane's rows (:meth:`whale.Engine.step_local`; a token-weighted loss's scales are
    then set by :func:`whale.runtime.local.local_work`, after the global count).

    Args:
        engine: the rank's :class:`whale.Engine` (its plan, stage, lane, split runtime, loss and device; its
            ``_rows`` is set to this lane's rows of the step).
        batch: ``(inputs, target)``, tensors with the batch on dim 0 (``None`` on a middle stage).
        metrics: eval metric functions, scaled like a per-sample mean.

    Raises:
        BatchError: a local batch whose rows do not match the plan (:func:`whale.runtime.local.local_take`).
    """
    inputs, target = batch if batch is not None else (None, None)
    total = batch_size(batch) if global_batch is None else global_batch
    rows, (recv_from, send_to) = _layout(engine, total)
    engine._rows = sum(b - a for a, b in rows[engine.lane])  # this lane's rows this step (for the history)
    engine.split.start_step(engine.plan, rows, engine.lane)
    loss_rows = engine.split.loss_rows(engine.plan, rows, engine.lane)
    dev = engine.ctx.device
    last = engine.stage == engine.plan.last_stage  # it runs the model's last chunk: the loss
    if global_batch is None:
        def take(x, a, b):
            """Rows a:b of x, on this rank's device."""
            return slice_rows(x, a, b, total, dev)
    else:  # rows a:b of the global batch are at a local offset (checks the local batch's rows)
        take = local_take(batch, rows[engine.lane], engine.stage == 0, last, dev, f"lane {engine.lane}")
    row_scales = [(b - a) / total for a, b in loss_rows]
    if isinstance(engine.loss_fn, SumOverCount) and global_batch is None:  # token-weighted: / global terms
        count = engine.loss_fn.count(target)
        scales = [1.0 / count if count else 0.0] * len(loss_rows)
    else:  # a per-sample mean: weighted by rows
        scales = row_scales
    return MicroBatches(inputs=[take(inputs, a, b) for a, b in rows[engine.lane]] if engine.stage == 0 else [],
                        targets=[take(target, a, b) for a, b in loss_rows] if last else [],
                        scales=scales, metric_fns=metrics or {}, metric_scales=row_scales, recv_from=recv_from,
                        send_to=send_to, rows=rows[engine.lane][0][1] - rows[engine.lane][0][0],
                        bridged=not engine.plan.uniform_width)
