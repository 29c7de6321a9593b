"""The global batch a step is given: its size, its slices, and the checks made before any rank communicates.

Every rank is given the same global batch ``(inputs, target)`` and takes its own rows from the plan. Two
mistakes would otherwise fail deep inside torch on one rank while its peers wait in a collective, or train
silently on garbage: inputs and targets of different row counts, and per-rank batches (the usual per-rank
data-loader pattern). On the checked steps (:func:`agree_on_batch`) both are caught with an error every rank
raises together, also when only one rank's batch is bad.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class BatchError(ValueError):
    """A batch Whale cannot step on; the message names the shapes and the fix."""


def tensors(x) -> list[torch.Tensor]:
    """The tensors of a tensor or (nested) tuple/list/dict of them, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors(v)]
    if isinstance(x, tuple | list):
        return [t for v in x for t in tensors(v)]
    return []


def map_tensors(x, fn):
    """``x`` with ``fn`` applied to every tensor (tuples, lists and dicts keep their type)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return type(x)(map_tensors(v, fn) for v in x)
    return x


def slice_rows(x, start: int, stop: int, rows: int, device: torch.device):
    """Rows ``start:stop`` of ``x`` on ``device``. Keyword inputs (a dict) are sliced where a tensor holds one
    row per sample (dim 0 == ``rows``) and passed whole otherwise (a causal mask, a flag, ``use_cache=False``);
    a tensor or a tuple/list of them is all per-sample."""
    if isinstance(x, dict):
        return {k: slice_rows(v, start, stop, rows, device)
                if isinstance(v, torch.Tensor) and v.dim() and v.size(0) == rows
                else map_tensors(v, lambda t: t.to(device, non_blocking=True)) for k, v in x.items()}
    return map_tensors(x, lambda t: t[start:stop].to(device, non_blocking=True))


def batch_size(batch) -> int:
    """Rows (dim 0) of a batch ``(inputs, target)``, checked to agree across every per-sample tensor in it.

    ``inputs`` is a tensor, a tuple/list of tensors (every one per-sample), or a dict of keyword inputs (the
    model is called as ``model(**inputs)``; its per-sample tensors are those with the target's rows).

    Raises:
        BatchError: no tensor in the inputs (or, for keyword inputs, in the target), a 0-dim tensor, or
            per-sample tensors of different row counts (naming each shape).
    """
    inputs, target = batch
    if isinstance(inputs, dict):  # keyword inputs: the target's rows are the samples
        target_ts = tensors(target)
        if not target_ts or target_ts[0].dim() == 0:
            raise BatchError("with keyword inputs (a dict) the target must be a tensor with one row per sample: "
                             "its rows tell which inputs are per-sample")
        rows = target_ts[0].size(0)
        inputs = [t for t in tensors(inputs) if t.dim() and t.size(0) == rows] or target_ts
    ts = tensors(inputs)
    if not ts:
        raise BatchError(f"cannot find the batch dimension of {type(inputs).__name__}: pass tensors (dim 0 = "
                         "samples) as inputs")
    every = ts + tensors(target)
    if any(t.dim() == 0 for t in every) or len({t.size(0) for t in every}) != 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in every)
        raise BatchError(f"the batch's tensors disagree on the number of rows (dim 0): inputs and target have "
                         f"shapes {shapes}; give every input and the target the same rows, one per sample")
    return int(ts[0].size(0))


def fingerprint(batch) -> list[float]:
    """Cheap, fixed-length summary of a batch (float64): how many tensors, their elements, the sum of their
    values, a position-weighted sum (so reordered rows differ) and a position-weighted sum of where the NaN,
    +inf and -inf values are (codes 1, 2, 3). The sums are over the finite values (NaN and inf count as 0), so
    identical batches holding NaN or inf agree (a NaN sum never equals itself) and different ones still differ."""
    ts = tensors(batch[0]) + tensors(batch[1])
    out = [float(len(ts)), 0.0, 0.0, 0.0, 0.0]
    for t in ts:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(101).add_(1)
        codes = torch.isnan(flat).double() + torch.isposinf(flat).double() * 2 + torch.isneginf(flat).double() * 3
        flat = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
        out[1] += flat.numel()
        out[2] += float(flat.sum())
        out[3] += float(flat.dot(weights))
        out[4] += float(codes.dot(weights))
    return out


def agree_on(values: list[float], world_size: int, device: torch.device,
             error: Exception | None = None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Collective: one all-reduce (max) of a failure flag, ``values`` and their negation (float64).

    Returns:
        ``(another rank failed, max of values over ranks, min of values over ranks)``.

    Raises:
        the rank's own ``error`` (after the all-reduce, so that no rank is left waiting in it).
    """
    if world_size == 1:
        if error is not None:
            raise error
        mine = torch.tensor(values, dtype=torch.float64)
        return False, mine, mine
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    flags = torch.cat([torch.tensor([float(error is not None)], dtype=torch.float64, device=device), mine, -mine])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    n = mine.numel()
    return bool(flags[0] > 0), flags[1: n + 1], -flags[n + 1:]


def agree_on_batch(batch, world_size: int, device: torch.device, error: Exception | None = None) -> None:
    """Collective: raise on EVERY rank when some rank's batch was refused (``error``, raised locally before any
    communication) or the ranks were given different batches. One all-reduce of 11 float64 values (the max of a
    failure flag and of the fingerprint and its negation, :func:`agree_on`).

    Raises:
        the rank's own ``error``; BatchError on the other ranks, naming the problem and the fix.
    """
    other_failed, high, low = agree_on(fingerprint(batch), world_size, device, error)
    if other_failed:
        raise BatchError("another rank's batch was refused (see its error): every rank must pass the same GLOBAL "
                         "batch to engine.step / eval_step (Whale takes each rank's rows from the plan)")
    if not torch.equal(high, low):
        raise BatchError(
            "the ranks were given different batches: every rank must pass the same GLOBAL batch to engine.step "
            "and eval_step, in the same order (Whale takes each rank's rows from the plan). Build the batches "
            "identically on every rank (same data order and seed; no DistributedSampler or per-rank shards)")
