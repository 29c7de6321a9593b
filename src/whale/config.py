"""Typed, validated configuration for a Whale job (DESIGN.md §2, §4)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEDULES = ("1F1B", "GPipe")


class ConfigError(ValueError):
    """A `Config` field holds a value Whale cannot use; the message names the field, the value and the fix."""


@dataclass(frozen=True)
class Config:
    """Settings for planning and running one job.

    Every field is validated in ``__post_init__``; a bad value raises :class:`ConfigError` naming the field.
    """

    num_micro_batch: int = 1
    """Micro-batches per mini-batch (>= 1). With several TaskGraphs they flow through the pipeline; with one
    TaskGraph they are gradient accumulation. The global batch must be a multiple of it."""

    schedule: str = "1F1B"
    """Pipeline schedule: ``"1F1B"`` (backward-first, default, bounded activation memory) or ``"GPipe"``
    (all forwards, then all backwards)."""

    cluster: Any = None
    """Cluster spec: a path to a YAML file or a :class:`whale.cluster.ClusterSpec`. ``None``: detected on GPUs,
    identical devices on CPU. ``whale launch --cluster`` sets it through ``WHALE_CLUSTER``."""

    hardware_aware: bool = True
    """Balance work by device capability (DESIGN.md §5) when the cluster spec mixes device types: lane batch
    shares and split shard sizes proportional to FLOPS within memory, pipeline devices ordered by memory, and
    (given a sample batch) stage cuts that minimize the slowest stage."""

    rebalance_after: int | None = None
    """After this many steps, re-balance the data-parallel lanes' shares from their measured compute time per
    sample (profile-guided balancing; see :meth:`whale.Engine.rebalance`). ``None``: keep the planned shares."""

    max_grad_norm: float | None = None
    """Clip the global gradient norm (over all stages, lanes and shards) to this value; ``None``: no clipping."""

    seed: int = 0
    """Seed for torch's RNG, set identically on every rank by :func:`whale.init` so replicas start equal."""

    load_shares: tuple[float, ...] | None = None
    """Relative data-parallel load of each data-parallel lane (one entry per lane, any positive numbers).
    ``None`` means equal shares. Whole samples are apportioned exactly (largest remainder), so
    ``(5, 3)`` on a batch of 8 gives 5 and 3 rows."""

    bucket_cap_mb: float = 25.0
    """Gradient all-reduce bucket size in MiB (1 MiB = 2**20 bytes)."""

    backend: str | None = None
    """torch.distributed backend; ``None`` picks ``nccl`` when CUDA is available, else ``gloo``."""

    extra: dict = field(default_factory=dict)
    """Free-form user metadata carried into the plan printout; not interpreted."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_micro_batch, int) or isinstance(self.num_micro_batch, bool):
            raise ConfigError(f"num_micro_batch must be an int, got {self.num_micro_batch!r}")
        if self.num_micro_batch < 1:
            raise ConfigError(
                f"num_micro_batch={self.num_micro_batch} but it must be >= 1 "
                "(1 = no pipelining / no gradient accumulation)"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is unknown; choose one of {SCHEDULES}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb={self.bucket_cap_mb} must be > 0 (MiB per all-reduce bucket)")
        if self.load_shares is not None:
            shares = tuple(self.load_shares)
            if not shares or any(not (float(s) > 0) for s in shares):
                raise ConfigError(f"load_shares={self.load_shares!r} must be a non-empty tuple of numbers > 0")
            object.__setattr__(self, "load_shares", tuple(float(s) for s in shares))
        if self.rebalance_after is not None and (not isinstance(self.rebalance_after, int)
                                                 or self.rebalance_after < 1):
            raise ConfigError(f"rebalance_after={self.rebalance_after!r} must be an int >= 1 or None")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm={self.max_grad_norm} must be > 0 or None")
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"backend={self.backend!r} is unknown; choose 'gloo', 'nccl' or None (auto)")

    def replace(self, **changes: Any) -> Config:
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-data form (JSON-serializable when ``cluster`` is a path or None)."""
        d = dataclasses.asdict(self)
        d["load_shares"] = list(self.load_shares) if self.load_shares else None
        d["cluster"] = self.cluster if isinstance(self.cluster, str | type(None)) else repr(self.cluster)
        return d
