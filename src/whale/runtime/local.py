"""A step's work from a rank's LOCAL rows (:meth:`whale.Engine.step_local`) instead of the global batch.

A rank given only its own rows (from :class:`whale.runtime.sampler.PlanSampler` or :func:`~whale.runtime.
sampler.local_rows`) holds, per micro-batch, its lane's share of that micro-batch, one after another. What the
global path reads off the whole batch comes from elsewhere here: the global row count is passed in
(``global_batch``), and a token-weighted loss's count of terms is summed over the last stage's lanes, which
together hold every target row exactly once (:func:`global_count`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from whale.loss import SumOverCount
from whale.parallel.pipeline import MicroBatches
from whale.plan.plan import PlanError
from whale.runtime.batch import BatchError, agree_on, slice_rows, tensors


def _check_rows(what: str, x, rows: int, lane: str, keyword: bool) -> None:
    """Raise BatchError unless ``x`` holds ``rows`` rows (every tensor; for keyword inputs, at least one)."""
    ts = [t for t in tensors(x) if t.dim()]
    fits = [t for t in ts if t.size(0) == rows]
    if (fits if keyword else ts and len(fits) == len(ts) == len(tensors(x))):
        return
    shapes = ", ".join(str(tuple(t.shape)) for t in tensors(x)) or "no tensor"
    raise BatchError(
        f"step_local: {lane} needs its local {what} with {rows} rows (its lane's share of every micro-batch, one after "
        f"another) but was given {shapes}. Load the rows with whale.PlanSampler / whale.local_rows for this plan "
        "and global batch, or pass the whole global batch to engine.step instead of step_local")


def local_take(batch, lane_rows: list[tuple[int, int]], first: bool, last: bool, device: torch.device,
               where: str) -> Callable:
    """``take(x, a, b)``: rows ``a:b`` of the GLOBAL batch, read from ``x``, a local batch holding this lane's
    ``lane_rows`` (per micro-batch ``(start, stop)`` in the global batch) one after another, on ``device``.

    Args:
        batch: ``(inputs, target)`` of local rows; stage 0 (``first``) reads ``inputs``, the last stage
            ``target``; the other may be ``None``, and a middle stage may pass ``None`` for the whole batch.

    Raises:
        BatchError: stage 0 without inputs or the last stage without a target, or a local batch whose rows are
            not this lane's share.
    """
    n = sum(b - a for a, b in lane_rows)
    inputs, target = batch if batch is not None else (None, None)
    if first:
        _check_rows("inputs", inputs, n, where, isinstance(inputs, dict))
    if last:
        _check_rows("target", target, n, where, False)
    local, offset = {}, 0
    for a, b in lane_rows:
        local[(a, b)] = (offset, offset + b - a)
        offset += b - a

    def take(x, a: int, b: int):
        """Global rows a:b of x (this lane's), on ``device``."""
        return slice_rows(x, *local[(a, b)], n, device)
    return take


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
    before any communication) or the ranks disagree on ``global_batch``. One all-reduce of 3 float64 values
    (:func:`whale.runtime.batch.agree_on`).

    Raises:
        the rank's own ``error``; BatchError on the other ranks, naming the problem and the fix.
    """
    other_failed, high, low = agree_on([float(global_batch)], world_size, device, error)
    if other_failed:
        raise BatchError("another rank's local batch was refused (see its error): every rank must pass its own "
                         "rows of the same global batch to engine.step_local")
    if high[0] != low[0]:
        raise BatchError(f"the ranks passed different global_batch sizes to engine.step_local (between "
                         f"{int(low[0])} and {int(high[0])}): pass the same global batch size on every rank")


def local_work(engine, batch, global_batch: int, kind: str, metrics: dict | None = None) -> MicroBatches:
    """The work of ``engine`` (a :class:`whale.Engine`) for one :meth:`~whale.Engine.step_local` (``kind``
    ``"local"``) or :meth:`~whale.Engine.eval_step_local` (``"local_eval"``): its micro-batches read from local
    rows (``engine._micro_batches`` with :func:`local_take`),
    agreed on by every rank on the engine's first checked calls of that kind (:func:`agree_on_global_batch`),
    with a token-weighted loss normalised by the global count (:func:`global_count`, last stage).

    Raises:
        PlanError: ``global_batch`` does not divide into micro-batches or leaves a lane empty.
        BatchError: as :func:`local_take`; ranks passing different ``global_batch``; a model ending in
            class-sharded logits.
    """
    work, error = None, None
    try:
        if engine.split.sharded_loss:
            raise BatchError("step_local / eval_step_local cannot run a model ending in class-sharded logits "
                             "(a split head): each rank's loss covers its split group's rows; pass the global "
                             "batch to engine.step / eval_step")
        work = engine._micro_batches(batch, metrics, global_batch)
    except (BatchError, PlanError) as exc:
        error = exc
    if engine._batch_checks[kind]:
        engine._batch_checks[kind] -= 1
        agree_on_global_batch(global_batch, engine.world_size, engine.ctx.device, error)
    elif error is not None:
        raise error
    if isinstance(engine.loss_fn, SumOverCount) and engine.stage == engine.plan.last_stage:
        count = global_count(engine.loss_fn.count(batch[1]), engine.mesh.lanes, engine.ctx.device)
        work = dataclasses.replace(work, scales=[1.0 / count if count else 0.0] * len(work.scales))
    return work
