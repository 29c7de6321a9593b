"""Calibrate what the engine really costs: short real runs of the engine on calibration models (issue 13).

Unit types timed in isolation (:mod:`whale.calibration.units`) miss what a step inside the engine adds: the
runtime's hooks and bookkeeping per segment, and under emulation the cold caches a core meets after every
emulation wait (a segment's CPU seconds in a stretched run measure 1.4-2x the same work timed back to back).
:func:`calibrate_engine` runs the real engine (:func:`whale.parallelize`) in spawned processes on calibration
models of its own (:class:`CalibrationNet`: an embedding, ``nn.TransformerEncoderLayer`` blocks, a head; never
the model being predicted), reads the engine's own per-segment CPU seconds (the emulator's,
:meth:`whale.runtime.emulation.EmulatedDevice.segment_cpu_seconds`) and per-step times, and fits by least
squares (:func:`whale.calibration.units.fit_line`) a handful of global constants
(:class:`whale.planner.calibration_cache.EngineTiming`):

- per direction, engine CPU seconds of a segment = ``scale x X + overhead``, X the isolated unit seconds of
  the same segment (:func:`whale.frontend.simcost.model_costs`): a line through 1-rank runs whose segments
  span 0.5-25 ms of X (:data:`SAMPLES` x :data:`MICRO_BATCHES`), once without emulation waits (``hot_*``) and
  once stretched by :data:`STRETCH`. The intercept is the engine's fixed cost per segment, larger after an
  emulation wait (a core woken from sleep runs its first ~millisecond slowly): about 1 ms here, which
  dominates the small segments of deep pipelines with many micro-batches (a 4-stage GPT at 2 rows per
  micro-batch: X 0.7 ms, engine 1.8-2.4 ms). Per model (:func:`calibrate_model`), the scales are refit from
  the model's own 2-rank data-parallel runs with the machine's intercepts kept, and take precedence for that
  model (:meth:`whale.planner.calibration_cache.Calibration.for_model`);
- per micro-batch, the executor's time outside segments (``micro_batch_overhead``; a line in the micro-batch
  count, its intercept going to the per-step overhead);
- per step, the time after the schedule beyond the isolated optimizer step (``step_overhead``);
- per split-module call, the extra CPU seconds of a 2-rank split run over the fit above (``split_*``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import queue as q
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from whale.annotation import replicate
from whale.annotation import split as split_scope
from whale.calibration.units import calibrate_units, fit_line, progress
from whale.config import Config
from whale.frontend.hwplan import sample_rows
from whale.frontend.simcost import covers, model_costs
from whale.frontend.unit_keys import rows_of, unit_keys
from whale.loss import token_cross_entropy
from whale.plan.plan import Plan
from whale.planner.calibration_cache import MODEL_ENGINE_VERSION, Calibration, EngineTiming, cache_path
from whale.runtime.context import init
from whale.runtime.parallelize import parallelize

STRETCH = 8.0
"""``1 + slowdown`` of the stretched calibration runs (the benchmark's emulated ranks run at 8-32)."""
UNEQUAL = (STRETCH - 1, 1.5 * STRETCH - 1)
"""Slowdowns of the 2-rank calibration runs: lanes of unequal speed (as V100 next to P100), so that the
faster one waits inside its segments (split collectives) as on a mixed cluster."""
SAMPLES = ((32, 1), (64, 2), (128, 2))
"""``(width, layers)`` of the 1-rank calibration runs' :class:`CalibrationNet` models."""
SPLIT_SAMPLE = (64, 2)
"""``(width, split)`` of the 2-rank split calibration runs' :class:`CalibrationNet` (its MLP split in two)."""
MICRO_BATCHES, SPLIT_MICRO_BATCHES = (1, 4, 16), (1, 2, 4)
MODEL_MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batches of a model's own engine fit (:func:`calibrate_model`): of :data:`MODEL_ROWS` rows over 2 ranks,
segments of 8 down to 1 row, an 8x span that pins the model's own per-segment intercept."""
BATCH, SEQ, VOCAB = 16, 32, 512
MACHINE_MINUTES = 2
"""Measured minutes of :func:`calibrate_engine` on 2 cores (the estimate its first progress line gives)."""
CROWD_RANKS, CROWD_MICRO_BATCHES = 4, (2, 4)
"""A model's crowded runs (:func:`_crowding`): 4 ranks on this machine, :data:`MODEL_ROWS` rows in segments
of 2 and 1 rows."""
CROWD_SLOWDOWNS = (UNEQUAL[0], UNEQUAL[0], UNEQUAL[1], UNEQUAL[1])
"""Slowdowns of the 4 crowded ranks (two pairs of unequal speed, as the 2-rank runs)."""
MODEL_ROWS = 16
"""At most this many rows of a model's sample batch feed its own engine fit (:func:`calibrate_model`): the
scales are per unit second, and a job's full batch would make the stretched runs take minutes."""


class CalibrationNet(nn.Module):
    """The engine calibration's model: ``[B, T]`` token ids -> ``[B, T, vocab]`` logits through an embedding,
    ``layers`` ``nn.TransformerEncoderLayer`` (width ``d``, 4 heads, MLP 4d) and a head; with ``split`` > 1 an
    MLP between the blocks is split over ``split`` ranks (the rest replicated over them)."""

    def __init__(self, d: int, layers: int = 2, split: int = 0, vocab: int = VOCAB) -> None:
        super().__init__()

        def _block():
            return nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)

        with replicate(split) if split > 1 else contextlib.nullcontext():
            self.emb = nn.Embedding(vocab, d)
            self.first = _block()
            self.mlp = None
            if split > 1:
                with split_scope(split):
                    self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.rest = nn.ModuleList(_block() for _ in range(layers - 1))
            self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        """``[B, T]`` int64 token ids -> ``[B, T, vocab]`` logits."""
        x = self.first(self.emb(idx))
        if self.mlp is not None:
            x = x + self.mlp(x)
        for b in self.rest:
            x = b(x)
        return self.head(x)


def _sample(d: int, split: int = 0, layers: int = 2):
    """``(model, batch, loss)`` of a calibration run (same weights every time)."""
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return CalibrationNet(d, layers, split=split), (x, x), token_cross_entropy()


def _replicated_plan(model: nn.Module, m: int, world: int):
    """A data-parallel plan over ``world`` ranks running every top-level module of ``model`` replicated (its
    annotations set aside), with ``m`` micro-batches: how any model runs for :func:`calibrate_model`."""
    names = [n for n, _ in model.named_children()]
    return Plan.from_json(json.dumps({
        "world_size": world, "num_replicas": world, "num_micro_batch": m, "schedule": "1F1B",
        "task_graphs": [{"index": 0, "kind": "replicate", "device_count": 1, "modules": names, "nested": [],
                         "num_params": sum(p.numel() for p in model.parameters()), "shard_weights": []}]}))


def _run(sample, m: int, slowdowns: tuple[float, ...], warmup: int, steps: int, tracked: bool = False) -> dict:
    """One engine run on this process group of ``sample`` (``(width, split)`` of a :class:`CalibrationNet`, or
    a ``(model, batch, loss)`` run data-parallel by :func:`_replicated_plan`), this rank stretched by
    ``1 + slowdowns[rank]``, under the CPU memory tracker with ``tracked``: medians of the segments' CPU seconds
    (the emulator's) and wall seconds per emulated second (``wall / (1 + slowdown)``: what the emulation made of
    them, wake-up delays included), of the time outside segments within the schedule (``gap``) and of the time
    after it (``post``)."""
    slowdown = slowdowns[dist.get_rank()]
    model, batch, loss = _sample(*sample) if isinstance(sample[0], int) else copy.deepcopy(sample)  # fresh
    plan = None if isinstance(sample[0], int) else _replicated_plan(model, m, dist.get_world_size())
    ctx = init(Config(num_micro_batch=m, seed=0, track_memory=tracked))
    eng = parallelize(model, loss, lambda ps: torch.optim.AdamW(ps, lr=1e-4), ctx=ctx, plan=plan)
    eng.slowdown = slowdown
    gap, post, wall = [], [], {"F": [], "B": []}
    for i in range(warmup + steps):
        r = eng.step(batch)
        if i >= warmup:
            gap.append(r["schedule_time"] - sum(c1 - c0 for _, _, c0, c1 in eng.last_timeline))
            post.append(r["step_time"] - r["schedule_time"])
            for label, _, c0, c1 in eng.last_timeline:
                wall[label[0]].append((c1 - c0) / (1.0 + slowdown))
    cpu = eng.executor.emulator.segment_cpu_seconds()
    return {"sample": sample if isinstance(sample[0], int) else None, "m": m, "slowdown": slowdown,
            "plan": eng.plan.to_json(), "wall_f": statistics.median(wall["F"]), "wall_b": statistics.median(wall["B"]),
            "cpu_f": statistics.median(v for k, v in cpu.items() if k[0] == "F"),
            "cpu_b": statistics.median(v for k, v in cpu.items() if k[0] == "B"),
            "gap": statistics.median(gap), "post": statistics.median(post),
            "elements": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _worker(rank: int, world: int, init_file: str, runs: list[tuple], queue) -> None:
    """Run ``runs`` on this spawned rank; rank 0 reports ``(rank, "done", i)`` after run ``i``, then every
    rank its results (or its exception)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("WHALE_CLUSTER", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a training job's, when run from one
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        out = []
        for i, r in enumerate(runs):
            out.append(_run(*r))
            if rank == 0:
                queue.put((rank, "done", i))
        queue.put((rank, "result", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "result", exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe(run: tuple) -> str:
    """A calibration run in words, e.g. ``CalibrationNet width 64 x 2 layers, 4 micro-batch(es), stretched 8x``."""
    sample, m, slowdowns = run[:3]
    what = (f"CalibrationNet width {sample[0]}" + (f" x {sample[2]} layers" if sample[1] <= 1 else
                                                   f", MLP split over {sample[1]}")) if isinstance(sample[0], int) \
        else f"{type(sample[0]).__name__} data parallel"
    speed = "without waits" if not any(slowdowns) else "stretched " + "/".join(f"{1 + s:g}x" for s in slowdowns)
    return f"{what}, {m} micro-batch(es), {speed}"


def _progress(what: str, runs: list[tuple], done: int, elapsed: float) -> None:
    """The progress line after ``done`` of ``runs`` (seconds ``elapsed``): the run, and the time left at the
    mean pace so far."""
    left = elapsed / done * (len(runs) - done)
    progress(f"{what} [{done}/{len(runs)}] {_describe(runs[done - 1])}: {elapsed:.0f} s so far, about "
             f"{left:.0f} s left")


def _spawn(world: int, runs: list[tuple], timeout: float = 600.0, what: str = "engine run") -> list[list[dict]]:
    """``runs`` (``_run``'s arguments) on ``world`` spawned gloo processes; per rank, the results. A progress line
    on stderr after each run (:func:`whale.calibration.units.progress`, prefixed ``what``).

    Raises:
        RuntimeError: a process failed or gave nothing within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("WHALE_SCRATCH")) as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), runs, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        got: dict = {}
        try:
            while len(got) < world:
                rank, kind, value = queue.get(timeout=timeout)
                if kind == "done":
                    _progress(what, runs, value + 1, time.perf_counter() - t0)
                else:
                    got[rank] = value
        except q.Empty:
            raise RuntimeError(f"engine calibration gave no result within {timeout:.0f} s") from None
        finally:
            for p in procs:
                p.join(timeout=60)
    bad = [v for v in got.values() if isinstance(v, BaseException)]
    if bad:
        raise RuntimeError(f"engine calibration run failed: {bad[0]!r}") from bad[0]
    return [got[r] for r in range(world)]


def _isolated(res: dict, calib: Calibration, sample=None, tracked: bool = False) -> tuple[float, float, int]:
    """``(X forward, X backward, split modules)``: the isolated unit seconds of one micro-batch of the run's
    (single-stage) plan on one lane, as :func:`whale.planner.steptime.simulate.segment_seconds` sums them; ``sample``:
    the run's ``(model, batch, loss)`` (default: its :class:`CalibrationNet`); ``tracked``: the units' timings under
    the memory tracker."""
    model, batch, loss = sample or _sample(*res["sample"])
    plan = Plan.from_json(res["plan"])
    st = model_costs(model, plan, batch, loss, calib, tracked=tracked)[0][0]
    rows = len(batch[1]) / res["m"] / plan.lanes_of(0)
    return st.fwd_overhead + rows * st.fwd_per_row, st.bwd_overhead + rows * st.bwd_per_row, st.split_modules


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(scale, overhead)`` of the least-squares line ``y = overhead + scale x`` (both >= 0)."""
    overhead, scale = fit_line([x for x, _ in points], [y for _, y in points])
    return scale, overhead


def _relative_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(overhead, scale)`` of the line ``y = overhead + scale x`` minimising the squared *relative* error
    ``sum(((overhead + scale x - y) / y)^2)`` (weighted least squares, weights ``1/y^2``): every segment size
    counts alike, so the small segments pin the intercept. Both clamped at 0 (refit through 0, or a flat line).

    Raises:
        ValueError: fewer than two points, or a ``y`` <= 0.
    """
    if len(xs) < 2 or min(ys) <= 0:
        raise ValueError(f"a line needs >= 2 points with y > 0, got {len(xs)} points, min y {min(ys, default=0)}")
    return fit_line(xs, ys, [1.0 / y**2 for y in ys])


def _fit_segments(runs: list[dict], iso: list[tuple], overheads: dict | None = None) -> dict:
    """``hot_*`` and stretched ``*_scale`` and ``*_overhead`` of :class:`EngineTiming`, per direction, from
    runs and their isolated seconds X: a line of relative least squares (:func:`_relative_line`) through
    (X, engine seconds); with ``overheads`` (the four ``*_overhead`` fields, the machine's fit) only the scale,
    as the median of ``(engine - overhead) / X`` (one model's runs span too few segment sizes for an
    intercept; a median, as repeated runs on a shared host scatter by +-25%). Hot (slowdown 0): CPU seconds
    (the wall time of a loaded host is not modelled); stretched: wall seconds per emulated second."""
    fits = {}
    for name, hot, kind in (("hot_", True, "cpu"), ("", False, "wall")):
        pts = [(x, r) for x, r in zip(iso, runs, strict=True) if (r["slowdown"] == 0) == hot]
        for i, d in ((0, "fwd"), (1, "bwd")):
            xs, ys = [x[i] for x, _ in pts], [r[f"{kind}_{d[0]}"] for _, r in pts]
            if overheads is None:
                fits[f"{name}{d}_overhead"], fits[f"{name}{d}_scale"] = _relative_line(xs, ys)
            else:
                fixed = overheads[f"{name}{d}_overhead"]
                fits[f"{name}{d}_overhead"] = fixed
                ratios = [(y - fixed) / x for x, y in zip(xs, ys, strict=True)]
                fits[f"{name}{d}_scale"] = max(0.0, statistics.median(ratios))
    return fits


def fit_engine(single: list[dict], split: list[dict], calib: Calibration) -> tuple[EngineTiming, dict]:
    """The :class:`EngineTiming` and the calibration fields ``step_overhead`` (the time after the schedule
    beyond the measured optimizer, plus the schedule's fixed time outside segments) and ``segment_overhead``
    (0: in the fit) from engine runs (``single``: 1-rank runs at slowdown 0
    and ``STRETCH - 1``; ``split``: one rank's results of the 2-rank split runs, stretched). ``calib`` must
    hold the calibration models' unit timings."""
    fits = _fit_segments(single, [_isolated(r, calib) for r in single])
    cold = [r for r in single if r["slowdown"] > 0]
    per_mb, fixed = _fit([(r["m"], r["gap"]) for r in cold])
    post = max(0.0, statistics.median(r["post"] - calib.optimizer_seconds_per_element * r["elements"]
                                      for r in cold))
    eng = EngineTiming(**fits, micro_batch_overhead=per_mb, stretch=STRETCH)
    res_f, res_b = [], []
    for r in split:
        xf, xb, calls = _isolated(r, calib)
        f, b = eng.segment(xf, xb, STRETCH)
        res_f.append((r["wall_f"] - f) / max(1, calls))
        res_b.append((r["wall_b"] - b) / max(1, calls))
    if split:
        eng = dataclasses.replace(eng, split_fwd=max(0.0, statistics.median(res_f)),
                                  split_bwd=max(0.0, statistics.median(res_b)))
    return eng, {"step_overhead": post + fixed, "segment_overhead": 0.0}


def calibrate_engine(calib: Calibration, warmup: int = 3, steps: int = 6) -> Calibration:
    """``calib`` with the machine's engine fit (:func:`fit_engine`) measured here: 1-rank runs of
    :class:`CalibrationNet` (:data:`SAMPLES`, micro-batches :data:`MICRO_BATCHES`, without waits and
    stretched by :data:`STRETCH`) in one spawned process, 2-rank split runs (:data:`SPLIT_MICRO_BATCHES`) in
    two; the calibration models' unit types are timed too (:func:`whale.calibration.units.calibrate_units`).
    About 2 minutes on 2 cores; nothing is saved here."""
    runs = [((d, 0, n), m, (s,), warmup, steps) for s in (0.0, STRETCH - 1) for d, n in SAMPLES for m in MICRO_BATCHES]
    split_runs = [(SPLIT_SAMPLE, m, UNEQUAL, warmup, steps) for m in SPLIT_MICRO_BATCHES]
    progress(f"measuring this machine's engine fit, once (cached in {cache_path()}): {len(runs)} one-rank and "
             f"{len(split_runs)} two-rank engine runs of calibration models, about {MACHINE_MINUTES} min on 2 cores")
    for sample in [(d, 0, n) for d, n in SAMPLES] + [SPLIT_SAMPLE]:
        model, batch, loss = _sample(*sample)
        timings, _ = calibrate_units(model, batch, loss, known=calib.units)
        calib = calib.with_units(timings)
    single = _spawn(1, runs, what="machine engine fit, one-rank run")[0]
    split = [r for rank in _spawn(2, split_runs, what="machine engine fit, split run") for r in rank] \
        if split_runs else []
    eng, fields = fit_engine(single, split, calib)
    return dataclasses.replace(calib, engine=eng, **fields)


def calibrate_model(model: nn.Module, sample_batch, loss_fn, calib: Calibration, tracked: bool = False,
                    warmup: int = 3, steps: int = 6) -> EngineTiming:
    """The engine fit of ``model`` itself: its own 2-rank data-parallel runs (every top-level module
    replicated, :func:`_replicated_plan`) at :data:`MODEL_MICRO_BATCHES` micro-batches of ``sample_batch``
    (its first :data:`MODEL_ROWS` rows), without waits and twice stretched by :data:`UNEQUAL`, in two spawned
    processes (model, batch, loss pickled); per direction the line of :func:`_fit_segments` (the model's own
    per-segment intercept and scale, by relative least squares over segments of 1 to 8 rows) against the
    model's isolated unit seconds (``calib`` must hold them), the rest (per micro-batch, split calls) from the
    machine's fit ``calib.engine``; version :data:`~whale.planner.calibration_cache.MODEL_ENGINE_VERSION`. (The
    machine's intercepts, fitted on ``CalibrationNet``, under-priced a GPT's 1-row segments by a third: a
    model's hooks and small kernels cost per segment what its units' isolated per-call costs do not show.)
    With ``tracked`` the runs and the unit timings are under the CPU memory tracker (as an emulated run's).
    50 s for the planner benchmark's GPT, 5 min for ``make train``'s, on 2 cores; nothing is saved here.

    Raises:
        RuntimeError: the model cannot run (or be pickled) in the spawned process.
        ValueError: ``calib`` lacks some of the model's unit timings (calibrate them first).
    """
    if not covers(calib, unit_keys(model, sample_batch, None, loss_fn, tracked), loss_fn):
        raise ValueError("the calibration lacks some of this model's unit timings; calibrate its units first "
                         "(whale.calibration.measure.calibration)")
    full = sample_rows(sample_batch)
    sample = (model, rows_of(sample_batch, min(full, MODEL_ROWS), full), loss_fn)
    runs = [(sample, m, s, warmup, steps, tracked) for s in ((0.0, 0.0), UNEQUAL, UNEQUAL) for m in MODEL_MICRO_BATCHES]
    progress(f"measuring the engine fit of this model ({type(model).__name__}), once per model (cached in "
             f"{cache_path()}): {len(runs)} two-rank data-parallel runs of its first {min(full, MODEL_ROWS)} rows, "
             "40 s to 4 min on 2 cores by its size")
    got = _spawn(2, runs, what="model engine fit, run")
    runs = [r for rank in got for r in rank]
    machine = calib.engine or EngineTiming()
    fit = dataclasses.replace(machine, **_fit_segments(runs, [_isolated(r, calib, sample, tracked) for r in runs]),
                              stretch=STRETCH, version=MODEL_ENGINE_VERSION)
    return _crowding(fit, sample, calib, warmup, steps, tracked)


def _crowding(fit: EngineTiming, sample, calib: Calibration, warmup: int, steps: int,
              tracked: bool) -> EngineTiming:
    """``fit`` with its crowding (:meth:`EngineTiming.crowding`) when this machine has fewer than
    :data:`CROWD_RANKS` cores: the model's data-parallel runs on that many ranks (:data:`CROWD_MICRO_BATCHES`,
    stretched by :data:`CROWD_SLOWDOWNS`), the median over ranks, runs and directions of their engine seconds
    per emulated second over what the 2-rank ``fit`` gives for the same segments, as
    ``crowd = (ratio - 1) / (CROWD_RANKS / cores - 1)``."""
    cores = os.cpu_count() or 1
    if cores >= CROWD_RANKS:
        return fit
    runs = [(sample, m, CROWD_SLOWDOWNS, warmup, steps, tracked) for m in CROWD_MICRO_BATCHES]
    got = [r for rank in _spawn(CROWD_RANKS, runs, what="model engine fit, crowded run") for r in rank]
    ratios = []
    for r in got:
        xf, xb, _ = _isolated(r, calib, sample, tracked)
        f, b = fit.segment(xf, xb, 1.0 + r["slowdown"])
        ratios += [r["wall_f"] / f, r["wall_b"] / b]
    crowd = max(0.0, (statistics.median(ratios) - 1.0) / (CROWD_RANKS / cores - 1.0))
    return dataclasses.replace(fit, crowd=crowd, crowd_cores=cores)
