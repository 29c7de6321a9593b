"""A step's work from a rank's LOCAL rows (:meth:`whale.Engine.step_local`) instead of the global batch.

A rank given only its own rows (from :class:`whale.runtime.sampler.PlanSampler` or :func:`~whale.runtime.
sampler.local_rows`) holds, per micro-batch, its lane's share of that micro-batch, one after another. What the
global path reads off the whole batch comes from elsewhere here: the global row count is passed in
(``global_batch``), and a token-weighted loss's count of terms is summed over the last stage's lanes, which
together hold every target row exactly once (:func:`global_count`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from whale.loss import SumOverCount
from whale.parallel.pipeline import MicroBatches
from whale.plan.plan import Plan, PlanError
from whale.runtime.batch import BatchError, slice_rows, tensors


def _check_rows(what: str, x, rows: int, where: str, keyword: bool) -> None:
    """Raise BatchError unless ``x`` holds ``rows`` rows (every tensor; for keyword inputs, at least one)."""
    ts = [t for t in tensors(x) if t.dim()]
    fits = [t for t in ts if t.size(0) == rows]
    if (fits if keyword else ts and len(fits) == len(ts) == len(tensors(x))):
        return
    shapes = ", ".join(str(tuple(t.shape)) for t in tensors(x)) or "no tensor"
    raise BatchError(
        f"{where} needs its local {what} with {rows} rows (its lane's share of every micro-batch, one after "
        f"another) but was given {shapes}. Load the rows with whale.PlanSampler / whale.local_rows for this plan "
        "and global batch, or pass the whole global batch to engine.step instead of step_local")


def local_micro_batches(plan: Plan, stage: int, lane: int, batch, global_batch: int, device: torch.device,
                        metrics: dict | None = None) -> tuple[MicroBatches, list[list[tuple[int, int]]]]:
    """This rank's micro-batches from its local rows, and the plan's global rows (for the split bridges).

    Args:
        batch: ``(inputs, target)`` holding this lane's rows of the global batch in :func:`local_rows` order;
            stage 0 reads ``inputs``, the last stage ``target``; the other may be ``None``, and a middle stage
            may pass ``None`` for the whole batch.
        global_batch: rows of the global batch (all lanes together).

    Returns:
        ``(work, rows)``: ``work.scales`` weighs each micro-batch by ``rows / global_batch`` (a token-weighted
        loss rescales them once the global count is known, :func:`global_count`).

    Raises:
        PlanError: ``global_batch`` does not divide into micro-batches or leaves a lane empty.
        BatchError: stage 0 without inputs or the last stage without a target, or a local batch whose rows are
            not this lane's share.
    """
    rows = plan.micro_batch_rows(global_batch)
    shares = [b - a for a, b in rows[lane]]
    n, first, last = sum(shares), stage == 0, stage == plan.num_stages - 1
    inputs, target = batch if batch is not None else (None, None)
    where = f"stage {stage}, lane {lane} (step_local, global batch {global_batch})"
    if first:
        _check_rows("inputs", inputs, n, where, isinstance(inputs, dict))
    if last:
        _check_rows("target", target, n, where, False)
    offsets = [sum(shares[:i]) for i in range(len(shares))]
    spans = [(o, o + s) for o, s in zip(offsets, shares, strict=True)]
    row_scales = [s / global_batch for s in shares]
    return MicroBatches(inputs=[slice_rows(inputs, a, b, n, device) for a, b in spans] if first else [],
                        targets=[slice_rows(target, a, b, n, device) for a, b in spans] if last else [],
                        scales=row_scales, metric_fns=metrics or {}, metric_scales=row_scales), rows


def global_count(local: float, group, device: torch.device) -> float:
    """Sum of a token-weighted loss's local counts of terms over the last stage's lanes (``group``: every lane
    of the stage, ``None`` for one lane). Collective over ``group``: every last-stage rank calls it."""
    if group is None:
        return local
    t = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t[0])


def agree_on_global_batch(global_batch: int, world_size: int, device: torch.device,
                          error: Exception | None = None) -> None:
    """Collective: raise on EVERY rank when some rank's local batch was refused (``error``, raised locally
    before any communication) or the ranks disagree on ``global_batch``. One all-reduce of 3 float64 values.

    Raises:
        the rank's own ``error``; BatchError on the other ranks, naming the problem and the fix.
    """
    if world_size == 1:
        if error is not None:
            raise error
        return
    flags = torch.tensor([float(error is not None), float(global_batch), -float(global_batch)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if flags[0] > 0:
        raise BatchError("another rank's local batch was refused (see its error): every rank must pass its own "
                         "rows of the same global batch to engine.step_local")
    if flags[1] != -flags[2]:
        raise BatchError(f"the ranks passed different global_batch sizes to engine.step_local (between "
                         f"{int(-flags[2])} and {int(flags[1])}): pass the same global batch size on every rank")


def local_work(engine, batch, global_batch: int, kind: str, metrics: dict | None = None) -> MicroBatches:
    """The work of ``engine`` (a :class:`whale.Engine`) for one :meth:`~whale.Engine.step_local` (``kind``
    ``"local"``) or :meth:`~whale.Engine.eval_step_local` (``"local_eval"``): :func:`local_micro_batches`,
    agreed on by every rank on the engine's first checked calls of that kind (:func:`agree_on_global_batch`),
    with a token-weighted loss normalised by the global count (:func:`global_count`, last stage).

    Raises:
        BatchError, PlanError: as :func:`local_micro_batches`; also for a model ending in class-sharded logits.
    """
    work, error = None, None
    try:
        if engine.split.sharded_loss:
            raise BatchError("step_local / eval_step_local cannot run a model ending in class-sharded logits "
                             "(a split head): each rank's loss covers its split group's rows; pass the global "
                             "batch to engine.step / eval_step")
        work, rows = local_micro_batches(engine.plan, engine.stage, engine.lane, batch, global_batch,
                                         engine.ctx.device, metrics)
        engine.split.start_step(engine.plan, rows, engine.lane)
    except (BatchError, PlanError) as exc:
        error = exc
    if engine._batch_checks[kind]:
        engine._batch_checks[kind] -= 1
        agree_on_global_batch(global_batch, engine.world_size, engine.ctx.device, error)
    elif error is not None:
        raise error
    engine._rows = sum(b - a for a, b in rows[engine.lane])  # this lane's rows (for the step history)
    if isinstance(engine.loss_fn, SumOverCount) and engine.stage == engine.plan.num_stages - 1:
        count = global_count(engine.loss_fn.count(batch[1]), engine.mesh.lanes, engine.ctx.device)
        work = dataclasses.replace(work, scales=[1.0 / count if count else 0.0] * len(work.scales))
    return work
