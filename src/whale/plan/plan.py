"""The plan: frozen, printable, JSON-round-trippable data that fully describes how a model runs.

The plan is the whole contract between planning and running: the front end (:mod:`whale.frontend`) makes one
from a model, its annotations and a cluster; the runtime executes it and decides nothing. A change (a
rebalance, a resume with other shares) makes a new plan with :func:`dataclasses.replace`; a plan is never
mutated. ``Plan.from_json(plan.to_json()) == plan`` holds exactly.

Rank layout (see :mod:`whale.plan.layout`). Stage ``s`` runs on ``n_s`` devices per replica; K nested replicas
each span ``D = sum(n_s)`` ranks, and slot ``k*D + n_0 + ... + n_{s-1} + j`` runs stage ``s`` for its
data-parallel *lane* ``k*n_s + j``; ``device_order`` maps slots to global ranks (identity when empty). With
equal widths n this is the rank grid ``[S, K, n]`` (mesh axes ``pp``, ``dp``, ``tp``) and a lane is one path of
a micro-batch through all stages; stages of different widths each split a micro-batch over their own lanes and
a batch bridge re-splits the rows between neighbours.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal, get_args

from whale.plan.checks import (
    _BOOL,
    _STR,
    Check,
    PlanError,
    _check_keys,
    _choice,
    _fail,
    _int,
    _node,
    _real,
    _seq,
)
from whale.plan.layout import PlanLayout
from whale.plan.printing import format_plan
from whale.plan.schedule import RUNNABLE_SCHEDULES, ScheduleName
from whale.plan.validation import PlanChecks

Kind = Literal["replicate", "split"]
KINDS: tuple[str, ...] = get_args(Kind)
CaptureName = Literal["fx", "export"]
CAPTURES: tuple[str, ...] = get_args(CaptureName)
PrecisionName = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
OffloadName = Literal["none", "optimizer", "optimizer+params"]
OFFLOADS: tuple[str, ...] = get_args(OffloadName)


class _Checked:
    """Base of the plan's parts: on construction (and ``dataclasses.replace``) every field is checked and
    stored as its checker in ``_FIELDS`` says; errors name ``Class.field`` (``field`` for the Plan)."""

    def __post_init__(self) -> None:
        prefix = "" if isinstance(self, Plan) else type(self).__name__ + "."
        for name, check in next(spec for cls, spec in _FIELDS.items() if isinstance(self, cls)).items():
            object.__setattr__(self, name, check(getattr(self, name), prefix + name))


@dataclass(frozen=True)
class NestedScope(_Checked):
    """A scope nested in a TaskGraph: today a ``split`` inside a ``replicate`` (a sharded operator inside each
    replica, over the replica's devices).

    Attributes:
        kind: ``"split"`` (the one meaningful nesting).
        device_count: devices requested by the annotation (``None`` = the TaskGraph's devices).
        modules: module FQNs it shards.
        shard_weights: relative shard size per device of the replica (empty = equal shards).
    """

    kind: Kind
    device_count: int | None
    modules: tuple[str, ...] = ()
    shard_weights: tuple[float, ...] = ()


@dataclass(frozen=True)
class TaskGraph(_Checked):
    """One annotated part of the model and the devices (per replica) that run it.

    Attributes:
        index: position in model order (= pipeline stage when pipelined).
        kind: ``"replicate"`` or ``"split"``.
        device_count: devices per replica in its VirtualDevice.
        modules: module FQNs (or ``module.param`` names) it holds, compressed to the largest whole modules.
        num_params: parameter elements it holds; a parameter tied across stages counts in the first only.
        nested: scopes nested inside it.
        shard_weights: for ``split``, the relative shard size of each device of the VD (empty = equal).
    """

    index: int
    kind: Kind
    device_count: int
    modules: tuple[str, ...] = ()
    num_params: int = 0
    nested: tuple[NestedScope, ...] = ()
    shard_weights: tuple[float, ...] = ()

    @property
    def has_split(self) -> bool:
        """True when this TaskGraph, or a scope nested in it, shards operators."""
        return self.kind == "split" or any(n.kind == "split" for n in self.nested)


@dataclass(frozen=True)
class SharedParam(_Checked):
    """One parameter held by several pipeline stages (a tied input embedding and output head); its gradients
    are summed over every rank of every stage holding it.

    Attributes:
        names: every FQN of the tensor in the model (sorted).
        stages: the stages holding it (ascending).
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]


@dataclass(frozen=True)
class MoELayer(_Checked):
    """A Mixture-of-Experts layer (:class:`whale.MoE`) under ``split``: expert parallelism over the split group.
    Its experts per device are the whole units of its split's shard weights (at least one each,
    :func:`whale.plan.shares.whole_shares`), derived from the plan, never stored twice.

    Attributes:
        module: the layer's FQN (a split target of some stage).
        num_experts: E.
        top_k: experts per token.
        expert_params: parameter elements of one expert (what each expert a device holds adds).
    """

    module: str
    num_experts: int
    top_k: int = 1
    expert_params: int = 0


@dataclass(frozen=True)
class StageCut(_Checked):
    """What one pipeline stage runs, by name, in the model's ``torch.fx`` trace (with the plan's
    ``leaf_modules`` traced as single calls).

    Attributes:
        nodes: names of the graph nodes (calls) the stage runs, in graph order.
        params: parameter FQNs the stage holds (tied ones under every name it uses).
        buffers: buffer FQNs the stage holds.
        units: the layer units the hardware-aware cut gave this stage (empty when the annotations cut).
    """

    nodes: tuple[str, ...]
    params: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    units: tuple[str, ...] = ()


@dataclass(frozen=True)
class CaptureInput(_Checked):
    """One forward argument of the example the model was captured with by ``torch.export`` (every rank
    re-captures from these; values do not matter, export traces shapes and dtypes).

    Attributes:
        name: keyword name, or ``"#i"`` for the i-th positional argument.
        dtype: torch dtype name (``"int64"``) of a tensor; empty for a constant.
        shape: the tensor's shape (dim 0 = batch rows, captured as dynamic); empty for a constant.
        constant: a non-tensor value as JSON text (``"false"``); empty for a tensor.
    """

    name: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    constant: str = ""


@dataclass(frozen=True)
class Plan(_Checked, PlanLayout, PlanChecks):
    """TaskGraphs x VirtualDevices x per-lane loads x schedule x stage cut x shared parameters.

    Attributes:
        world_size: number of ranks.
        task_graphs: TaskGraphs in model order; with several (not colocated) each one is a pipeline stage.
        num_replicas: K, the nested data-parallel degree (whole pipeline copied K times).
        num_micro_batch: micro-batches per mini-batch.
        schedule: ``"1F1B"``, ``"GPipe"`` or ``"ZB-H1"`` (:data:`whale.plan.schedule.RUNNABLE_SCHEDULES`).
        lane_weights: relative batch load of each lane (len = K * n) when every stage has the same width n;
            batch rows are apportioned exactly. Empty when the stages have different widths.
        shared_params: parameters held by several stages (tied weights).
        stage_cuts: per pipeline stage, the graph nodes, parameters and buffers it owns (empty = no cut:
            one stage runs the whole model).
        leaf_modules: modules traced as single calls when cutting (the split targets, swapped for their
            shards at run time).
        colocated: the TaskGraphs share the same devices and run one after another in one stage (Whale's
            replicate backbone + split head); otherwise each TaskGraph is a pipeline stage on its own devices.
        device_order: slot -> global rank (empty = identity); see the module docstring.
        devices: device type name of each rank (from the cluster spec; empty when unknown).
        predicted_utilization: per rank, predicted busy share of the step: its compute time over the slowest
            rank's (1.0 = the bottleneck; empty when not hardware-aware).
        stage_flops: training FLOPs per sample of each stage, when the model was profiled.
        notes: free-form lines shown in the printout (e.g. "emulated cluster").
        stage_lane_weights: stages of different widths only (empty otherwise): per stage, the relative batch
            load of each of its ``K * n_s`` lanes.
        capture: how the stage cut's graph was captured: ``"fx"`` (``torch.fx.symbolic_trace``) or
            ``"export"`` (``torch.export``, non-strict, from ``capture_inputs``).
        capture_inputs: the example forward arguments of an ``"export"`` capture.
        zero: ZeRO stage over each pipeline stage's data-parallel lanes (Rajbhandari et al., SC 2020): 0 none,
            1 optimizer state sharded, 2 also gradients (reduce-scatter), 3 also parameters (gathered per unit
            before use, freed after); see :mod:`whale.parallel.zero` and :mod:`whale.parallel.zero3`.
        zero_weights: with ``zero >= 1``, per stage the relative shard size of each of its lanes (numbers >= 0,
            by lane index; empty = equal shards), sized by device memory (:mod:`whale.planner.zero`).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the autocast dtype of every stage's forward (fp16 with
            dynamic loss scaling; see :mod:`whale.runtime.precision`). Parameters stay fp32.
        activation_checkpoint: FQNs of the modules whose activations are recomputed in backward
            (:mod:`whale.memory.checkpointing`); none nested in another, none overlapping a split module.
        moe_layers: the MoE layers under split (expert parallelism), for the printout's experts per device.
        predicted_memory: per rank, the planner's predicted peak device bytes (parameters, gradients, optimizer
            state unless offloaded, and activations in flight; empty when the model was not profiled).
        offload: what each rank keeps in host memory with the optimizer step on the host (ZeRO-Offload):
            ``"none"``, ``"optimizer"`` (fp32 master copies, gradients and optimizer state of the parameters it
            updates, its ZeRO slice under ``zero >= 1``) or ``"optimizer+params"`` (also the stage's parameters
            between steps; under ``zero=3`` the lane's parameter and gradient shards, gathered unit by unit);
            see :mod:`whale.runtime.offload`.
        virtual_stages: model chunks per rank (``"Interleaved1F1B"``; 1 otherwise): the ``p * v`` TaskGraphs
            and stage cuts are chunks, chunk ``c*p + r`` on the ranks of pipeline stage r (:mod:`whale.plan.layout`);
            ``shared_params`` then name pipeline stages (rank positions).
        chunk_positions: interleaved plans whose stages hold different chunk counts: the pipeline stage of each
            of the ``p * v`` chunks (model order; every stage at least one, chunk 0 on stage 0; ``v`` on average),
            run by :func:`whale.plan.schedule_chunks.chunked_1f1b`; empty = round-robin, chunk c on stage ``c % p``.
        sequence_parallel: split regions whose rule supports it run on sequence shards
            (:mod:`whale.parallel.seqpar`).
    """

    world_size: int
    task_graphs: tuple[TaskGraph, ...]
    num_replicas: int
    num_micro_batch: int = 1
    schedule: ScheduleName = "1F1B"
    lane_weights: tuple[float, ...] = ()
    shared_params: tuple[SharedParam, ...] = ()
    stage_cuts: tuple[StageCut, ...] = ()
    leaf_modules: tuple[str, ...] = ()
    colocated: bool = False
    device_order: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()
    predicted_utilization: tuple[float, ...] = ()
    stage_flops: tuple[float, ...] = ()
    notes: tuple[str, ...] = ()
    stage_lane_weights: tuple[tuple[float, ...], ...] = ()
    capture: CaptureName = "fx"
    capture_inputs: tuple[CaptureInput, ...] = ()
    zero: int = 0
    zero_weights: tuple[tuple[float, ...], ...] = ()
    precision: PrecisionName = "fp32"
    activation_checkpoint: tuple[str, ...] = ()
    predicted_memory: tuple[float, ...] = ()
    offload: OffloadName = "none"
    moe_layers: tuple[MoELayer, ...] = ()
    virtual_stages: int = 1
    chunk_positions: tuple[int, ...] = ()
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task_graphs and self.uniform_width and not self.lane_weights:
            object.__setattr__(self, "lane_weights", (1.0,) * self.num_lanes)
        elif self.task_graphs and not self.uniform_width and not self.stage_lane_weights:
            equal = tuple((1.0,) * self.lanes_of(s) for s in range(self.num_stages))
            object.__setattr__(self, "stage_lane_weights", equal)
        self.validate()

    def stage_task_graphs(self, stage: int) -> tuple[TaskGraph, ...]:
        """TaskGraphs run by a stage (all of them when colocated)."""
        return self.task_graphs if self.colocated else tuple(self.task_graphs[c] for c in self.chunks_of(stage))

    def split_targets(self, stage: int) -> list[tuple[str, tuple[float, ...]]]:
        """``(module FQN, shard weights)`` of every module a stage runs under ``split`` (top-level or nested)."""
        out = []
        for tg in self.stage_task_graphs(stage):
            if tg.kind == "split":
                out += [(name, tg.shard_weights) for name in tg.modules]
            for nest in tg.nested:
                if nest.kind == "split":
                    out += [(name, nest.shard_weights) for name in nest.modules]
        return out

    # --- validation and serialization --------------------------------------------------------------------
    def validate(self) -> None:
        """Check the plan's internal consistency; raises :class:`PlanError` naming the problem."""
        if not self.task_graphs:
            raise PlanError("task_graphs = [] is empty; a plan runs at least one TaskGraph")
        self._validate_task_graphs()
        widths, k = list(self.stage_widths), self.num_replicas
        if sum(widths) * k != self.world_size:
            raise PlanError(f"num_replicas = {k}: {k} replica(s) x {'+'.join(map(str, widths))} = {sum(widths)} "
                            f"devices != world size {self.world_size}; world_size must be num_replicas x the "
                            "sum of the stages' device counts")
        if self.uniform_width:
            self._validate_lane_weights("lane_weights", self.lane_weights, 0)
            if self.stage_lane_weights:
                _fail("stage_lane_weights", [list(w) for w in self.stage_lane_weights], "is only for stages of "
                      f"different widths, but every stage has {widths[0]} device(s)", "use lane_weights ([] here)")
        else:
            if self.lane_weights:
                _fail("lane_weights", list(self.lane_weights), f"is for stages of one width, but the widths are "
                      f"{widths}", "give each stage's lane shares in stage_lane_weights and leave lane_weights []")
            if len(self.stage_lane_weights) != self.num_stages:
                _fail("stage_lane_weights", [list(w) for w in self.stage_lane_weights], f"must hold one list per "
                      f"stage ({self.num_stages})", "give each stage the shares of its lanes")
            for s, weights in enumerate(self.stage_lane_weights):
                self._validate_lane_weights(f"stage_lane_weights[{s}]", weights, s)
        self._validate_ranks()
        self._validate_cut()
        self._validate_zero()

    def to_dict(self) -> dict:
        """Plain-data form (tuples become lists); :meth:`from_dict` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """Inverse of :meth:`to_dict`; validates the result.

        Raises:
            PlanError: unknown or missing fields, a value of the wrong type (naming its path, e.g.
                ``task_graphs[1].modules``) or an inconsistent plan.
        """
        _check_keys(cls, data, "plan data")
        return cls(**data)

    def to_json(self, **kw) -> str:
        """Serialize to JSON (``Plan.from_json(p.to_json()) == p``)."""
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`; validates the result.

        Raises:
            PlanError: the text is not a plan (naming what is wrong).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"not a JSON plan: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError(f"a JSON plan is an object, got {type(data).__name__}")
        return cls.from_dict(data)

    def __str__(self) -> str:
        return format_plan(self)


_STRS, _POS, _NONNEG = _seq(_STR, "strings"), _seq(_real(True), "numbers > 0"), _seq(_real(False), "numbers >= 0")
_FIELDS: dict[type, dict[str, Check]] = {
    NestedScope: {"kind": _choice(KINDS), "device_count": _int(1, nullable=True), "modules": _STRS,
                  "shard_weights": _POS},
    TaskGraph: {"index": _int(0), "kind": _choice(KINDS), "device_count": _int(1), "modules": _STRS,
                "num_params": _int(0), "nested": _seq(_node(NestedScope), "NestedScope objects"),
                "shard_weights": _POS},
    SharedParam: {"names": _seq(_STR, "names", least=1), "stages": _seq(_int(0), "stages", least=2)},
    CaptureInput: {"name": _STR, "dtype": _STR, "shape": _seq(_int(0), "sizes"), "constant": _STR},
    MoELayer: {"module": _STR, "num_experts": _int(1), "top_k": _int(1), "expert_params": _int(0)},
    StageCut: {"nodes": _seq(_STR, "graph nodes", least=1), "params": _STRS, "buffers": _STRS, "units": _STRS},
    Plan: {"world_size": _int(1), "task_graphs": _seq(_node(TaskGraph), "TaskGraph objects"),
           "num_replicas": _int(1), "num_micro_batch": _int(1), "schedule": _choice(RUNNABLE_SCHEDULES),
           "virtual_stages": _int(1), "chunk_positions": _seq(_int(0), "stages"), "lane_weights": _POS,
           "stage_lane_weights": _seq(_POS, "lists of numbers > 0"),
           "shared_params": _seq(_node(SharedParam), "SharedParam objects"),
           "stage_cuts": _seq(_node(StageCut), "StageCut objects"), "leaf_modules": _STRS, "colocated": _BOOL,
           "device_order": _seq(_int(0), "ranks"), "devices": _STRS,
           "predicted_utilization": _NONNEG, "stage_flops": _NONNEG, "notes": _STRS,
           "capture": _choice(CAPTURES), "capture_inputs": _seq(_node(CaptureInput), "CaptureInput objects"),
           "zero": _int(0), "zero_weights": _seq(_NONNEG, "lists of numbers >= 0"),
           "precision": _choice(PRECISIONS), "activation_checkpoint": _STRS, "predicted_memory": _NONNEG,
           "offload": _choice(OFFLOADS), "moe_layers": _seq(_node(MoELayer), "MoELayer objects"),
           "sequence_parallel": _BOOL},
}
