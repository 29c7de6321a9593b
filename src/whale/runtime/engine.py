"""The engine: executes a :class:`~whale.plan.plan.Plan` on this rank. It decides nothing: batch rows,
groups, schedule and stage all come from the plan."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from whale.parallel.data import GradSync, broadcast_params
from whale.parallel.pipeline import StageRun, execute
from whale.parallel.regions import install_split_regions
from whale.parallel.schedule import Action, make_schedule
from whale.plan import hardware
from whale.plan.plan import Plan
from whale.runtime import checkpoint
from whale.runtime.context import Context
from whale.runtime.emulation import (
    EmulatedDevice,
    calibrated_slowdowns,
    emulation_slowdown,
    measure_unit_time,
)
from whale.runtime.groups import build_groups, norm_owned_params, sync_sets
from whale.runtime.optim import make_optimizer


def _slice(x, start: int, stop: int):
    if isinstance(x, torch.Tensor):
        return x[start:stop]
    if isinstance(x, tuple | list):
        return type(x)(_slice(v, start, stop) for v in x)
    return x


def _batch_size(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.size(0)
    if isinstance(x, tuple | list) and x:
        return _batch_size(x[0])
    raise TypeError(f"cannot find the batch dimension of {type(x).__name__}: pass tensors (dim 0 = samples)")


class Engine:
    """Runs training steps of one rank's stage under a plan. Made by :func:`whale.parallelize`.

    Attributes:
        plan: the plan (print it for a readable table).
        module: this rank's stage module (the whole model when there is one stage); original FQNs.
        optimizer: the optimizer over this rank's parameters (attach LR schedulers to it).
        stage, lane: this rank's pipeline stage and data-parallel lane.
    """

    def __init__(self, plan: Plan, module: nn.Module, loss_fn: Callable, optimizer, ctx: Context,
                 shared_stages: list[list[int]] | None = None) -> None:
        self.plan, self.loss_fn, self.ctx = plan, loss_fn, ctx
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.stage, self.lane = plan.coords(ctx.rank)
        self.actions: list[Action] = make_schedule(plan.schedule, plan.num_stages, plan.num_micro_batch)[self.stage]
        self.steps_done = 0
        self._history: deque = deque(maxlen=20)
        self.last_timeline: list = []
        """Per action of the latest step: ``(label, start, compute_start, compute_end)`` seconds."""
        shared_stages = shared_stages or []
        groups = build_groups(plan, shared_stages) if ctx.world_size > 1 else {}
        self.module, self.regions = install_split_regions(module, plan, self.stage, self.lane, groups)
        self.module.to(ctx.device)
        self.split_loss = any(r.sharded_output for r in self.regions)
        split_params = {id(p) for r in self.regions for p in r.parameters()}
        self._param_groups = sync_sets(plan, self.module, self.stage, self.lane, groups, shared_stages, split_params)
        broadcast_params(self._param_groups, {g: min(r) for r, g in groups.items() if g is not None})
        self.optimizer = make_optimizer(optimizer, self.module)
        self.grad_sync = GradSync(self._param_groups, ctx.config.bucket_cap_mb)
        bucketed = {id(p) for b in self.grad_sync.buckets for p in b.params}
        self._unbucketed = [p for p in self.module.parameters() if id(p) not in bucketed]
        self.slowdown = self._emulation(ctx)
        self._norm_owner = norm_owned_params(plan, self.module, self.stage, self.lane, shared_stages,
                                             split_params)

    @property
    def slowdown(self) -> float | None:
        """Emulation only: this rank's extra wait per second of compute; ``None`` when not emulating (real
        hardware). 0 is an emulated device as fast as this core, with steady segment times. Setting it restarts
        the emulated device (:class:`whale.runtime.emulation.EmulatedDevice`).

        Raises:
            ValueError: a negative value.
        """
        return self._emulator.slowdown if self._emulator is not None else None

    @slowdown.setter
    def slowdown(self, value: float | None) -> None:
        """Set the extra wait per second of compute (>= 0; ``None`` turns emulation off) and start a fresh
        emulated device, which also schedules this rank's gradient all-reduces.

        Raises:
            ValueError: a negative value.
        """
        if value is not None and value < 0:
            raise ValueError(f"slowdown must be >= 0 (extra seconds per second of compute), got {value}")
        self._emulator = EmulatedDevice(value) if value is not None else None
        self.grad_sync.scheduler = self._emulator  # bucket all-reduces start at their emulated times

    def _emulation(self, ctx: Context) -> float | None:
        """Under an emulated cluster, this rank's slowdown, calibrated to the real speed of every rank's core
        (collective); ``None`` otherwise."""
        if ctx.cluster is None or not ctx.cluster.emulate:
            return None
        if ctx.world_size == 1:
            return emulation_slowdown(ctx.cluster, ctx.rank, ctx.world_size)
        times = [None] * ctx.world_size
        dist.barrier()  # probe together: every rank under the same host load
        dist.all_gather_object(times, measure_unit_time())
        return calibrated_slowdowns(ctx.cluster, times, ctx.world_size)[ctx.rank]

    # --- stepping ----------------------------------------------------------------------------------------
    def _stage_run(self, batch, metrics: dict | None = None) -> StageRun:
        inputs, target = batch
        total = _batch_size(inputs)
        rows_all = self.plan.micro_batch_rows(total)
        rows = rows_all[self.lane]
        n = self.plan.stage_width
        first_lane = self.lane - self.lane % n
        for region in self.regions:
            region.set_rows([rows_all[lane][0][1] - rows_all[lane][0][0] for lane in range(first_lane, first_lane + n)])
        loss_rows = rows
        if self.split_loss:  # class-sharded logits cover the rows of every lane of this replica
            loss_rows = [(a, rows_all[first_lane + n - 1][i][1]) for i, (a, _) in enumerate(rows_all[first_lane])]
        is_last = self.stage == self.plan.num_stages - 1
        prev = self.plan.rank_of(self.stage - 1, self.lane) if self.stage > 0 else None
        nxt = self.plan.rank_of(self.stage + 1, self.lane) if not is_last else None
        dev = self.ctx.device
        return StageRun(
            module=self.module, stage=self.stage, num_stages=self.plan.num_stages, prev_rank=prev, next_rank=nxt,
            inputs=[_to(_slice(inputs, a, b), dev) for a, b in rows] if self.stage == 0 else [],
            targets=[_to(_slice(target, a, b), dev) for a, b in loss_rows] if is_last else [],
            scales=[(b - a) / total for a, b in loss_rows], loss_fn=self.loss_fn, device=dev,
            before_last_backward=self._arm, count_loss=not self.split_loss or self.lane % n == 0,
            metric_fns=metrics or {}, emulator=self._emulator,
        )

    def _fuse_loss(self) -> bool:
        # one stage, no split, no shared groups: the loss rides on the last gradient bucket (the DP group)
        return (self.plan.num_stages == 1 and not self.regions and not self.plan.shared_params
                and bool(self.grad_sync.buckets))

    def _arm(self, run: StageRun) -> None:
        extra = torch.tensor([run.loss_sum], dtype=torch.float64) if self._fuse_loss() else None
        self.grad_sync.arm(extra)

    def _global_sum(self, values: list[float], fused: bool = False) -> list[float]:
        if fused:
            return [float(self.grad_sync.extra[0])]
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(t)
        return t.tolist()

    def step(self, batch) -> dict:
        """One optimizer step on the global mini-batch ``batch = (inputs, target)``.

        ``inputs`` (a tensor or tuple of tensors, dim 0 = samples) and ``target`` must be the same global
        batch on every rank; each rank takes its rows from the plan.

        Returns:
            ``{"loss": mean loss over the global batch, "step_time": s, "busy_time": s of this rank's compute,
            "samples": global batch size, "stage": s, "lane": l, "sync_bytes": bytes all-reduced by this rank}``.

        Raises:
            PlanError: the batch does not divide into micro-batches or is smaller than the lanes.
        """
        start = time.perf_counter()
        self.module.train()
        before = self.grad_sync.bytes_reduced
        run = execute(self._stage_run(batch), self.actions, self.plan.num_micro_batch, train=True)
        schedule_time = time.perf_counter() - start
        self.grad_sync.finish()
        norm = self._clip() if self.ctx.config.max_grad_norm else None
        self.optimizer.step()
        self._zero_grad()
        (loss,) = self._global_sum([run.loss_sum], fused=self._fuse_loss())
        elapsed = time.perf_counter() - start
        self.steps_done += 1
        if self.ctx.config.rebalance_after and self.steps_done == self.ctx.config.rebalance_after:
            self.rebalance()
        self._history.append((run.busy, schedule_time, sum(b - a for a, b in
                                                           self.plan.micro_batch_rows(_batch_size(batch[0]))[self.lane])))
        self.last_timeline = run.timeline
        out = {"loss": loss, "step_time": elapsed, "schedule_time": schedule_time, "busy_time": run.busy,
               "samples": _batch_size(batch[0]), "stage": self.stage, "lane": self.lane,
               "sync_bytes": self.grad_sync.bytes_reduced - before}
        if norm is not None:
            out["grad_norm"] = norm
        return out

    def _zero_grad(self) -> None:
        """Zero the bucketed gradients in place; drop the others (not reduced, e.g. world size 1)."""
        self.grad_sync.zero_grad()
        for p in self._unbucketed:
            p.grad = None

    def _clip(self) -> float:
        """Clip the global gradient norm to ``config.max_grad_norm``; returns the norm before clipping."""
        sq = sum(float(p.grad.detach().float().pow(2).sum()) for p in self._norm_owner if p.grad is not None)
        (total,) = self._global_sum([sq])
        norm = total ** 0.5
        coef = self.ctx.config.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def eval_step(self, batch, metrics: dict[str, Callable] | None = None) -> dict:
        """Forward only (eval mode) on the global batch.

        Args:
            batch: ``(inputs, target)``, the global batch as in :meth:`step`.
            metrics: ``{name: fn(output, target) -> mean over the rows}``, e.g. ``{"accuracy": wh.accuracy}``;
                averaged over the global batch like the loss.

        Returns:
            ``{"loss": mean over the global batch, **metrics}``.
        """
        self.module.eval()
        fwd = [a for a in self.actions if a.kind == "F"]
        run = execute(self._stage_run(batch, metrics), fwd, self.plan.num_micro_batch, train=False)
        self.module.train()
        names = list(metrics or {})
        values = self._global_sum([run.loss_sum] + [run.metric_sums.get(k, 0.0) for k in names])
        return {"loss": values[0], **dict(zip(names, values[1:], strict=True))}

    def rebalance(self) -> Plan:
        """Re-balance the lanes' batch shares from the compute time per sample measured over recent steps
        (collective: every rank must call it): per rank, the median over the recorded steps (up to 20) of
        busy seconds / rows, so a first step's one-off costs (allocation, warm-up) do not skew it. The new plan
        comes from the pure planner function :func:`whale.plan.hardware.rebalance`; only the shares change, so
        nothing is rebuilt.

        Returns:
            The new plan (also ``self.plan``).
        """
        per_row = [h[0] / h[2] for h in self._history if h[2]]
        mine = (self.lane, statistics.median(per_row) if per_row else 0.0)
        every = [mine] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(every, mine)
        per_lane = [0.0] * self.plan.num_lanes
        for lane, t in every:
            per_lane[lane] = max(per_lane[lane], t)
        self.plan = hardware.rebalance(self.plan, per_lane)
        self._history.clear()
        return self.plan

    def stage_stats(self) -> list[dict]:
        """Per stage, mean busy (compute) and schedule seconds over the last 20 steps, gathered from all ranks
        (collective: every rank must call it). ``step`` is the makespan of the forward/backward schedule (the
        longest stage window; gradient sync and the optimizer step excluded), so ``idle_share = 1 - busy/step``
        is the pipeline bubble plus stage-to-stage transfer time, comparable with (p-1)/(m+p-1)."""
        mine = [sum(h[0] for h in self._history), sum(h[1] for h in self._history), len(self._history)]
        allv = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(allv, (self.stage, mine))
        else:
            allv = [(self.stage, mine)]
        out = []
        for s in range(self.plan.num_stages):
            rows = [v for st, v in allv if st == s and v[2]]
            busy = sum(r[0] / r[2] for r in rows) / max(1, len(rows))
            step = sum(r[1] / r[2] for r in rows) / max(1, len(rows))
            out.append({"stage": s, "busy": busy, "step": step})
        window = max(o["step"] for o in out)  # the schedule's makespan: the slowest stage's window
        for o in out:
            o["step"] = window
            o["idle_share"] = 1 - o["busy"] / window if window else 0.0
        return out

    # --- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: ``{"model": stage state dict (original FQNs), "optimizer": ..., "step": n}``."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict` for the same plan."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = int(state.get("step", 0))

    def full_state_dict(self) -> dict:
        """The whole model's state dict (original names, CPU tensors) on rank 0; ``{}`` elsewhere.
        Collective: every rank must call it."""
        return checkpoint.gather_full_state(self)

    def save_checkpoint(self, path: str, extra: dict | None = None) -> None:
        """Every rank writes its shard, RNG state and ``extra`` (plain Python) under ``path``."""
        checkpoint.save(self, path, extra or {})

    def load_checkpoint(self, path: str) -> dict:
        """Restore what :meth:`save_checkpoint` wrote (same plan); returns the saved ``extra``."""
        return checkpoint.load(self, path)


def _to(x, device: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, tuple | list):
        return type(x)(_to(v, device) for v in x)
    return x
