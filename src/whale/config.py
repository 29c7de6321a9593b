"""Typed, validated configuration for a Whale job: pipelining, schedule, cluster, balancing and data-parallel
settings (the annotations themselves are in :mod:`whale.annotation`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from whale.plan.plan import OFFLOADS, PRECISIONS, OffloadName, PrecisionName
from whale.plan.schedule import RUNNABLE_SCHEDULES, ScheduleName

FORBIDDEN = ("activation_checkpoint", "zero", "zero3", "offload", "offload_params")
"""What ``Config.forbid`` may name: memory techniques the planner must not add on its own
(:func:`whale.planner.memory.candidates`)."""

NonFiniteName = Literal["raise", "skip"]
NONFINITE_POLICIES: tuple[NonFiniteName, ...] = ("raise", "skip")
"""What a training step does when a loss or gradient is NaN/inf (``Config.nonfinite``)."""


class ConfigError(ValueError):
    """A `Config` field holds a value Whale cannot use; the message names the field, the value and the fix."""


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling for ``Config(precision="fp16")`` (Micikevicius et al. 2018, "Mixed Precision
    Training", §3.2; the same rule and defaults as ``torch.amp.GradScaler``).

    The last pipeline stage multiplies the loss by ``scale`` before backward; gradients are unscaled before
    clipping and the optimizer step. A step whose gradients hold an inf/NaN anywhere (any stage, lane or shard)
    is skipped on every rank and the scale is multiplied by ``backoff_factor``; after ``growth_interval``
    consecutive finite steps it is multiplied by ``growth_factor``.

    Attributes:
        init_scale: the first scale (> 0).
        growth_factor: factor after ``growth_interval`` finite steps (> 1).
        backoff_factor: factor after an overflow (in (0, 1)).
        growth_interval: finite steps between growths (int >= 1).
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ConfigError(f"LossScale.init_scale={self.init_scale} must be > 0")
        if not self.growth_factor > 1:
            raise ConfigError(f"LossScale.growth_factor={self.growth_factor} must be > 1")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"LossScale.backoff_factor={self.backoff_factor} must be in (0, 1)")
        if not isinstance(self.growth_interval, int) or isinstance(self.growth_interval, bool) \
                or self.growth_interval < 1:
            raise ConfigError(f"LossScale.growth_interval={self.growth_interval!r} must be an int >= 1")


@dataclass(frozen=True)
class Config:
    """Settings for planning and running one job.

    Every field is validated in ``__post_init__``; a bad value raises :class:`ConfigError` naming the field.

    Attributes:
        num_micro_batch: micro-batches per mini-batch (>= 1). With several TaskGraphs they flow through the
            pipeline; with one they are gradient accumulation. The global batch must be a multiple of it.
        schedule: pipeline schedule, ``"1F1B"`` (backward-first, the default: bounded activation memory) or
            ``"GPipe"`` (all forwards, then all backwards), or ``"ZB-H1"`` (zero-bubble: the backward split into
            input- and weight-gradient passes, the weight pass filling the bubble; 1F1B's peak memory), or
            ``"Interleaved1F1B"`` with ``virtual_stages`` chunks per rank.
        virtual_stages: model chunks per rank of the interleaved schedule (Narayanan et al. SC'21 §2.2; 1
            otherwise): the model's ``p * v`` TaskGraphs run chunk c of rank position r as TaskGraph ``c*p + r``.
        cluster: the cluster spec, a YAML file path or a :class:`whale.cluster.ClusterSpec`. ``None``: detected
            on GPUs, identical devices on CPU. ``whale launch --cluster`` sets it through ``WHALE_CLUSTER``.
        hardware_aware: when the cluster mixes device types, balance work by device capability (Whale paper,
            Jia et al., USENIX ATC 2022, §3.3): lane batch shares and split shard sizes proportional to FLOPS
            within memory, pipeline devices ordered by memory, and (given a sample batch) stage cuts that
            minimize the slowest stage.
        rebalance_after: after this many steps, re-balance the data-parallel lanes' shares from their measured
            compute time per sample (see :meth:`whale.Engine.rebalance`). ``None``: keep the planned shares.
        max_grad_norm: clip the global gradient norm (over all stages, lanes and shards) to this value; ``None``:
            no clipping.
        seed: seed of torch's RNG, set identically on every rank by :func:`whale.init` so replicas start equal;
            inside the engine's forward each lane and split shard draws from its own stream derived from it
            (:mod:`whale.runtime.rng`).
        load_shares: relative load of each data-parallel lane (one positive number per lane); ``None``: equal.
            Whole samples follow them (:func:`whale.plan.shares.whole_shares`), so ``(5, 3)`` on a batch of 8
            gives 5 and 3 rows.
        bucket_cap_mb: gradient all-reduce bucket size, MiB (1 MiB = 2**20 bytes).
        backend: torch.distributed backend; ``None`` picks ``nccl`` when CUDA is available, else ``gloo``.
        capture: how a pipelined model's graph is captured for the stage cut: ``"export"``
            (``torch.export``, non-strict: Hugging Face models and most Python; needs a sample batch),
            ``"fx"`` (``torch.fx.symbolic_trace``: no sample needed) or ``"auto"`` (export when a sample
            batch is given, else fx).
        zero: ZeRO stage (Rajbhandari et al., "ZeRO", SC 2020) over each pipeline stage's data-parallel lanes:
            0 off; 1 shards the optimizer state (each lane steps its slice of the stage's replicated parameters,
            then the slices are broadcast back); 2 also shards gradients (reduce-scatter instead of
            all-reduce); 3 also shards the parameters (each unit of the stage gathered before its forward and
            backward and freed after: :mod:`whale.parallel.zero3`). On a cluster spec the slices follow each
            device's free memory. Needs an elementwise optimizer (SGD, Adam, AdamW, ...).
        precision: ``"fp32"`` (the default), ``"bf16"`` (``torch.autocast`` in bfloat16 around each stage's
            forward; parameters, gradients, optimizer and loss stay fp32) or ``"fp16"`` (autocast in float16 with
            dynamic loss scaling, identical on every rank: :mod:`whale.runtime.precision`). Recorded in the plan.
        loss_scale: the dynamic loss scaling of ``"fp16"`` (:class:`LossScale`); ignored otherwise.
        activation_checkpoint: which modules recompute their activations in backward instead of keeping them
            (``torch.utils.checkpoint``, non-reentrant; see :mod:`whale.memory.checkpointing`). ``None`` or
            ``()``: none. ``"all"``: every repeated layer (each child of a ``ModuleList``/``Sequential``, e.g.
            every transformer block). Otherwise a tuple whose entries are a module class or class name
            (``"Block"``: every module of that type), an FQN glob (``"blocks.*"``, ``"h.[0-3]"``), or an int
            ``i`` (every layer unit of TaskGraph ``i``). The front end resolves it to module FQNs in the plan.
        track_memory: measure each step's peak memory per rank by category (parameters, gradients, optimizer
            state, activations, temporaries; :mod:`whale.memory.tracker`) and report it in the step metrics.
            ``None`` (auto): on under an emulated cluster (which then enforces each device's memory, see
            :class:`whale.memory.monitor.EmulatedOutOfMemoryError`) and on CUDA (allocator statistics, free),
            off on plain CPU runs (the CPU tracker sees every operation: a few percent of step time).
        forbid: memory techniques the planner must not add on its own. With a cluster spec and a sample batch
            the planner predicts every rank's peak memory and, when the plan does not fit, adds the cheapest
            combination of activation checkpointing, a higher ZeRO stage and offload that does (what is set
            above is kept: setting it forces it); the plan printout says what it added and why
            (:mod:`whale.planner.memory`). Names: ``"activation_checkpoint"``, ``"zero"``, ``"zero3"``,
            ``"offload"``, ``"offload_params"``. Forbidding everything makes a plan that does not fit an error.
        offload: ZeRO-Offload (Ren et al., USENIX ATC 2021): ``"none"`` (default); ``"optimizer"``: each rank keeps
            fp32 master copies, gradients and the optimizer state of the parameters it updates (its ZeRO slice
            under ``zero >= 1``) in host memory (pinned on CUDA) and runs ``optimizer.step()`` there; the updated
            parameters are copied back to the device. ``"optimizer+params"``: also the parameters stay on the
            host: with ``zero=0`` the stage's, copied to the device for each step's forward and backward; with
            ``zero=3`` the lane's parameter and gradient shards, each ZeRO-3 unit gathered from the host shards
            for its forward and backward (one unit on the device at a time; ZeRO-Infinity's CPU offload).
            Not with ``zero=1`` or ``2``. Host bytes are measured apart from device bytes and, under an
            emulated cluster, bounded by each node's ``host_memory_bytes`` shared by its ranks
            (:mod:`whale.runtime.offload`).
        auto: let the planner choose the pipeline stage count and cut, the data-parallel degree, micro-batches,
            schedule and memory techniques (:mod:`whale.planner.search`, :mod:`whale.frontend.autoplan`): the plan
            with the least predicted step time that fits memory; annotations constrain it (an annotated stage
            count and cut are kept). ``num_micro_batch``, ``schedule``, ``zero``, ``offload`` and
            ``activation_checkpoint`` set here are then replaced by the search's choice (the memory settings as a
            floor). Needs a sample batch; the plan's notes list the runner-ups and why they lost.
        timeout_s: seconds a collective may wait for its peers before it fails (the process group's
            ``timeout``), so a rank that died or raised ends every rank instead of leaving them waiting; ``None``:
            10 minutes. Applies to the groups :func:`whale.init` and the engine create (every ``new_group``).
        nonfinite: what a training step does when a loss or a gradient is NaN/inf (checked on every rank before
            the optimizer step: :mod:`whale.runtime.nonfinite`). ``"raise"`` (the default): every rank raises
            :class:`whale.NonFiniteError` naming the step, the first non-finite tensor and the fix; the weights
            and the optimizer state are those before the step. ``"skip"``: every rank skips the optimizer step
            and zeroes the gradients, rank 0 warns, and the step's metrics say ``"skipped": True`` (an LR
            scheduler the user steps still advances, as with ``torch.amp.GradScaler``'s skipped steps). Under
            fp16 an overflowing gradient with a finite loss stays the loss scaler's (skipped, scale backed off).
        sequence_parallel: sequence parallelism in split regions (Korthikanti et al. 2022): a split module whose
            rule supports it (a transformer block, :mod:`whale.parallel.seqpar`) keeps LayerNorm, dropout and
            the residual stream on ``[B, s/n, h]`` sequence shards, with all-gather before its column-parallel
            and reduce-scatter after its row-parallel Linears in place of the all-reduce; activation memory
            per rank is divided by the split degree n. The sequence length must be a multiple of n. Recorded in
            the plan.
    """

    num_micro_batch: int = 1
    schedule: ScheduleName = "1F1B"
    cluster: Any = None
    hardware_aware: bool = True
    rebalance_after: int | None = None
    max_grad_norm: float | None = None
    seed: int = 0
    load_shares: tuple[float, ...] | None = None
    bucket_cap_mb: float = 25.0
    backend: str | None = None
    capture: str = "auto"
    zero: int = 0
    precision: PrecisionName = "fp32"
    loss_scale: LossScale = LossScale()
    activation_checkpoint: Any = None
    track_memory: bool | None = None
    forbid: tuple[str, ...] = ()
    offload: OffloadName = "none"
    timeout_s: float | None = None
    auto: bool = False
    nonfinite: NonFiniteName = "raise"
    virtual_stages: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        """Validate every field (one ConfigError line naming the value and the fix) and normalise some."""
        self._check_pipeline()
        self._check_numerics()
        self._check_balance_and_memory()
        self._check_runtime()

    def _check_pipeline(self) -> None:
        """Micro-batches, schedule and virtual stages."""
        if not isinstance(self.num_micro_batch, int) or isinstance(self.num_micro_batch, bool):
            raise ConfigError(f"num_micro_batch must be an int, got {self.num_micro_batch!r}")
        if self.num_micro_batch < 1:
            raise ConfigError(
                f"num_micro_batch={self.num_micro_batch} but it must be >= 1 "
                "(1 = no pipelining / no gradient accumulation)"
            )
        if self.schedule not in RUNNABLE_SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is unknown; choose one of {RUNNABLE_SCHEDULES}")
        if not isinstance(self.virtual_stages, int) or isinstance(self.virtual_stages, bool) or \
                self.virtual_stages < 1:
            raise ConfigError(f"virtual_stages={self.virtual_stages!r} must be an int >= 1 (model chunks per rank)")
        if (self.virtual_stages > 1) != (self.schedule == "Interleaved1F1B"):
            raise ConfigError(f"schedule={self.schedule!r} with virtual_stages={self.virtual_stages}: the "
                              "interleaved schedule needs virtual_stages >= 2 and virtual_stages >= 2 needs "
                              "schedule='Interleaved1F1B'; set both or neither")

    def _check_numerics(self) -> None:
        """Capture, ZeRO stage, precision, loss scaling and gradient buckets."""
        if self.capture not in ("auto", "export", "fx"):
            raise ConfigError(f"capture={self.capture!r} is unknown; choose 'auto', 'export' or 'fx'")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ConfigError(f"zero={self.zero!r} is not a ZeRO stage; choose 0 (off), 1 (optimizer state "
                              "sharded), 2 (optimizer state and gradients sharded) or 3 (also parameters)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is unknown; choose one of {PRECISIONS}")
        if not isinstance(self.loss_scale, LossScale):
            raise ConfigError(f"loss_scale={self.loss_scale!r} must be a whale.LossScale")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb={self.bucket_cap_mb} must be > 0 (MiB per all-reduce bucket)")

    def _check_balance_and_memory(self) -> None:
        """Load shares, re-balancing, clipping, checkpointing, forbidden techniques, memory tracking, offload."""
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
        object.__setattr__(self, "activation_checkpoint", _checkpoint_spec(self.activation_checkpoint))
        _check_forbid(self.forbid)
        object.__setattr__(self, "forbid", tuple(self.forbid))
        if self.track_memory not in (None, True, False):
            raise ConfigError(f"track_memory={self.track_memory!r} must be True, False or None (auto)")
        if self.offload not in OFFLOADS:
            raise ConfigError(f"offload={self.offload!r} is unknown; choose one of {OFFLOADS}")
        if self.offload == "optimizer+params" and self.zero in (1, 2):
            raise ConfigError(f"offload='optimizer+params' with zero={self.zero}: whole parameters cannot stay on "
                              "the host while ZeRO-1/2 keep them whole on the device; use offload='optimizer' "
                              "(each lane offloads its slice of the optimizer state), zero=3 (the parameter "
                              "shards stay on the host) or zero=0")

    def _check_runtime(self) -> None:
        """Timeout, auto planning, the non-finite policy, sequence parallelism and the backend."""
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not self.timeout_s > 0):
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be a number of seconds > 0, or None for the "
                              "default collective timeout (600 s)")
        if self.auto not in (True, False):
            raise ConfigError(f"auto={self.auto!r} must be True or False")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"nonfinite={self.nonfinite!r} is unknown; choose 'raise' (stop every rank with an "
                              "error naming the first NaN/inf tensor) or 'skip' (skip the step's update everywhere)")
        if self.sequence_parallel not in (True, False):
            raise ConfigError(f"sequence_parallel={self.sequence_parallel!r} must be True or False")
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"backend={self.backend!r} is unknown; choose 'gloo', 'nccl' or None (auto)")

    def replace(self, **changes: Any) -> Config:
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-data form (JSON-serializable when ``cluster`` is a path or None)."""
        d = dataclasses.asdict(self)
        d["load_shares"] = list(self.load_shares) if self.load_shares else None
        spec = self.activation_checkpoint
        d["activation_checkpoint"] = spec if isinstance(spec, str) else list(spec)
        d["cluster"] = self.cluster if isinstance(self.cluster, str | type(None)) else repr(self.cluster)
        return d


def _check_forbid(forbid: Any) -> None:
    bad = [f for f in (forbid if isinstance(forbid, tuple | list) else [forbid]) if f not in FORBIDDEN]
    if bad or not isinstance(forbid, tuple | list):
        raise ConfigError(f"forbid={forbid!r}: {bad or forbid!r} cannot be forbidden; give a tuple of names among "
                          f"{FORBIDDEN}")


def _checkpoint_spec(spec: Any) -> str | tuple[str | int, ...]:
    """``Config.activation_checkpoint`` normalised: ``()`` (off), ``"all"``, or a tuple of class names, FQN
    globs and TaskGraph indices (module classes become their names).

    Raises:
        ConfigError: another string than ``"all"``, or an entry that is not a class, a non-empty string or an
            int >= 0.
    """
    if spec is None:
        return ()
    if isinstance(spec, str):
        if spec != "all":
            raise ConfigError(f"activation_checkpoint={spec!r}: a string must be 'all'; give module types, FQN "
                              f"patterns or TaskGraph indices as a tuple, e.g. ({spec!r},)")
        return spec
    if isinstance(spec, type) or not isinstance(spec, tuple | list):
        spec = (spec,)
    out: list[str | int] = []
    for entry in spec:
        if isinstance(entry, type):
            entry = entry.__name__
        ok = (isinstance(entry, str) and entry.strip() and entry != "all") or \
            (isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0)
        if not ok:
            raise ConfigError(f"activation_checkpoint entry {entry!r} must be a module class or class name, an FQN "
                              "glob (e.g. 'blocks.*') or a TaskGraph index >= 0; use 'all' alone for every layer")
        out.append(entry)
    return tuple(out)
