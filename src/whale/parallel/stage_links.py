"""The static links of one pipeline rank (:class:`StageLinks`): its stage, the neighbours it exchanges with and,
for an interleaved plan, which model chunks it runs. Read by :class:`whale.parallel.pipeline.StageExecutor`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageLinks:
    """Where this rank sits in its lane's pipeline.

    Attributes:
        stage, num_stages: this stage's index and the pipeline depth.
        chunks: model chunks on this rank (interleaved schedules; 1 otherwise), chunk c being virtual stage
            ``c * num_stages + stage``.
        wrap_from, wrap_to: interleaved only: the rank of this lane on the last stage (whose chunk c - 1 feeds
            this rank's chunk c when this is stage 0) and on stage 0 (fed by this rank's chunk c when this is the
            last stage); -1 otherwise.
        chunk_stages: interleaved with stages of different chunk counts (``Plan.chunk_positions``): the stage of
            every model chunk; this rank's chunks are those on its stage, in model order, and a hand-off between
            two chunks of one stage stays local. Empty otherwise.
        lane_ranks: with ``chunk_stages``: this lane's rank on every stage.

    The neighbouring lanes (which can change with the batch size) come with each step's :class:`MicroBatches`.
    """

    stage: int
    num_stages: int
    chunks: int = 1
    wrap_from: int = -1
    wrap_to: int = -1
    chunk_stages: tuple[int, ...] = ()
    lane_ranks: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        """Model chunks of the pipeline."""
        return len(self.chunk_stages) or self.chunks * self.num_stages

    def virtual(self, chunk: int) -> int:
        """The model chunk (virtual stage) that this rank's chunk ``chunk`` runs: ``chunk * num_stages + stage``,
        or under ``chunk_stages`` this stage's ``chunk``-th chunk."""
        if self.chunk_stages:
            return [g for g, s in enumerate(self.chunk_stages) if s == self.stage][chunk]
        return chunk * self.num_stages + self.stage

    def local(self, model_chunk: int) -> bool:
        """True when model chunk ``model_chunk`` runs on this stage too (its hand-off stays on this rank)."""
        return bool(self.chunk_stages) and 0 <= model_chunk < self.total and \
            self.chunk_stages[model_chunk] == self.stage

    def first(self, chunk: int) -> bool:
        """True for the model's first chunk (takes the model's inputs)."""
        return self.virtual(chunk) == 0

    def last(self, chunk: int) -> bool:
        """True for the model's last chunk (computes the loss)."""
        return self.virtual(chunk) == self.total - 1

    @property
    def is_first(self) -> bool:
        """True on stage 0 (takes the model's inputs)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """True on the last stage (computes the loss)."""
        return self.stage == self.num_stages - 1
