"""Per-rank data loading under a plan: each rank loads only the rows of each global batch that it computes on.

By default every rank is given the whole global batch and :meth:`whale.Engine.step` slices its rows from the
plan. With :class:`PlanSampler` (or :func:`local_rows`) a rank loads only its own rows instead and steps with
:meth:`whale.Engine.step_local`; the result is the same step, bit for bit in the gradients' math. A plain
``DistributedSampler`` cannot do this: it gives every rank an equal share, while a plan's lanes may take
unequal (hardware-aware) shares, and micro-batches interleave the lanes' rows.

Which rank needs which data: the ranks of pipeline stage 0 need the inputs of their lane's rows, the ranks of
the last stage their targets; a middle stage needs nothing (its inputs arrive from the previous stage), so
:attr:`PlanSampler.loads` is false there and :meth:`PlanSampler.loader` yields ``None`` per step.

Typical use::

    sampler = wh.PlanSampler(len(dataset), engine.plan, rank, global_batch=64, seed=0)
    loader = sampler.loader(dataset, num_workers=2)         # a DataLoader, or Nones on a middle stage
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for local in loader:
            engine.step_local(local, global_batch=64)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from whale.plan.plan import Plan


def local_rows(plan: Plan, rank: int, global_batch: int) -> list[int]:
    """Positions (0 .. ``global_batch``-1) of the rows of a global batch that ``rank`` computes on, in the order
    :meth:`whale.Engine.step_local` consumes them: micro-batch 0's rows of the rank's lane, then micro-batch 1's,
    and so on. Over the lanes of one pipeline stage they partition the global batch; ranks of different stages
    of one lane get the same positions (with stages of different widths each stage's lanes cut the batch
    their own way: stage 0 loads inputs and the last stage targets at their own positions).

    Raises:
        PlanError: the global batch does not divide into the plan's micro-batches or leaves a lane empty.
    """
    stage, lane = plan.coords(rank)
    return [r for a, b in plan.micro_batch_rows(global_batch, stage)[lane] for r in range(a, b)]


class _Nones:
    """``steps`` times ``None``: a middle pipeline stage's "loader" (it loads nothing)."""

    def __init__(self, sampler: PlanSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None, len(self.sampler))


class PlanSampler(Sampler[list[int]]):
    """A batch sampler: per step, the dataset indices of this rank's rows of the global batch.

    Each epoch orders the dataset (a permutation drawn from ``seed + epoch`` when ``shuffle``, identical on
    every rank) and cuts it into global batches of ``global_batch`` consecutive indices; it yields, per global
    batch, the indices at :func:`local_rows` (this rank's lane's rows under the plan's uneven shares, micro-batch
    by micro-batch). Use it as ``DataLoader(dataset, batch_sampler=sampler)`` (or :meth:`loader`) and step with
    ``engine.step_local(local_batch, global_batch)``.

    Args:
        dataset_len: number of samples in the dataset.
        plan: the engine's plan (``engine.plan``). After the engine re-balances (``Config.rebalance_after``,
            :meth:`whale.Engine.rebalance`) the shares change: set ``sampler.plan = engine.plan``.
        rank: this process's global rank.
        global_batch: rows per global batch (all ranks together).
        shuffle: draw a new order each epoch (:meth:`set_epoch`); otherwise the dataset's order.
        seed: base seed of the order; must be equal on every rank.
        drop_last: drop the epoch's last, incomplete global batch; otherwise complete it with indices from the
            start of the epoch's order (some samples are then seen twice in that epoch, as with
            ``DistributedSampler``).

    Attributes:
        loads: whether this rank needs data (stage 0 needs inputs, the last stage targets).

    Raises:
        ValueError: ``global_batch`` < 1, or a dataset smaller than one global batch with ``drop_last``.
        PlanError: the global batch does not divide into the plan's micro-batches or leaves a lane empty.
    """

    def __init__(self, dataset_len: int, plan: Plan, rank: int, global_batch: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if drop_last and dataset_len < global_batch:
            raise ValueError(f"the dataset has {dataset_len} samples, fewer than one global batch of "
                             f"{global_batch}: use a smaller global batch or drop_last=False")
        self.dataset_len, self.rank, self.global_batch = dataset_len, rank, global_batch
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self.plan = plan

    @property
    def plan(self) -> Plan:
        """The plan whose shares the sampler follows (setting it re-checks the global batch against it)."""
        return self._plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        """Follow ``plan``'s shares from the next global batch on.

        Raises:
            PlanError: the global batch does not divide into ``plan``'s micro-batches or leaves a lane empty.
        """
        self._positions = local_rows(plan, self.rank, self.global_batch)  # raises PlanError first
        self._plan = plan
        stage, _ = plan.coords(self.rank)
        self.loads = stage in (0, plan.num_stages - 1)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order (call it before each epoch, with the same value on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        """Steps (global batches) per epoch."""
        full, rest = divmod(self.dataset_len, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self) -> list[int]:
        """This epoch's order of the whole dataset (identical on every rank)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """Per step, this rank's dataset indices (``len(local_rows(...))`` of them)."""
        order = self.order()
        steps, b = len(self), self.global_batch
        if steps * b > len(order):  # complete the last global batch from the start (drop_last=False)
            order += (order * (steps * b // max(len(order), 1) + 1))[: steps * b - len(order)]
        for s in range(steps):
            yield [order[s * b + r] for r in self._positions]

    def loader(self, dataset, **kwargs) -> DataLoader | _Nones:
        """``DataLoader(dataset, batch_sampler=self, **kwargs)`` where this rank loads data; on a middle
        pipeline stage an iterable of ``len(self)`` ``None`` (pass them to ``engine.step_local`` as they are)."""
        return DataLoader(dataset, batch_sampler=self, **kwargs) if self.loads else _Nones(self)
