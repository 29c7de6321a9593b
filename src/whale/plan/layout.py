"""The rank layout and batch apportioning a :class:`~whale.plan.plan.Plan` derives from its fields (pure
arithmetic, no process group).

Rank layout. Stage ``s`` runs on ``n_s`` devices per replica (its TaskGraph's ``device_count``); K nested
replicas each span ``D = n_0 + ... + n_{S-1}`` ranks, and slot ``k*D + n_0 + ... + n_{s-1} + j`` runs stage
``s`` for its data-parallel *lane* ``k*n_s + j`` (stage s has ``K*n_s`` lanes). ``device_order`` maps slots to
global ranks (identity when empty). Every stage cuts each micro-batch across its own lanes by its lane weights,
in lane order. When every stage has the same width n (the regular case) the lanes line up: lane i of every
stage holds the same rows, so a lane is one path of a micro-batch through all stages, the ranks form the grid
``[S, K, n]`` (mesh axes ``pp``, ``dp``, ``tp``) and all stages share ``lane_weights``. Stages of different
widths each keep their own lane weights (``stage_lane_weights``), and a *batch bridge* re-splits the rows
between neighbours: each lane of stage s sends each lane of stage s+1 the rows their ranges share
(:meth:`PlanLayout.boundary_peers`), and the gradients of those rows come back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from whale.plan.checks import PlanError
from whale.plan.schedule import in_flight_micro_batches, max_in_flight
from whale.plan.schedule_chunks import schedule_for
from whale.plan.shares import whole_shares


@dataclass(frozen=True)
class Peer:
    """One neighbour of a lane across a stage boundary: ``rank`` exchanges rows ``lo:hi`` of this lane's
    micro-batch slice (offsets into this lane's rows, not the global batch)."""

    rank: int
    lo: int
    hi: int


class PlanLayout:
    """Derived layout of a plan (mixed into :class:`~whale.plan.plan.Plan`, which holds the fields read here:
    ``task_graphs``, ``num_replicas``, ``colocated``, ``device_order``, ``num_micro_batch``, ``lane_weights``,
    ``stage_lane_weights``)."""

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages (rank positions): TaskGraphs / ``virtual_stages``, or 1 when colocated."""
        return 1 if self.colocated else len(self.task_graphs) // self.virtual_stages

    @property
    def num_chunks(self) -> int:
        """Model chunks of the pipeline (= stage cuts): ``num_stages * virtual_stages``; chunk c runs on the
        ranks of stage :meth:`position_of` ``(c)`` (``c % num_stages`` unless ``chunk_positions`` says)."""
        return self.num_stages * self.virtual_stages

    def position_of(self, chunk: int) -> int:
        """The pipeline stage (rank position) whose ranks run model chunk ``chunk``: ``chunk_positions[chunk]``,
        or round-robin ``chunk % num_stages`` when that field is empty."""
        return self.chunk_positions[chunk] if self.chunk_positions else chunk % self.num_stages

    @property
    def last_stage(self) -> int:
        """The stage running the model's last chunk (it computes the loss): ``num_stages - 1``, or under
        ``chunk_positions`` the last chunk's stage."""
        return self.position_of(self.num_chunks - 1) if not self.colocated else 0

    def chunks_of(self, stage: int) -> list[int]:
        """The model chunks stage ``stage`` runs, in model order (its local chunks 0, 1, ...)."""
        return [c for c in range(self.num_chunks) if self.position_of(c) == stage]

    def in_flight(self, stage: int) -> float:
        """Micro-batches whose activations stage ``stage`` holds at once, in units of one micro-batch through the
        whole stage: :func:`whale.plan.schedule.in_flight_micro_batches` of the plan's schedule and chunks per
        stage; under ``chunk_positions`` (stages of different chunk counts, where that closed form does not hold)
        :func:`whale.plan.schedule.max_in_flight` of the stage's built schedule, each of its k chunks 1/k of it.

        Raises:
            ValueError: ``stage`` outside the pipeline.
        """
        if self.chunk_positions:
            if not 0 <= stage < self.num_stages:
                raise ValueError(f"stage {stage} is outside the plan's {self.num_stages} stages")
            acts = schedule_for(self.schedule, self.num_stages, self.num_micro_batch, self.virtual_stages,
                                self.chunk_positions)[stage]
            return max_in_flight(acts) / len(self.chunks_of(stage))
        return in_flight_micro_batches(stage, self.num_stages, self.num_micro_batch, self.schedule,
                                       self.virtual_stages)

    @property
    def stage_widths(self) -> tuple[int, ...]:
        """Devices per replica of each stage (``n_s``)."""
        return tuple(tg.device_count for tg in self.task_graphs[: self.num_stages])

    @property
    def uniform_width(self) -> bool:
        """True when every stage has the same width (the regular ``[S, K, n]`` grid; no batch bridge)."""
        return len(set(self.stage_widths)) == 1

    def width_of(self, stage: int) -> int:
        """Devices per replica of ``stage``."""
        return self.stage_widths[stage]

    def lanes_of(self, stage: int) -> int:
        """Data-parallel lanes of ``stage``: ``K * n_s``."""
        return self.num_replicas * self.width_of(stage)

    @property
    def max_lanes(self) -> int:
        """Lanes of the widest stage (``num_lanes`` when the widths are uniform)."""
        return max(self.lanes_of(s) for s in range(self.num_stages))

    def weights_of(self, stage: int) -> tuple[float, ...]:
        """Relative batch load of each lane of ``stage`` (``lane_weights`` when the widths are uniform)."""
        return self.lane_weights if self.uniform_width else self.stage_lane_weights[stage]

    def _uniform(self, what: str) -> None:
        if not self.uniform_width:
            raise PlanError(f"Plan.{what} is defined when every stage has the same width, but the stage widths "
                            f"are {list(self.stage_widths)}; use the per-stage form (width_of / lanes_of / "
                            "weights_of(stage))")

    @property
    def stage_width(self) -> int:
        """Devices per replica in each stage (n), for plans whose stages all have the same width.

        Raises:
            PlanError: the stages have different widths (use :meth:`width_of`)."""
        self._uniform("stage_width")
        return self.task_graphs[0].device_count

    @property
    def num_lanes(self) -> int:
        """Data-parallel lanes, K * n, for plans whose stages all have the same width.

        Raises:
            PlanError: the stages have different widths (use :meth:`lanes_of`)."""
        self._uniform("num_lanes")
        return self.num_replicas * self.stage_width

    @property
    def is_pipeline(self) -> bool:
        """True when there are several stages."""
        return self.num_stages > 1

    def rank_of(self, stage: int, lane: int) -> int:
        """Global rank running ``stage`` for its ``lane``."""
        widths = self.stage_widths
        n = widths[stage]
        k, j = divmod(lane, n)
        slot = k * sum(widths) + sum(widths[:stage]) + j
        return self.device_order[slot] if self.device_order else slot

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, lane)`` of a global rank."""
        slot = self.device_order.index(rank) if self.device_order else rank
        widths = self.stage_widths
        k, rest = divmod(slot, sum(widths))
        for stage, n in enumerate(widths):
            if rest < n:
                return stage, k * n + rest
            rest -= n
        raise PlanError(f"rank {rank} is outside the plan's world of {self.world_size} ranks")

    def rank_grid(self) -> list[list[list[int]]]:
        """Global ranks as a ``[S][K][n]`` grid (mesh axes ``pp``, ``dp``, ``tp``): ``[s][k][j]`` runs stage s
        of lane ``k*n + j``.

        Raises:
            PlanError: the stages have different widths (no regular grid; see :meth:`stage_ranks`)."""
        n = self.stage_width
        return [[[self.rank_of(s, k * n + j) for j in range(n)] for k in range(self.num_replicas)]
                for s in range(self.num_stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """Ranks of one stage, ordered by lane (the stage's data-parallel group)."""
        return [self.rank_of(stage, lane) for lane in range(self.lanes_of(stage))]

    # --- batch apportioning ------------------------------------------------------------------------------
    def micro_batch_rows(self, global_batch: int, stage: int = 0) -> list[list[tuple[int, int]]]:
        """Row ranges ``[lane][micro_batch] -> (start, stop)`` into the global batch (dim 0) for the lanes of
        ``stage`` (every stage alike when the widths are uniform).

        The global batch is cut into ``num_micro_batch`` equal micro-batches; each micro-batch is cut across
        the stage's lanes by its lane weights (speeds) with whole rows that add up exactly, at least one per lane,
        minimizing the slowest lane's ``rows / weight`` (:func:`whale.plan.shares.whole_shares`), in lane order.

        Raises:
            PlanError: the batch does not divide into micro-batches, or a micro-batch has fewer rows than
                some stage has lanes (some lane would get no rows).
        """
        m = self.num_micro_batch
        lanes = self.max_lanes
        smallest = m * lanes
        if global_batch % m:
            good = max(smallest, -(-global_batch // m) * m)
            raise PlanError(
                f"global batch of {global_batch} rows does not divide into num_micro_batch={m} micro-batches; "
                f"use a multiple of {m} with at least {smallest} rows ({lanes} data-parallel ranks x "
                f"{m} micro-batches), e.g. {good}")
        mb = global_batch // m
        for s in range(self.num_stages):
            shares = whole_shares(mb, list(self.weights_of(s)), 1 if mb >= self.lanes_of(s) else 0)
            if mb < self.lanes_of(s) or min(shares) < 1:
                where = f" in stage {s}" if not self.uniform_width else ""
                raise PlanError(
                    f"each micro-batch has {mb} rows (batch {global_batch} / {m} micro-batches) but there are "
                    f"{self.lanes_of(s)} data-parallel ranks{where} and shares {shares} leave one empty; use a "
                    f"global batch of at least {lanes * m} rows or fewer micro-batches")
            if s == stage:
                mine = shares
        starts = [sum(mine[:i]) for i in range(len(mine))]
        return [[(i * mb + starts[lane], i * mb + starts[lane] + mine[lane]) for i in range(m)]
                for lane in range(len(mine))]

    def boundary_peers(self, global_batch: int, stage: int, lane: int) -> tuple[tuple[Peer, ...], tuple[Peer, ...]]:
        """The batch bridge of one rank: ``(receive from, send to)``, the lanes of the previous and of the next
        stage that hold rows of this lane's micro-batch slice, each with the rows they share (the same for
        every micro-batch of a step). Regular plans give one peer per side, lane ``lane`` itself, over all
        rows; the first and last stage have no peer before / after.

        Raises:
            PlanError: as :meth:`micro_batch_rows`.
        """
        a, b = self.micro_batch_rows(global_batch, stage)[lane][0]

        def peers(other: int) -> tuple[Peer, ...]:
            """Lanes of stage ``other`` whose rows meet ``a:b``, with the shared rows as offsets from ``a``."""
            if not 0 <= other < self.num_stages:
                return ()
            if self.uniform_width:
                return (Peer(self.rank_of(other, lane), 0, b - a),)
            out = []
            for their, ranges in enumerate(self.micro_batch_rows(global_batch, other)):
                lo, hi = max(a, ranges[0][0]), min(b, ranges[0][1])
                if lo < hi:
                    out.append(Peer(self.rank_of(other, their), lo - a, hi - a))
            return tuple(out)

        return peers(stage - 1), peers(stage + 1)
