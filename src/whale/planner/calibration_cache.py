"""Calibration data for the step-time model (:mod:`whale.planner.steptime.simulate`): measured, cached, pure to read.

FLOPs are not time: a large matmul (a GPT's LM head) runs at a higher fraction of peak than attention blocks or
small layers, and layers with no counted FLOPs (norms, embeddings, the loss) still take time. A
:class:`Calibration` holds, per layer unit *type* (class and shape signature, :func:`unit_key`), seconds per
FLOP and a fixed seconds-per-call overhead for forward and backward, measured on this machine
(:func:`whale.calibration.units.calibrate_units`), plus the local communication costs of gloo on localhost
(what emulated runs really pay, :func:`whale.calibration.units.measure_comm`) and the optimizer's seconds per
parameter element.

The cache is one JSON file (default ``~/.cache/whale/calibration.json``, or ``WHALE_CALIBRATION``) keyed by
:func:`machine_key` (host CPU, torch version, dtype), so a calibration is never reused on another machine or
torch. Nothing here measures; this module only holds, reads and writes the numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class UnitTiming:
    """Measured cost of one layer-unit type on the calibration machine (one CPU thread).

    Time of one call on ``rows`` samples = ``overhead + rows * per_row`` seconds, for forward (``fwd_*``) and
    backward (``bwd_*``). ``*_per_flop`` = per_row / FLOPs per sample (0 when the unit has no counted FLOPs):
    the type's seconds per FLOP, the "efficiency" of :func:`whale.planner.steptime.cost.compute_time` as measured.
    """

    fwd_per_row: float
    bwd_per_row: float
    fwd_overhead: float = 0.0
    bwd_overhead: float = 0.0
    fwd_per_flop: float = 0.0
    bwd_per_flop: float = 0.0


ENGINE_VERSION = 2
"""Version of the engine calibration's procedure (:mod:`whale.calibration.engine`): a cached
:class:`EngineTiming` of another version is measured again (2: per-segment intercepts fitted)."""
MODEL_ENGINE_VERSION = 4
"""Version of a model's own engine fit (:func:`whale.calibration.engine.calibrate_model`, in
:attr:`Calibration.model_engines`); another version is measured again (4: the model's own intercepts, from
segments of 1 to 8 rows, and the crowding of 4 ranks on the machine's cores)."""


@dataclass(frozen=True)
class EngineTiming:
    """How a stage's compute inside the real engine relates to its isolated unit timings (fitted on short
    engine runs of calibration models on this machine, :mod:`whale.calibration.engine`). Seconds.

    Engine CPU seconds of one forward (backward) segment = ``scale x X + overhead``, X the summed isolated
    unit seconds of :class:`UnitTiming`: ``scale`` takes in the runtime's hooks and, under emulation, the cold
    caches a core meets after each emulation wait; ``overhead`` the fixed per-segment work. Two fits: ``hot_*``
    from runs without waits, the plain ones from runs stretched by ``stretch`` (``1 + slowdown``); a rank of
    speed factor f blends them by its waiting fraction ``1 - 1/f`` (:meth:`segment`). Outside the segments,
    at real speed: ``micro_batch_overhead`` per micro-batch (executor bookkeeping, batch slicing).
    A split (sharded) module adds ``split_fwd`` / ``split_bwd`` CPU seconds per call (its bridges'
    and collectives' bookkeeping), fitted on a 2-rank split run.

    Crowding (a model's own fit only): with more ranks than the machine's ``crowd_cores`` cores, ranks share a
    core and each wakes from its emulation wait into caches the others have just evicted, so the same segment
    costs more: engine seconds x ``1 + crowd x (ranks / crowd_cores - 1)`` (:meth:`crowding`), ``crowd`` fitted
    from the model's 4-rank runs against its 2-rank line (:func:`whale.calibration.engine.calibrate_model`).
    """

    fwd_scale: float = 1.0
    bwd_scale: float = 1.0
    fwd_overhead: float = 0.0
    bwd_overhead: float = 0.0
    hot_fwd_scale: float = 1.0
    hot_bwd_scale: float = 1.0
    hot_fwd_overhead: float = 0.0
    hot_bwd_overhead: float = 0.0
    micro_batch_overhead: float = 0.0
    split_fwd: float = 0.0
    split_bwd: float = 0.0
    stretch: float = 8.0
    version: int = ENGINE_VERSION
    crowd: float = 0.0
    crowd_cores: int = 0

    def crowding(self, ranks: int) -> float:
        """Engine seconds per engine second of an uncrowded rank when ``ranks`` ranks share this machine's
        ``crowd_cores`` cores (1.0 at or below one rank per core, or without a crowding fit; ``ranks`` = 0:
        not on this machine)."""
        if self.crowd_cores <= 0 or ranks <= self.crowd_cores:
            return 1.0
        return 1.0 + self.crowd * (ranks / self.crowd_cores - 1.0)

    def weight(self, factor: float) -> float:
        """Blend weight of the stretched fit for a rank of speed ``factor``: its waiting fraction
        ``1 - 1/factor`` over the calibration runs' ``1 - 1/stretch``, in [0, 1] (0 at factor <= 1)."""
        if factor <= 1.0:
            return 0.0
        return min(1.0, (1.0 - 1.0 / factor) / (1.0 - 1.0 / self.stretch))

    def segment(self, fwd: float, bwd: float, factor: float, split_calls: int = 0,
                ranks: int = 0) -> tuple[float, float]:
        """Engine CPU seconds ``(forward, backward)`` of a segment whose units take ``fwd``/``bwd`` isolated
        seconds, with ``split_calls`` split-module calls, on a rank of speed ``factor``, one of ``ranks`` on
        this machine (:meth:`crowding`; 0: not on this machine)."""
        w, c = self.weight(factor), self.crowding(ranks)
        mix = lambda hot, cold: hot + w * (cold - hot)  # noqa: E731
        return (c * (mix(self.hot_fwd_scale, self.fwd_scale) * fwd + mix(self.hot_fwd_overhead, self.fwd_overhead)
                     + split_calls * self.split_fwd),
                c * (mix(self.hot_bwd_scale, self.bwd_scale) * bwd + mix(self.hot_bwd_overhead, self.bwd_overhead)
                     + split_calls * self.split_bwd))


@dataclass(frozen=True)
class Calibration:
    """Everything the step-time model takes from measurement. Units: seconds, bytes/s.

    Attributes:
        key: :func:`machine_key` of the machine measured.
        units: :class:`UnitTiming` by :func:`unit_key`.
        p2p_latency, p2p_bandwidth: gloo point-to-point on localhost (one message: latency + bytes/bandwidth).
        allreduce_latency, allreduce_bandwidth: gloo all-reduce on localhost, per ring step and per byte sent
            (fed to :func:`whale.planner.steptime.cost.ring_allreduce_time`).
        collective_cpu_seconds: CPU seconds the calling thread spends per gloo collective call (dispatch,
            enqueue, wait bookkeeping; the transfer is on gloo's threads). Inside a compute segment (ZeRO-3's
            per-unit gathers and reduce-scatters) it is compute the emulation stretches. Measured with the
            gloo costs (:func:`whale.calibration.units.measure_comm`); the default is this host's (2 cores).
        optimizer_seconds_per_element: the optimizer step (AdamW, fp32) per parameter element on one thread.
        segment_overhead: seconds the runtime adds to each forward or backward segment beyond the units.
        step_overhead: seconds per step outside segments, communication and optimizer (bookkeeping).
        gpu_efficiency: achieved fraction of a real accelerator's peak assumed for the most efficient unit type
            (real clusters only; not measurable here).
        engine: the engine fit (:class:`EngineTiming`); ``None`` before it is measured (then segments cost
            their units' seconds plus ``segment_overhead``). With it, ``segment_overhead`` is 0 and
            ``step_overhead`` is the engine runs' fit too.
        model_engines: per model signature (:func:`model_signature`), the engine fit of that model's own
            1-rank runs (:func:`whale.calibration.engine.calibrate_model`); :meth:`for_model` puts it in
            place of ``engine``.
    """

    key: str = ""
    units: dict[str, UnitTiming] = field(default_factory=dict)
    p2p_latency: float = 1e-4
    p2p_bandwidth: float = 1e9
    allreduce_latency: float = 1e-4
    allreduce_bandwidth: float = 1e9
    collective_cpu_seconds: float = 5e-5
    optimizer_seconds_per_element: float = 5e-9
    segment_overhead: float = 2e-4
    step_overhead: float = 1e-3
    gpu_efficiency: float = 0.5
    engine: EngineTiming | None = None
    model_engines: dict[str, EngineTiming] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (:meth:`from_dict` inverts it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        """Inverse of :meth:`to_dict`. Raises ValueError naming an unknown field."""
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(data) - known)
        if bad:
            raise ValueError(f"unknown calibration field(s) {bad}; known: {sorted(known)}")
        units = {k: UnitTiming(**v) for k, v in data.get("units", {}).items()}
        engine = data.get("engine")
        engine = EngineTiming(**engine) if isinstance(engine, dict) else engine
        models = {k: EngineTiming(**v) for k, v in data.get("model_engines", {}).items()}
        return cls(**{**data, "units": units, "engine": engine, "model_engines": models})

    def for_model(self, signature: str) -> Calibration:
        """This calibration with the model's own engine fit (``model_engines[signature]``, when measured and of
        the current :data:`MODEL_ENGINE_VERSION`) as ``engine``."""
        fit = self.model_engines.get(signature)
        if fit is None or fit.version != MODEL_ENGINE_VERSION:
            return self
        return dataclasses.replace(self, engine=fit)

    def with_units(self, units: dict[str, UnitTiming]) -> Calibration:
        """A copy with ``units`` added (replacing entries of the same key)."""
        return dataclasses.replace(self, units={**self.units, **units})

    def best_seconds_per_flop(self) -> float:
        """The smallest measured seconds per FLOP over unit types (the calibration machine's best achieved
        speed, 1 / FLOP/s); 0.0 when no unit has FLOPs."""
        rates = [r for u in self.units.values() for r in (u.fwd_per_flop, u.bwd_per_flop) if r > 0]
        return min(rates, default=0.0)


def machine_key(dtype: str = "fp32") -> str:
    """``"<cpu model>|<cores>|torch <version>|<dtype>"``: what a calibration is valid for."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|{os.cpu_count()}|torch {torch.__version__}|{dtype}"


def unit_key(module_type: type, param_elements: int, input_shapes: tuple) -> str:
    """The calibration key of a layer unit: class path, parameter elements and the per-sample input shapes
    (batch dim dropped), e.g. ``"examples.gpt.model.Block|198272|(128, 128)"``: units of one type and shape
    (a transformer's blocks) share one entry."""
    return f"{module_type.__module__}.{module_type.__qualname__}|{param_elements}|{input_shapes}"


def model_signature(keys: dict[str, str]) -> str:
    """A model's key in :attr:`Calibration.model_engines`: a hash of its units' calibration keys by name
    (:func:`whale.frontend.unit_keys.unit_keys`; runs under the memory tracker have keys of their own)."""
    text = "\n".join(f"{n}={k}" for n, k in sorted(keys.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_path() -> Path:
    """The calibration cache file: ``$WHALE_CALIBRATION`` or ``~/.cache/whale/calibration.json``."""
    env = os.environ.get("WHALE_CALIBRATION", "").strip()
    return Path(env) if env else Path.home() / ".cache" / "whale" / "calibration.json"


def load(key: str, path: Path | None = None) -> Calibration | None:
    """The cached calibration for ``key`` (:func:`machine_key`), or ``None`` when there is none (or the file is
    unreadable: a cache is never an error)."""
    try:
        data = json.loads((path or cache_path()).read_text())
        return Calibration.from_dict(data[key]) if key in data else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def save(calib: Calibration, path: Path | None = None) -> Path:
    """Write ``calib`` into the cache under its key (other machines' entries are kept); returns the path."""
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[calib.key] = calib.to_dict()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path
