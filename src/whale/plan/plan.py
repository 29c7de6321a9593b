"""The plan: plain, printable, JSON-round-trippable data that the runtime executes (DESIGN.md §2, §3).

Rank layout. With S TaskGraphs (stages) of n devices each and K nested replicas, a replica spans D = S*n
ranks and rank ``k*D + s*n + j`` runs stage ``s`` for data-parallel *lane* ``(k, j)`` (lane index
``k*n + j``). A lane is one path of a micro-batch through all stages; lanes split every micro-batch by
``lane_weights``. Without pipelining (S = 1) a lane is simply a data-parallel rank.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


class PlanError(ValueError):
    """A plan that cannot run: the message names the bad value, the limit and the fix."""


@dataclass
class TaskGraph:
    """One annotated part of the model and the devices (per replica) that run it.

    Attributes:
        index: position in model order (= pipeline stage when pipelined).
        kind: ``"replicate"`` or ``"split"``.
        device_count: devices per replica in its VirtualDevice.
        modules: module FQNs (or ``module.param`` names) it holds, compressed to the largest whole modules.
        num_params: parameter elements it holds (tied parameters counted in every TG that holds them).
        nested: nested scopes inside it, e.g. ``[{"kind": "split", "device_count": 2, "modules": [...]}]``.
        shard_weights: for split (or a nested split), the relative shard size of each device of the VD;
            empty = equal shards.
    """

    index: int
    kind: str
    device_count: int
    modules: list[str] = field(default_factory=list)
    num_params: int = 0
    nested: list[dict] = field(default_factory=list)
    shard_weights: list[float] = field(default_factory=list)

    @property
    def has_split(self) -> bool:
        """True when this TaskGraph, or a scope nested in it, shards operators."""
        return self.kind == "split" or any(n["kind"] == "split" for n in self.nested)


@dataclass
class Plan:
    """TaskGraphs x VirtualDevices x per-lane loads x schedule x shared-parameter groups.

    Attributes:
        world_size: number of ranks.
        task_graphs: TaskGraphs in model order; with ``len > 1`` each one is a pipeline stage.
        num_replicas: K, the nested data-parallel degree (whole plan copied K times).
        num_micro_batch: micro-batches per mini-batch.
        schedule: ``"1F1B"`` or ``"GPipe"``.
        lane_weights: relative batch load of each lane (len = K * n); batch rows are apportioned exactly.
        shared_params: parameter FQN groups held by several stages (tied weights), ``[[name, ...], ...]``;
            their gradients are summed over every rank that holds them.
        notes: free-form lines shown in the printout (e.g. "emulated cluster").
        colocated: the TaskGraphs share the same devices and run one after another in one stage (Whale's
            replicate backbone + split head); otherwise each TaskGraph is a pipeline stage on its own devices.
        device_order: slot -> global rank (empty = identity). Slot ``k*D + s*n + j`` runs stage s of lane
            ``k*n + j``; the hardware-aware planner reorders devices (e.g. largest memory on stage 0).
        devices: device type name of each rank (from the cluster spec; empty when unknown).
        predicted_utilization: per rank, predicted busy share of the step (1.0 = the bottleneck device).
        stage_layers: when the planner cut the pipeline, the unit names each stage holds.
        stage_flops: training FLOPs per sample of each stage, when the model was profiled.
    """

    world_size: int
    task_graphs: list[TaskGraph]
    num_replicas: int
    num_micro_batch: int = 1
    schedule: str = "1F1B"
    lane_weights: list[float] = field(default_factory=list)
    shared_params: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    colocated: bool = False
    device_order: list[int] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    predicted_utilization: list[float] = field(default_factory=list)
    stage_layers: list[list[str]] = field(default_factory=list)
    stage_flops: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.task_graphs = [tg if isinstance(tg, TaskGraph) else TaskGraph(**tg) for tg in self.task_graphs]
        if not self.lane_weights:
            self.lane_weights = [1.0] * self.num_lanes
        self.validate()

    # --- derived layout ----------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Number of pipeline stages (= TaskGraphs, or 1 when they are colocated)."""
        return 1 if self.colocated else len(self.task_graphs)

    @property
    def stage_width(self) -> int:
        """Devices per replica in each stage (n)."""
        return self.task_graphs[0].device_count

    @property
    def num_lanes(self) -> int:
        """Data-parallel lanes, K * n."""
        return self.num_replicas * self.stage_width

    @property
    def is_pipeline(self) -> bool:
        """True when there are several stages."""
        return self.num_stages > 1

    def rank_of(self, stage: int, lane: int) -> int:
        """Global rank running ``stage`` for ``lane``."""
        n = self.stage_width
        k, j = divmod(lane, n)
        slot = k * self.num_stages * n + stage * n + j
        return self.device_order[slot] if self.device_order else slot

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, lane)`` of a global rank."""
        slot = self.device_order.index(rank) if self.device_order else rank
        n, s_count = self.stage_width, self.num_stages
        k, rest = divmod(slot, s_count * n)
        stage, j = divmod(rest, n)
        return stage, k * n + j

    def stage_ranks(self, stage: int) -> list[int]:
        """Ranks of one stage, ordered by lane (the stage's data-parallel group)."""
        return [self.rank_of(stage, lane) for lane in range(self.num_lanes)]

    def stage_task_graphs(self, stage: int) -> list[TaskGraph]:
        """TaskGraphs run by a stage (all of them when colocated)."""
        return self.task_graphs if self.colocated else [self.task_graphs[stage]]

    def split_group_ranks(self, stage: int, replica: int) -> list[int]:
        """The n ranks of one replica of a stage: the devices a split shards over (group-rank order)."""
        n = self.stage_width
        return [self.rank_of(stage, replica * n + j) for j in range(n)]

    def shard_replica_ranks(self, stage: int, shard: int) -> list[int]:
        """Ranks holding the same shard in every replica: their split gradients are summed."""
        n = self.stage_width
        return [self.rank_of(stage, k * n + shard) for k in range(self.num_replicas)]

    # --- batch apportioning ------------------------------------------------------------------------------
    def micro_batch_rows(self, global_batch: int) -> list[list[tuple[int, int]]]:
        """Row ranges ``[lane][micro_batch] -> (start, stop)`` into the global batch (dim 0).

        The global batch is cut into ``num_micro_batch`` equal micro-batches; each micro-batch is cut across
        lanes by ``lane_weights`` with whole rows that add up exactly (largest remainder).

        Raises:
            PlanError: the batch does not divide into micro-batches, or a micro-batch has fewer rows than
                there are lanes (some lane would get no rows).
        """
        m = self.num_micro_batch
        smallest = m * self.num_lanes
        if global_batch % m:
            good = max(smallest, -(-global_batch // m) * m)
            raise PlanError(
                f"global batch of {global_batch} rows does not divide into num_micro_batch={m} micro-batches; "
                f"use a multiple of {m} with at least {smallest} rows ({self.num_lanes} data-parallel ranks x "
                f"{m} micro-batches), e.g. {good}"
            )
        mb = global_batch // m
        shares = apportion(mb, self.lane_weights)
        if mb < self.num_lanes or min(shares) < 1:
            raise PlanError(
                f"each micro-batch has {mb} rows (batch {global_batch} / {m} micro-batches) but there are "
                f"{self.num_lanes} data-parallel ranks and shares {shares} leave one empty; use a global batch "
                f"of at least {self.num_lanes * m} rows or fewer micro-batches"
            )
        starts = [sum(shares[:i]) for i in range(len(shares))]
        return [[(i * mb + starts[lane], i * mb + starts[lane] + shares[lane]) for i in range(m)]
                for lane in range(self.num_lanes)]

    # --- validation and serialization --------------------------------------------------------------------
    def validate(self) -> None:
        """Check the plan's internal consistency; raises :class:`PlanError` naming the problem."""
        if not self.task_graphs:
            raise PlanError("plan has no TaskGraphs")
        widths = {tg.device_count for tg in self.task_graphs}
        if len(widths) != 1:
            raise PlanError(
                f"pipeline stages have different device counts {[tg.device_count for tg in self.task_graphs]}; "
                "stages of unequal width need a batch bridge between them, which is not implemented yet: give "
                "every stage the same device_count (nested data parallelism replicates the whole pipeline)"
            )
        per_replica = self.num_stages * self.stage_width
        for tg in self.task_graphs:
            if tg.shard_weights and len(tg.shard_weights) != tg.device_count:
                raise PlanError(f"TaskGraph {tg.index}: {len(tg.shard_weights)} shard_weights for "
                                f"{tg.device_count} devices")
        if self.num_replicas < 1 or per_replica * self.num_replicas != self.world_size:
            raise PlanError(
                f"{self.num_replicas} replica(s) x {per_replica} devices != world size {self.world_size}"
            )
        if len(self.lane_weights) != self.num_lanes or any(w <= 0 for w in self.lane_weights):
            raise PlanError(
                f"lane_weights {self.lane_weights} must hold {self.num_lanes} positive numbers, one per "
                "data-parallel lane"
            )
        if self.num_micro_batch < 1:
            raise PlanError(f"num_micro_batch={self.num_micro_batch} must be >= 1")
        if self.device_order and sorted(self.device_order) != list(range(self.world_size)):
            raise PlanError(f"device_order {self.device_order} must be a permutation of 0..{self.world_size - 1}")
        if self.devices and len(self.devices) != self.world_size:
            raise PlanError(f"devices lists {len(self.devices)} entries for world size {self.world_size}")
        if self.schedule not in ("1F1B", "GPipe"):
            raise PlanError(f"schedule {self.schedule!r} is unknown; choose '1F1B' or 'GPipe'")

    def to_json(self, **kw) -> str:
        """Serialize to JSON (round-trips through :meth:`from_json`)."""
        return json.dumps(dataclasses.asdict(self), **kw)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`; validates the result."""
        return cls(**json.loads(text))

    def __str__(self) -> str:
        from whale.plan.printing import format_plan

        return format_plan(self)


def apportion(total: int, weights: list[float]) -> list[int]:
    """Whole-number shares of ``total`` proportional to ``weights`` that add up to ``total`` exactly.

    Largest-remainder (Hamilton) method; ties go to the lower index, so the result is deterministic.
    """
    wsum = float(sum(weights))
    raw = [total * w / wsum for w in weights]
    shares = [int(r) for r in raw]
    order = sorted(range(len(weights)), key=lambda i: (-(raw[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares
