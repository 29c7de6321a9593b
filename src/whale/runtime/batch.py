"""The global batch a step is given: its size, its slices, and the checks made before any rank communicates.

Every rank is given the same global batch ``(inputs, target)`` and takes its own rows from the plan. Two
mistakes would otherwise fail deep inside torch on one rank while its peers wait in a collective, or train
silently on garbage: inputs and targets of different row counts, and per-rank batches (the usual per-rank
data-loader pattern). Both are caught here with an error every rank raises together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class BatchError(ValueError):
    """A batch Whale cannot step on; the message names the shapes and the fix."""


def tensors(x) -> list[torch.Tensor]:
    """The tensors of a tensor or (nested) tuple/list of them, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, tuple | list):
        return [t for v in x for t in tensors(v)]
    return []


def map_tensors(x, fn):
    """``x`` with ``fn`` applied to every tensor (tuples and lists keep their type)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple | list):
        return type(x)(map_tensors(v, fn) for v in x)
    return x


def batch_size(batch) -> int:
    """Rows (dim 0) of a batch ``(inputs, target)``, checked to agree across every tensor in it.

    Raises:
        BatchError: no tensor in the inputs, a 0-dim tensor, or tensors of different row counts (naming
            each shape).
    """
    inputs, target = batch
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
    """Cheap summary of a batch: per tensor, its row count and the float64 sum of its elements."""
    out: list[float] = []
    for t in tensors(batch[0]) + tensors(batch[1]):
        out += [float(t.size(0)), float(t.detach().to(torch.float64).sum())]
    return out


def check_same_batch(batch, world_size: int, device: torch.device) -> None:
    """Collective: raise on every rank when the ranks were given different global batches.

    One all-reduce of ``2 x`` the fingerprint's length (max of the fingerprint and of its negation).

    Raises:
        BatchError: the fingerprints differ (every rank raises).
    """
    if world_size == 1:
        return
    mine = torch.tensor(fingerprint(batch), dtype=torch.float64, device=device)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    top, bottom = both[: mine.numel()], -both[mine.numel():]
    if not torch.equal(top, bottom):
        raise BatchError(
            "the ranks were given different batches: every rank must pass the same GLOBAL batch to "
            "engine.step (Whale takes each rank's rows from the plan). Build the batches identically on every "
            "rank (same data order and seed; no DistributedSampler or per-rank shards)")
