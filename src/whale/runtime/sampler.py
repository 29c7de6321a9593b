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

Mid-epoch resume: ``sampler.state_dict()`` (epoch, global batches taken this epoch, seed and the order's shape)
goes into the checkpoint's ``extra``; a new sampler's ``load_state_dict(saved)`` continues the epoch with
exactly the global batches not yet taken, under the same plan or another (world size, stages, shares).
"""

from __future__ import annotations

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
    """One ``None`` per step the sampler yields: a middle pipeline stage's "loader" (it loads nothing; iterating
    it moves the sampler's position as a loading stage's does)."""

    def __init__(self, sampler: PlanSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[None]:
        for _ in self.sampler:
            yield None


class PlanLoader:
    """``DataLoader(dataset, batch_sampler=sampler)`` that tells the sampler how many batches were delivered.

    A DataLoader with workers draws indices ahead of the batches it hands out (``prefetch_factor`` per worker),
    so the sampler alone would count batches not trained on yet; iterating this loader sets the sampler's
    :attr:`PlanSampler.position` to the batches delivered instead. Other attributes are the DataLoader's.
    """

    def __init__(self, sampler: PlanSampler, loader: DataLoader) -> None:
        self.sampler, self.loader = sampler, loader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator:
        start = self.sampler._start
        self.sampler._delivered = start
        try:
            for batch in self.loader:
                self.sampler._delivered += 1
                yield batch
        finally:
            self.sampler._position, self.sampler._delivered = self.sampler._delivered, None


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

    Resuming: :meth:`state_dict` / :meth:`load_state_dict` save and restore the epoch, the position in it
    (:attr:`position`, global batches taken) and the order's inputs; the next iteration after a load yields
    the epoch's remaining global batches. Global batch ``k`` of an epoch is the same set of samples under every
    plan (the plan only decides which rows of it a rank takes), so a resume under another plan, world size or
    stage layout continues with exactly the samples not yet seen this epoch. Refused (``ValueError``): another
    dataset length, ``shuffle``, ``drop_last`` or seed (another order), and another ``global_batch`` except at an
    epoch boundary.

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
        self._start, self._position, self._delivered = 0, 0, None  # see position, load_state_dict, PlanLoader
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
        self.loads = stage in (0, plan.last_stage)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order (call it before each epoch, with the same value on every rank). Another
        epoch than the current one starts at its first global batch; the current one keeps a loaded position."""
        if epoch != self.epoch:
            self._start = self._position = 0
        self.epoch = epoch

    @property
    def position(self) -> int:
        """Global batches of the current epoch taken so far: yielded by this sampler, or delivered by its
        :meth:`loader` while that is being iterated (a DataLoader's workers draw indices ahead)."""
        return self._position if self._delivered is None else self._delivered

    def state_dict(self) -> dict:
        """Plain-python resume state: ``{"epoch", "position", "seed", "global_batch", "dataset_len", "shuffle",
        "drop_last"}`` (equal on every rank that iterated alike; put it in a checkpoint's ``extra``)."""
        return dict(epoch=self.epoch, position=self.position, seed=self.seed, global_batch=self.global_batch,
                    dataset_len=self.dataset_len, shuffle=self.shuffle, drop_last=self.drop_last)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`state_dict`, maybe saved under another plan or world size): the next
        iteration yields epoch ``state["epoch"]``'s global batches from ``state["position"]`` on.

        Raises:
            ValueError: the state's dataset length, ``shuffle``, ``drop_last`` or seed differs from this
                sampler's (another order of the samples), or its ``global_batch`` does mid-epoch.
        """
        for key in ("dataset_len", "shuffle", "drop_last", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the sampler state has {key}={state[key]!r} but this PlanSampler has "
                                 f"{key}={getattr(self, key)!r}: the epoch's order would differ; build the sampler "
                                 f"with {key}={state[key]!r} to resume")
        if state["global_batch"] != self.global_batch and state["position"]:
            raise ValueError(f"the sampler state is {state['position']} global batch(es) of {state['global_batch']} "
                             f"into epoch {state['epoch']} but this PlanSampler's global batch is {self.global_batch}: "
                             f"resume mid-epoch with global_batch={state['global_batch']} (any plan or world size "
                             f"works), or change it at an epoch boundary")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"the sampler state's position {state['position']} is outside epoch of {len(self)} "
                             "global batches")
        self.epoch, self._start, self._position = int(state["epoch"]), int(state["position"]), int(state["position"])

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
        """Per step, this rank's dataset indices (``len(local_rows(...))`` of them), from the loaded position
        (:meth:`load_state_dict`; once) or the epoch's first global batch."""
        order = self.order()
        steps, b = len(self), self.global_batch
        if steps * b > len(order):  # complete the last global batch from the start (drop_last=False)
            order += (order * (steps * b // max(len(order), 1) + 1))[: steps * b - len(order)]
        start, self._start = self._start, 0
        self._position = start
        for s in range(start, steps):
            self._position = s + 1  # taken once it is handed out
            yield [order[s * b + r] for r in self._positions]

    def loader(self, dataset, **kwargs) -> PlanLoader | _Nones:
        """A :class:`PlanLoader` (``DataLoader(dataset, batch_sampler=self, **kwargs)`` counting the batches it
        delivers) where this rank loads data; on a middle pipeline stage an iterable of one ``None`` per step
        (pass them to ``engine.step_local`` as they are)."""
        return PlanLoader(self, DataLoader(dataset, batch_sampler=self, **kwargs)) if self.loads else _Nones(self)
