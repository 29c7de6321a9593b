"""The engine: executes a :class:`~whale.plan.plan.Plan` on this rank and decides nothing.

``Engine = f(model, plan)``: the stage comes from the plan's stage cut, the groups from its rank layout, the rows
of every micro-batch (and, between stages of different widths, which rows go to which lane of the next stage)
from its lane weights, the shard sizes from its shard weights. The engine orchestrates a
step; each part has one job: :class:`~whale.runtime.mesh.Mesh` (groups), :class:`~whale.parallel.regions.
SplitRuntime` (sharded modules and their rows), :class:`~whale.parallel.data.GradSync` (gradient reduction),
:class:`~whale.parallel.pipeline.StageExecutor` (the schedule), :class:`~whale.runtime.stats.StepHistory`
(measurements, re-balancing), :mod:`whale.runtime.emulation` and :mod:`whale.runtime.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from whale.memory.checkpointing import apply_checkpointing
from whale.memory.monitor import MemoryMonitor
from whale.parallel.data import broadcast_params
from whale.parallel.pipeline import MicroBatches, StageExecutor
from whale.parallel.regions import SplitRuntime
from whale.parallel.stage_links import StageLinks
from whale.parallel.stages import build_stage
from whale.parallel.zero_sync import build_grad_sync
from whale.plan.plan import Plan, PlanError
from whale.plan.schedule_chunks import schedule_for
from whale.runtime import heartbeat
from whale.runtime.batch import BatchError, agree_on_batch, batch_size
from whale.runtime.buffers import BufferSync, check_batchnorms
from whale.runtime.context import Context
from whale.runtime.emulation import EmulatedDevice, calibrate
from whale.runtime.engine_state import EngineState
from whale.runtime.groups import norm_owned_params, sync_sets
from whale.runtime.local import local_work
from whale.runtime.mesh import Mesh
from whale.runtime.microbatch import micro_batches
from whale.runtime.nonfinite import nonfinite_guard
from whale.runtime.offload import host_offload, params_on_device
from whale.runtime.optim import bind_optimizer
from whale.runtime.precision import MixedPrecision
from whale.runtime.rng import RankStreams
from whale.runtime.stats import StepHistory, StepTiming
from whale.runtime.update import GradientUpdate


def _links(plan: Plan, stage: int, lane: int) -> StageLinks:
    """This rank's place in the pipeline; interleaved plans add the wrap-around peers of its lane."""
    if plan.virtual_stages == 1:
        return StageLinks(stage, plan.num_stages)
    if plan.chunk_positions:  # stages of different chunk counts: the lane's rank on every stage
        return StageLinks(stage, plan.num_stages, len(plan.chunks_of(stage)), chunk_stages=plan.chunk_positions,
                          lane_ranks=tuple(plan.rank_of(s, lane) for s in range(plan.num_stages)))
    return StageLinks(stage, plan.num_stages, plan.virtual_stages, plan.rank_of(plan.num_stages - 1, lane),
                      plan.rank_of(0, lane))


class Engine(GradientUpdate, EngineState):
    """Runs training steps of one rank's stage under a plan. Made by :func:`whale.parallelize`.

    Args:
        model: the full local model, built identically on every rank.
        plan: the plan to run (from :func:`whale.plan_model`, or read back with ``Plan.from_json``).
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over the rows it is given, or a
            :class:`whale.loss.SumOverCount` (token-weighted: a sum over terms, normalised by the count of
            terms of the whole global batch).
        optimizer: a callable ``params -> Optimizer``, or a fresh optimizer over ``model.parameters()``
            (kept and re-pointed at this rank's parameters: its groups and LR schedulers drive training).
        ctx: this rank's context (:func:`whale.init`).
        stages: the pipeline's stage modules as the front end cut them for ``plan`` in this process (empty:
            rebuilt from the plan's cut).

    Attributes:
        plan: the plan (print it for a readable table); replaced, never mutated, by :meth:`rebalance` and
            :meth:`load_checkpoint`.
        module: this rank's stage module (the whole model when there is one stage); original FQNs. Under
            ZeRO-3 its sharded parameters are empty tensors outside a step: read them with
            :meth:`full_state_dict` or inside ``engine.zero.whole()`` (collective).
        optimizer: the optimizer over this rank's parameters (attach LR schedulers to it); under ZeRO its groups
            hold this lane's slices of the stage's replicated parameters (:mod:`whale.parallel.zero`).
        zero: this lane's :class:`~whale.parallel.zero.ZeroShards` under ``Config(zero=1 or 2)``, its
            :class:`~whale.parallel.zero3.Zero3Shards` under ``Config(zero=3)``, else ``None``.
        offload: the :class:`~whale.runtime.offload.HostOffload` under ``Config(offload=...)``, else ``None``
            (the optimizer's groups then hold host masters).
        stage, lane: this rank's pipeline stage and data-parallel lane.
        last_timeline: per action of the latest step, ``(label, start, compute_start, compute_end)`` seconds.
        schedule: every stage's actions (:mod:`whale.plan.schedule`); this rank runs ``schedule[stage]``.
        last_phases, last_step_wall: the latest step's gradient sync and optimizer ``(name, start, end)`` and its
            wall-clock start (:func:`whale.runtime.trace.write_step_trace` writes the step as a Chrome trace).

    Raises:
        StageError: the model does not match the plan's stage cut.
        SplitError: a split module has no sharding rule.
    """

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: Callable, optimizer, ctx: Context,
                 stages: tuple = ()) -> None:
        if plan.world_size != ctx.world_size:
            raise ValueError(f"the plan is for world size {plan.world_size} but this job has {ctx.world_size} "
                             "ranks; make a plan for this world size")
        self.plan, self.ctx, self.loss_fn = plan, ctx, loss_fn
        self._model = model  # the user's model: its modes (model.eval()) rule, also for traced stage calls
        self._batch_checks = {"step": 3, "eval": 1, "local": 3, "local_eval": 1}  # first calls (see _checked_...)
        self._rows = 0  # this lane's rows in the latest step
        self._layout_memo: tuple | None = None  # (plan, batch rows, rows, peers): runtime.microbatch._layout
        self._loss_started: Callable[[], list[float]] | None = None  # the step's loss all-reduce, when started early
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.stage, self.lane = plan.coords(ctx.rank)
        self.schedule = schedule_for(plan.schedule, plan.num_stages, plan.num_micro_batch, plan.virtual_stages,
                                     plan.chunk_positions)  # every stage's actions
        self.actions = self.schedule[self.stage]
        self.steps_done = 0
        self.run_id: str | None = None  # the checkpoint run (ckpt_runs): made at the first save, adopted by a load
        self.history = StepHistory()
        self.last_timeline: list = []
        self.last_phases: list = []  # (name, start, end) s from the schedule's start: gradient sync, optimizer
        self.last_step_wall = 0.0  # wall-clock time (time.time()) the latest step's schedule started
        full_params = {id(p) for p in model.parameters()}  # before split modules replace their full parameters
        stage_module = build_stage(model, plan, self.stage, stages)  # checks the plan on every rank, no collective
        if plan.max_lanes > 1:
            check_batchnorms(model)  # before any process group: a refused BatchNorm stops every rank alike
        self.mesh = Mesh(plan, ctx.rank, ctx.device.type)
        self.split = SplitRuntime(stage_module, plan, self.stage, self.mesh.split_group)
        self.module = self.split.module.to(ctx.device)
        for chunk in getattr(self.module, "chunks", [self.module]):  # interleaved: each chunk's graph
            apply_checkpointing(chunk, plan.activation_checkpoint)  # recompute in backward (whale.memory)
        self.buffers = BufferSync(model, self.module, plan, self.mesh, self.split.regions)  # global BatchNorm
        groups = sync_sets(plan, self.module, self.mesh, self.split.params)
        broadcast_params(groups, {g: Mesh.source(g) for g, _ in groups if g is not None})
        self.optimizer = bind_optimizer(optimizer, self.module, full_params, self.split.origins)
        self.grad_sync, self.zero = build_grad_sync(plan, groups, self.mesh.lanes, self.mesh.tied,
                                                    self.optimizer, ctx.config.bucket_cap_mb,
                                                    self.module)  # ZeRO: parallel/zero.py, zero3.py
        bucketed = {id(p) for b in self.grad_sync.buckets for p in b.params}
        self._unbucketed = [p for p in self.module.parameters() if id(p) not in bucketed]
        owners = norm_owned_params(plan, self.module, self.mesh, self.split.params)
        self._norm_owner = self.zero.norm_params(owners) if self.zero is not None else owners
        self.nonfinite = nonfinite_guard(self, loss_fn)  # NaN/inf losses and gradients: runtime/nonfinite.py
        self.executor = StageExecutor(self.module, _links(plan, self.stage, self.lane), self.nonfinite.loss_fn,
                                      ctx.device, self.split.counts_loss(plan, self.lane), self._arm)
        self.precision = MixedPrecision(plan.precision, ctx.device, ctx.config.loss_scale)  # runtime/precision.py
        self.executor.precision = self.precision if self.precision.dtype is not None else None
        self.executor.on_phase = heartbeat.beat
        self._set_emulator(calibrate(ctx.cluster, ctx.rank, ctx.world_size))
        self.rng = RankStreams(self.module, self.split.regions, plan, self.stage, self.lane, ctx.config.seed,
                               ctx.device, lambda: self.steps_done)  # per-lane / per-shard random streams
        self.memory = MemoryMonitor.for_rank(self.module, self.optimizer, ctx, plan)  # whale.memory.memory_table
        self.offload = host_offload(self)  # optimizer state (and parameters) in host memory: runtime/offload.py
        if self.zero is not None:
            self.zero.tracker = self.memory.tracker  # ZeRO-3 reports each gather and free
            self.executor.weight_pass = "replay"  # ZB-H1's W must pass ZeRO-3's gather hooks on unit outputs

    # --- emulation ---------------------------------------------------------------------------------------
    @property
    def slowdown(self) -> float | None:
        """Emulation only: this rank's extra wait per second of compute; ``None`` when not emulating (real
        hardware). 0 is an emulated device as fast as this core, with steady segment times. Setting it starts a
        fresh emulated device (:class:`whale.runtime.emulation.EmulatedDevice`), which also schedules this
        rank's gradient all-reduces.

        Raises:
            ValueError: a negative value.
        """
        return self.executor.emulator.slowdown if self.executor.emulator is not None else None

    @slowdown.setter
    def slowdown(self, value: float | None) -> None:
        """Start a fresh emulated device with this slowdown (``None``: real hardware, no emulation)."""
        if value is not None and value < 0:
            raise ValueError(f"slowdown must be >= 0 (extra seconds per second of compute), got {value}")
        self._set_emulator(EmulatedDevice(value) if value is not None else None)

    def _set_emulator(self, device: EmulatedDevice | None) -> None:
        self.executor.emulator = device
        self.grad_sync.scheduler = device  # bucket all-reduces start at their emulated times

    # --- stepping ----------------------------------------------------------------------------------------
    def _micro_batches(self, batch, metrics: dict | None = None, global_batch: int | None = None) -> MicroBatches:
        """This rank's work of ``batch`` (:func:`whale.runtime.microbatch.micro_batches`)."""
        return micro_batches(self, batch, metrics, global_batch)

    def _checked_micro_batches(self, batch, kind: str, metrics: dict | None = None) -> MicroBatches:
        """:meth:`_micro_batches`; on the first calls of each kind, every rank also agrees that all were given
        the same valid global batch (:func:`whale.runtime.batch.agree_on_batch`), so a bad batch on one rank
        stops every rank instead of leaving its peers in a collective."""
        if not self._batch_checks[kind]:
            return self._micro_batches(batch, metrics)
        self._batch_checks[kind] -= 1
        work, error = None, None
        try:
            work = self._micro_batches(batch, metrics)
        except (BatchError, PlanError) as exc:
            error = exc
        agree_on_batch(batch, self.world_size, self.ctx.device, error)
        return work

    def step(self, batch) -> dict:
        """One optimizer step on the global mini-batch ``batch = (inputs, target)``.

        ``inputs`` (a tensor or tuple of tensors, dim 0 = samples) and ``target`` must be the same global
        batch on every rank; each rank takes its rows from the plan. Modules run in their own modes, as in one
        process (``model.train()`` is the default; a submodule put in ``eval()``, e.g. a frozen BatchNorm,
        stays so).

        Returns:
            ``{"loss": mean loss over the global batch, "step_time": s, "schedule_time": s, "busy_time": s of
            this rank's compute, "samples": global batch size, "stage": s, "lane": l, "sync_bytes": gradient
            bytes all-reduced by this rank}``, ``"grad_norm"`` when clipping, under fp16 ``"loss_scale"`` (the
            scale for the next step), under fp16 or ``Config(nonfinite="skip")`` ``"skipped"`` (an overflow or a
            NaN/inf anywhere skipped this update; then also ``"nonfinite"``: the first NaN/inf tensor), and when
            memory is measured ``"peak_memory_bytes"``, ``"memory"``, ``"memory_category_peaks"``
            (``MemoryMonitor.end_step``).

        Raises:
            PlanError: the batch does not divide into micro-batches or is smaller than the lanes.
            BatchError: inputs and target of different row counts, or (checked on the first 3 steps) ranks
                given different batches; every rank raises, none is left waiting.
            EmulatedOutOfMemoryError: emulated cluster: a rank's measured peak over its memory (all raise).
            NonFiniteError, LossShapeError: a NaN/inf loss or gradient, a non-scalar loss (all ranks raise).
        """
        start = time.perf_counter()
        heartbeat.beat("batch check", step=self.steps_done + 1)  # the launcher names a hung rank's step, phase
        work = self._checked_micro_batches(batch, "step")
        return self._train(work, start, batch_size(batch))

    def step_local(self, batch, global_batch: int) -> dict:
        """One optimizer step, each rank given only ITS OWN rows of the global batch: the same step (same
        losses, gradients and update) as :meth:`step` on the whole global batch.

        Args:
            batch: ``(inputs, target)`` with this rank's lane's rows in the order of :func:`whale.local_rows`
                (what :class:`whale.PlanSampler` yields). Stage 0 reads only ``inputs``, the last stage only
                ``target`` (the other may be ``None``); a middle pipeline stage passes ``None``.
            global_batch: rows of the global batch (all lanes together), equal on every rank; rows and a
                token-weighted loss (:class:`whale.loss.SumOverCount`) are normalised over it (the count of
                terms is summed over the last stage's lanes: one small all-reduce there per step).

        Returns:
            as :meth:`step` (``"samples"`` is ``global_batch``).

        Raises:
            PlanError: ``global_batch`` does not divide into micro-batches or leaves a lane empty.
            BatchError: a local batch that is not this rank's share (wrong rows; a missing input or target),
                ranks given different ``global_batch`` (checked on the first 3 steps and after a plan change:
                every rank raises, none is left waiting), or a model ending in class-sharded logits (its loss
                needs the split group's targets: use :meth:`step`).
        """
        start = time.perf_counter()
        heartbeat.beat("batch check", step=self.steps_done + 1)
        return self._train(local_work(self, batch, global_batch, "local"), start, global_batch)

    def _train(self, work: MicroBatches, start: float, samples: int) -> dict:
        """The body of :meth:`step` and :meth:`step_local`, its memory measured (:attr:`memory`)."""
        with params_on_device(self.offload), self.memory.tracking():
            out = self._update(work, start, samples)
        return out | self.memory.end_step()

    def _update(self, work: MicroBatches, start: float, samples: int) -> dict:
        """Run the schedule on ``work``, reduce gradients and update."""
        before = self.grad_sync.bytes_reduced
        self.grad_sync.start_step()
        self.nonfinite.start()
        wall, t0 = time.time(), time.perf_counter()
        result = self.executor.run(self.actions, work, train=True)
        t1 = time.perf_counter()
        schedule_time = t1 - start
        heartbeat.beat("gradient sync")
        self.grad_sync.finish()  # every gradient collective is launched (in the same order on every rank) first
        heartbeat.beat("optimizer")
        t2 = time.perf_counter()
        loss, norm, skipped = self._apply_gradients(result.loss_sum)
        self.last_step_wall = wall
        self.last_phases = [("gradient sync", t1 - t0, t2 - t0), ("optimizer", t2 - t0, time.perf_counter() - t0)]
        self.buffers.after_step()  # buffers equal on every lane (runtime/buffers.py)
        self.steps_done += 1
        heartbeat.beat("after the step (in the training script)")
        self.history.record(StepTiming(result.busy, schedule_time, self._rows))
        if self.ctx.config.rebalance_after and self.steps_done == self.ctx.config.rebalance_after:
            self.rebalance()
        self.last_timeline = result.timeline
        out = {"loss": loss, "step_time": time.perf_counter() - start, "schedule_time": schedule_time,
               "busy_time": result.busy, "samples": samples, "stage": self.stage, "lane": self.lane,
               "sync_bytes": self.grad_sync.bytes_reduced - before}
        if norm is not None:
            out["grad_norm"] = norm
        if self.precision.scaler is not None:
            out["loss_scale"] = float(self.precision.scaler.scale)
        return out | self.nonfinite.metrics(skipped, self.precision.scaler is not None)

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
        return self._evaluate(lambda: self._checked_micro_batches(batch, "eval", metrics), metrics)

    @torch.no_grad()
    def eval_step_local(self, batch, global_batch: int, metrics: dict[str, Callable] | None = None) -> dict:
        """:meth:`eval_step` with each rank given only its own rows, as in :meth:`step_local` (same arguments,
        result and errors)."""
        return self._evaluate(lambda: local_work(self, batch, global_batch, "local_eval", metrics), metrics)

    def _evaluate(self, make_work: Callable[[], MicroBatches], metrics: dict | None) -> dict:
        """Run the forwards on ``make_work()`` with every module in eval mode; sum loss and metrics globally."""
        roots = (self.module, self._model)
        modes = [(m, m.training) for r in roots for m in r.modules()]  # the user's own modes come back afterwards
        for r in roots:
            r.eval()
        self.nonfinite.start()
        try:
            forwards = [a for a in self.actions if a.kind == "F"]
            with params_on_device(self.offload):
                result = self.executor.run(forwards, make_work(), train=False)
        finally:
            for m, training in modes:
                m.training = training
            if self.zero is not None:
                self.zero.release()  # ZeRO-3: the root unit stays gathered after a forward
        names = list(metrics or {})
        values = self._global_sum([result.loss_sum] + [result.metric_sums.get(k, 0.0) for k in names]
                                  + [self.nonfinite.refused()])
        self.nonfinite.after_eval(values.pop(), self.steps_done)  # a non-scalar loss: every rank raises
        return {"loss": values[0], **dict(zip(names, values[1:], strict=True))}

    # --- measurements ------------------------------------------------------------------------------------
    def rebalance(self) -> Plan:
        """Re-balance the lanes' batch shares from the compute time per sample measured over recent steps
        (collective: every rank must call it; see :meth:`whale.runtime.stats.StepHistory.rebalance`). Only the
        shares change, so nothing is rebuilt.

        Returns:
            The new plan (also ``self.plan``).
        """
        self.plan = self.history.rebalance(self.plan, self.lane, self.world_size, self.stage)
        self._recheck_local()
        return self.plan

    def switch_shares(self, plan: Plan) -> None:
        """Run ``plan`` from the next step: the same plan but for its lane shares (a straggler controller's choice,
        :mod:`whale.elastic.straggler`); nothing is rebuilt and the optimizer state stays. Every rank must switch
        at the same step (then set the loaders' rows to :func:`whale.local_rows` of the new plan).

        Raises:
            PlanError: ``plan`` differs in more than its shares, notes and predicted utilization.
        """
        old = self.plan
        if dataclasses.replace(plan, lane_weights=old.lane_weights, stage_lane_weights=old.stage_lane_weights,
                               notes=old.notes, predicted_utilization=old.predicted_utilization) != old:
            raise PlanError("switch_shares takes a plan that differs only in its lane shares; rebuild the engine "
                            "(or save and load a checkpoint) to change anything else")
        plan.validate()
        self.plan = plan
        self._recheck_local()

    def _recheck_local(self) -> None:
        """New shares: the next local batches are checked collectively again (a loader still on the old
        shares then stops every rank with a BatchError)."""
        self._batch_checks.update(local=3, local_eval=1)

    def stage_stats(self) -> list[dict]:
        """Per stage, mean busy seconds and the schedule's makespan over the last 20 steps, with
        ``idle_share`` (collective; see :meth:`whale.runtime.stats.StepHistory.stage_stats`)."""
        return self.history.stage_stats(self.plan, self.stage, self.world_size)
