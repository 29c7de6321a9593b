"""The search: the plan with the lowest predicted step time that fits memory (issue 13, part 3).

A pure function over costs, in the style of Alpa / Metis: :func:`enumerate_candidates` lists the space (data
parallel degree d, pipeline stage count p, split degree t with d x p x t = the devices; the stage cut; which
device types run which stage; micro-batch count m; schedule; memory options), and :func:`search` ranks it with
an *injected estimator* ``estimate(candidate) -> Estimate`` (predicted step seconds and per-device peak bytes):
:class:`whale.planner.steptime.estimate.DefaultEstimator` (built from :mod:`whale.planner.steptime.cost`, the event
simulator of
:mod:`whale.plan.schedule` and :mod:`whale.planner.memory`) or any calibrated simulator with the same signature.

Pruning, exact for estimators that declare it (tests compare with brute force over the same space):

- structure: degrees are divisors of the device count, a split degree divides every split layer's experts,
  device types fill a stage's split groups whole, micro-batch counts divide each lane's rows;
- memory before time: ``estimator.bound(c)`` returns the candidate's exact memory and a lower bound on its
  step time without simulating; candidates that do not fit are never simulated, and the others are simulated
  in order of their bound until the bound reaches the ``keep``-th best step time found (branch and bound);
- ``estimator.monotone_options``: the memory techniques whose addition never makes a step faster (for the
  default estimator: activation checkpointing always, offload when the host path is slower than the device's
  optimizer step; not ZeRO, which also shards the optimizer step); once options fit a structure, the same
  options plus such techniques are skipped for that structure.

Annotations are constraints (:class:`Constraints`): an annotated stage count, cut, device count or split is
kept; unannotated parts are free.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from whale.plan.schedule import SCHEDULES
from whale.planner.balance import InfeasiblePlanError
from whale.planner.memory import MemoryOptions, candidates
from whale.units import format_bytes


@dataclass(frozen=True, order=True)
class Candidate:
    """One point of the space. Stage s runs layers ``stage_layers[s]`` (counts, in order) on
    ``d * t`` devices: ``stage_devices[s][k]`` of device type k (an index into the pool's types), in
    ``d`` data-parallel lanes of ``t`` devices that split each layer. ``virtual``: model chunks per device of the
    ``"Interleaved1F1B"`` schedule (1 otherwise); ``sequence_parallel``: split layers keep their activations
    sharded along the sequence (Korthikanti et al. 2022; only with ``split`` > 1)."""

    data_parallel: int
    stages: int
    split: int
    num_micro_batch: int
    schedule: str
    options: MemoryOptions
    stage_layers: tuple[int, ...]
    stage_devices: tuple[tuple[int, ...], ...]
    virtual: int = 1
    sequence_parallel: bool = False

    def describe(self, type_names: Sequence[str] = ()) -> str:
        """One line, e.g. ``"dp 4 x pp 2 x split 1, 8 micro-batches 1F1B, ZeRO-1, cut [3, 3]"``."""
        devs = ""
        if type_names and len(type_names) > 1:
            devs = " on " + " | ".join("+".join(f"{c}x{type_names[k]}" for k, c in enumerate(s) if c)
                                       for s in self.stage_devices)
        sched = self.schedule + (f" v {self.virtual}" if self.virtual > 1 else "")
        sp = " sequence-parallel" if self.sequence_parallel else ""
        return (f"dp {self.data_parallel} x pp {self.stages} x split {self.split}{sp}, {self.num_micro_batch} "
                f"micro-batch(es) {sched}, {self.options.describe()}, cut {list(self.stage_layers)}{devs}")


@dataclass(frozen=True)
class Estimate:
    """What an estimator predicts for a candidate.

    Attributes:
        step_seconds: one training step, seconds (``inf`` when not simulated).
        groups: names of the device groups memory is reported for (e.g. ``"stage 0 V100-32GB"``).
        peak_bytes / capacity: per group, the worst device's predicted peak device bytes and its capacity.
        host_bytes / host_capacity: per group, host bytes per device (offload) and what a device may use.
        detail: free-form numbers (seconds by kind, bytes by category) for reports.
    """

    step_seconds: float
    groups: tuple[str, ...]
    peak_bytes: tuple[float, ...]
    capacity: tuple[float, ...]
    host_bytes: tuple[float, ...] = ()
    host_capacity: tuple[float, ...] = ()
    detail: dict = field(default_factory=dict, compare=False)

    def shortfall(self) -> tuple[float, str]:
        """``(bytes, what)`` of the worst overflow (device or host); bytes <= 0 when everything fits."""
        dev = [need - cap for need, cap in zip(self.peak_bytes, self.capacity, strict=True)]
        host = [need - cap for need, cap in zip(self.host_bytes, self.host_capacity, strict=False)]
        i = max(range(len(dev)), key=dev.__getitem__, default=None)
        j = max(range(len(host)), key=host.__getitem__, default=None)
        if i is None:
            return -math.inf, ""
        if j is not None and host[j] > dev[i]:
            return host[j], (f"{self.groups[j]} needs {format_bytes(self.host_bytes[j])} of host memory per "
                             f"device, has {format_bytes(self.host_capacity[j])}")
        return dev[i], (f"{self.groups[i]} needs {format_bytes(self.peak_bytes[i])} of device memory, has "
                        f"{format_bytes(self.capacity[i])}")

    def __post_init__(self) -> None:
        dev = max(map(operator.sub, self.peak_bytes, self.capacity), default=-math.inf)
        host = max(map(operator.sub, self.host_bytes, self.host_capacity), default=-math.inf)
        object.__setattr__(self, "_overflow", max(dev, host))

    @property
    def overflow(self) -> float:
        """Bytes of the worst overflow, device or host (<= 0: everything fits)."""
        return self._overflow  # type: ignore[attr-defined]

    @property
    def fits(self) -> bool:
        """True when every group fits its device and host memory."""
        return self.overflow <= 0


@dataclass(frozen=True)
class Bound:
    """A lower bound on a candidate's step seconds and its exact worst memory overflow in bytes (device or
    host; <= 0: it fits), both computed without simulating."""

    time_lb: float
    overflow: float


@dataclass(frozen=True)
class Constraints:
    """What the annotations (and Config) fix; ``None`` = free.

    Attributes:
        stages: pipeline stage count (annotated TaskGraphs).
        stage_layers: layers per stage (an annotated cut).
        data_parallel / split: degrees; ``min_split``: a split scope stays split (>= 2 unless its count is 1).
        num_micro_batch / schedule: fixed values.
        floor: memory techniques the user set (kept); forbid: those the planner must not add.
        stage_order: ``"all"`` (every order of device types over stages, and evenly mixed stages),
            ``"memory"`` (types by memory, largest first) or ``"runtime"`` (as the runtime places ranks:
            replicas of ``replica_width`` devices per stage on consecutive ranks, by memory within each).
        replica_width: devices per stage in one replica (nested data parallelism), for ``"runtime"``.
        max_micro_batch: largest micro-batch count tried (``None``: bounded by the batch alone, every lane
            at least one row per micro-batch).
    """

    stages: int | None = None
    stage_layers: tuple[int, ...] | None = None
    data_parallel: int | None = None
    split: int | None = None
    min_split: int = 1
    num_micro_batch: int | None = None
    schedule: str | None = None
    floor: MemoryOptions = MemoryOptions()
    forbid: tuple[str, ...] = ()
    stage_order: str = "all"
    replica_width: int = 1
    max_micro_batch: int | None = None


@dataclass(frozen=True)
class Ranked:
    """A candidate, its estimate and why it lost to the best (empty for the best)."""

    candidate: Candidate
    estimate: Estimate
    reason: str = ""


@dataclass(frozen=True)
class SearchResult:
    """The best candidate, the ranked runner-ups, the infeasible ones that came closest, and counts."""

    best: Ranked
    runner_ups: tuple[Ranked, ...]
    closest_infeasible: tuple[Ranked, ...]
    stats: dict

    def describe(self, type_names: Sequence[str] = ()) -> list[str]:
        """Printable lines: the chosen plan, then each runner-up and why it lost."""
        b = self.best
        out = [f"auto plan: {b.candidate.describe(type_names)}: predicted {b.estimate.step_seconds * 1e3:.4g} ms "
               f"per step ({self.stats['candidates']} candidates, {self.stats['simulated']} simulated, "
               f"{self.stats['seconds']:.2f} s)"]
        out += [f"  runner-up {i + 1}: {r.candidate.describe(type_names)}: {r.reason}"
                for i, r in enumerate(self.runner_ups)]
        out += [f"  does not fit: {r.candidate.describe(type_names)}: {r.reason}" for r in self.closest_infeasible[:2]]
        return out


class NoFeasiblePlanError(InfeasiblePlanError):
    """No candidate fits memory; the message names the smallest shortfall and what would fix it."""


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small = [k for k in range(1, int(math.isqrt(n)) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _runtime_mix(rank_types: Sequence[int], memory: Sequence[float], p: int,
                 width: int) -> tuple[tuple[int, ...], ...]:
    """Device-type counts per stage as the runtime places them (:func:`whale.planner.hardware.device_order`):
    each replica takes ``p * width`` consecutive ranks, ordered by memory (largest first, stable), and its
    stage s the ``width`` devices at positions ``s * width ...``."""
    k, block = max(rank_types) + 1, p * width
    out = [[0] * k for _ in range(p)]
    for start in range(0, len(rank_types), block):
        ranks = sorted(rank_types[start:start + block], key=lambda ty: -memory[ty])
        for pos, ty in enumerate(ranks):
            out[pos // width][ty] += 1
    return tuple(tuple(s) for s in out)


def _stage_mixes(counts: Sequence[int], per_stage: int, p: int, order: str, memory: Sequence[float],
                 t: int, rank_types: Sequence[int] = (), width: int = 1) -> list[tuple[tuple[int, ...], ...]]:
    """Device-type counts per stage: devices sorted by a permutation of the types and cut into ``p`` runs of
    ``per_stage`` (every permutation for ``order="all"``, the memory order for ``"memory"``), plus, for
    ``"all"``, every stage holding an even share of each type; ``"runtime"`` with ``rank_types`` (type of every
    rank) places them as the runtime does (:func:`_runtime_mix`, replicas ``width`` devices per stage). Each
    stage's count of every type divides by ``t``."""
    k = len(counts)
    if order == "runtime" and rank_types and len(rank_types) % (p * width) == 0:
        mix = _runtime_mix(rank_types, memory, p, width)
        return [mix] if all(c % t == 0 for s in mix for c in s) else []
    perms = list(itertools.permutations(range(k))) if order == "all" else \
        [tuple(sorted(range(k), key=lambda i: -memory[i]))]
    out = []
    for perm in perms:
        seq = [ty for ty in perm for _ in range(counts[ty])]
        mix = tuple(tuple(seq[s * per_stage:(s + 1) * per_stage].count(ty) for ty in range(k)) for s in range(p))
        out.append(mix)
    if order == "all" and all(c % p == 0 for c in counts):
        out.append(tuple(tuple(c // p for c in counts) for _ in range(p)))
    return [m for m in dict.fromkeys(out) if all(c % t == 0 for s in m for c in s)]


def _all_cuts(n: int, p: int) -> Iterator[tuple[int, ...]]:
    for bars in itertools.combinations(range(1, n), p - 1):
        edges = (0, *bars, n)
        yield tuple(b - a for a, b in itertools.pairwise(edges))


def enumerate_candidates(num_layers: int, type_counts: Sequence[int], global_batch: int, constraints: Constraints,
                         cut: Callable[[int, tuple], Iterable[tuple[int, ...]]], split_ok: Callable[[int], bool],
                         type_memory: Sequence[float] = (), all_cuts_below: int = 0,
                         rank_types: Sequence[int] = ()) -> Iterator[Candidate]:
    """The space (see the module docstring). ``cut(p, stage_devices)`` gives the cuts to try for a layout
    (e.g. the min-max cut by speed); when the number of contiguous cuts is at most ``all_cuts_below``, every
    cut is tried instead. ``split_ok(t)``: the model's split layers accept degree t. ``type_memory``: bytes of
    each device type; ``rank_types``: the type of every rank, in rank order (for ``stage_order="runtime"``)."""
    c = constraints
    n_dev = sum(type_counts)
    mem = list(type_memory) or [0.0] * len(type_counts)
    floor_opts = candidates(c.floor, c.forbid)
    if c.stage_layers and (sum(c.stage_layers) != num_layers or min(c.stage_layers) < 1
                           or (c.stages and c.stages != len(c.stage_layers))):
        raise ValueError(f"Constraints.stage_layers={c.stage_layers} must be {c.stages or 'some'} counts >= 1 "
                         f"adding up to the model's {num_layers} layers")
    fixed_p = len(c.stage_layers) if c.stage_layers else c.stages
    for p in ([fixed_p] if fixed_p else [q for q in divisors(n_dev) if q <= num_layers]):
        if n_dev % p:
            continue
        for t in divisors(n_dev // p):
            d = n_dev // p // t
            if (c.split and t != c.split) or t < c.min_split or (c.data_parallel and d != c.data_parallel):
                continue
            if not split_ok(t):
                continue
            for mix in _stage_mixes(type_counts, d * t, p, c.stage_order, mem, t, rank_types, c.replica_width):
                if c.stage_layers:
                    cuts = [tuple(c.stage_layers)]
                elif math.comb(num_layers - 1, p - 1) <= all_cuts_below:
                    cuts = list(_all_cuts(num_layers, p))
                else:
                    cuts = list(dict.fromkeys(cut(p, mix)))
                ms = [c.num_micro_batch] if c.num_micro_batch else \
                    [m for m in divisors(global_batch) if global_batch // m >= d and m <= (c.max_micro_batch or m)]
                scheds = [c.schedule] if c.schedule else (list(SCHEDULES) if p > 1 else [SCHEDULES[0]])
                for cut_, m, sched, opt in itertools.product(cuts, ms, scheds, floor_opts):
                    yield Candidate(d, p, t, m, sched, opt, cut_, mix)


def _structure(c: Candidate) -> tuple:
    return (c.data_parallel, c.stages, c.split, c.num_micro_batch, c.schedule, c.stage_layers, c.stage_devices,
            c.virtual, c.sequence_parallel)


def _adds(a: MemoryOptions, b: MemoryOptions, monotone: tuple[str, ...]) -> bool:
    """``b`` is ``a`` plus techniques named in ``monotone`` only (``"activation_checkpoint"``, ``"zero"``,
    ``"offload"``), so an estimator monotone in them predicts ``b`` no faster than ``a``."""
    offs = ("none", "optimizer", "optimizer+params")
    same = {"activation_checkpoint": a.activation_checkpoint == b.activation_checkpoint, "zero": a.zero == b.zero,
            "offload": a.offload == b.offload}
    more = {"activation_checkpoint": a.activation_checkpoint <= b.activation_checkpoint, "zero": a.zero <= b.zero,
            "offload": offs.index(a.offload) <= offs.index(b.offload)}
    return all(more[k] if k in monotone else same[k] for k in same)


def search(cands: Iterable[Candidate], estimate: Callable[[Candidate], Estimate], keep: int = 5) -> SearchResult:
    """The candidate with the least predicted step time that fits, and ``keep - 1`` runner-ups.

    ``estimate`` may carry ``bound(c) -> Bound`` (exact memory overflow, a step-time lower bound), ``memory(c)
    -> Estimate`` (memory only, for the report on candidates that do not fit) and
    ``monotone_options`` (the techniques, among ``"activation_checkpoint"``, ``"zero"``, ``"offload"``, whose
    addition never makes its predicted step faster); without them every candidate is estimated.

    Raises:
        NoFeasiblePlanError: nothing fits (the smallest shortfall, and what would fix it).
        ValueError: an empty space.
    """
    start = time.perf_counter()
    bound = getattr(estimate, "bound", None)
    monotone = tuple(getattr(estimate, "monotone_options", ())) if bound is not None else ()
    pool, fitting, infeasible, n = [], {}, [], 0
    for c in cands:
        n += 1
        key = _structure(c)
        if monotone and any(_adds(o, c.options, monotone) for o in fitting.get(key, ())):
            continue
        e = None if bound else estimate(c)
        b = bound(c) if bound else Bound(0.0, e.overflow)
        lb, over = b.time_lb, b.overflow
        if over > 0:
            infeasible.append((over, c))
            continue
        fitting.setdefault(key, []).append(c.options)
        pool.append((lb, c, e))
    if not n:
        raise ValueError("the search space is empty: no data-parallel x pipeline x split degrees use every device "
                         "under the constraints with at least one row per lane and one layer per stage; use a larger "
                         "global batch, fewer devices or looser constraints")
    infeasible.sort(key=lambda x: (x[0], x[1]))
    memory = getattr(estimate, "memory", estimate)
    closest = [(short, c, memory(c)) for short, c in infeasible[:3]]
    if not pool:
        raise _no_fit(closest)
    pool.sort(key=lambda x: (x[0], x[1]))
    ranked: list[tuple[float, Candidate, Estimate]] = []  # the best ``keep``, by (seconds, candidate)
    simulated = 0
    for lb, c, e in pool:
        if len(ranked) >= keep and lb > ranked[-1][0]:
            break
        e = e or estimate(c)
        simulated += 1
        if e.fits:
            bisect.insort(ranked, (e.step_seconds, c, e), key=lambda x: (x[0], x[1]))
            del ranked[keep:]
    best_t = ranked[0][0]
    runners = tuple(Ranked(c, e, f"slower by {100 * (s / best_t - 1):.1f}% ({s * 1e3:.4g} ms)")
                    for s, c, e in ranked[1:])
    near = tuple(Ranked(c, e, e.shortfall()[1] + f" (short by {format_bytes(short)})") for short, c, e in closest)
    stats = {"candidates": n, "fit": len(pool), "simulated": simulated, "seconds": time.perf_counter() - start}
    return SearchResult(Ranked(ranked[0][1], ranked[0][2]), runners, near, stats)


def _no_fit(closest: list) -> NoFeasiblePlanError:
    short, c, e = closest[0]
    what = e.shortfall()[1]
    host = any(h > cap for h, cap in zip(e.host_bytes, e.host_capacity, strict=False))
    fix = ("more host memory per node (or fewer ranks per node)" if host else
           "more devices, or allow offload / ZeRO / activation checkpointing (Config.forbid), or a smaller batch")
    return NoFeasiblePlanError(
        f"no plan fits memory: the closest, {c.describe()}, still has {what}, short by {format_bytes(short)}; "
        f"fix: {fix}", 0, short + max(e.capacity, default=0.0), max(e.capacity, default=0.0))
