"""Measure the per-unit costs of the step-time model on this machine (:class:`whale.planner.calibration_cache.
Calibration`): seconds, on one thread.

- :func:`calibrate_units`: one real forward of the model on a few rows captures every layer unit's inputs (the
  units of :func:`whale.frontend.profile.default_units`, captured as :mod:`whale.frontend.unit_keys` keys them);
  each unit type not yet cached is then timed alone, forward and backward, at two row counts (CPU time of this
  thread, median of a few repeats), giving a fixed overhead plus seconds per row and per FLOP. The loss is timed
  the same way.
- :func:`measure_comm`: gloo point-to-point and all-reduce on localhost between two spawned processes
  (latency and bandwidth from a small and a large message): what communication costs emulated runs here.
- :func:`measure_optimizer`: AdamW's step per parameter element.

What is measured is cached by :func:`whale.calibration.measure.calibration`; the front end and the planner only
read that cache.
"""

from __future__ import annotations

import contextlib
import os
import queue as q
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from whale.frontend.hwplan import profile, sample_rows
from whale.frontend.memplan import _inside
from whale.frontend.unit_keys import capture_unit_inputs, cut_rows, keys_of, rows_of, variant_keys
from whale.memory.checkpointing import _Checkpointed
from whale.memory.tracker import StorageTracker
from whale.planner.calibration_cache import UnitTiming


def progress(message: str) -> None:
    """One line of what the calibration is measuring, on stderr (``whale calibration: ...``, flushed): the first
    calibration on a machine takes minutes, and says so before the long work."""
    print(f"whale calibration: {message}", file=sys.stderr, flush=True)


def _cpu_seconds(fn, repeats: int) -> float:
    """Median thread CPU seconds of ``fn()`` over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _leaf(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().clone().requires_grad_(True)
    return x


def _time_call(fn, args: tuple, kwargs: dict, repeats: int) -> tuple[float, float]:
    """(forward seconds, backward seconds) of ``fn(*args, **kwargs)``; backward from random output gradients
    into the parameters and every floating-point input."""
    args, kwargs = tree_map(_leaf, (args, kwargs))

    def fwd():
        """One forward with autograd on."""
        with torch.enable_grad():
            return fn(*args, **kwargs)

    outs = [o for o in tree_flatten(fwd())[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.randn_like(o) for o in outs]

    def bwd():
        """CPU seconds of one backward (after an untimed forward)."""
        again = [o for o in tree_flatten(fwd())[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        t0 = time.thread_time()
        if again:
            torch.autograd.backward(again, grads)
        return time.thread_time() - t0

    t_fwd = _cpu_seconds(fwd, repeats)
    bwd()
    t_bwd = statistics.median(bwd() for _ in range(repeats))
    return t_fwd, t_bwd


def fit_line(xs: list[float], ys: list[float], weights: list[float] | None = None) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a, b >= 0`` (a negative slope gives the flat line ``a`` = mean y;
    a negative intercept, the line through 0), weighted by ``weights`` (default all 1)."""
    w = weights or [1.0] * len(xs)
    total = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / total
    my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / total
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys, strict=True)) / sxx if sxx else 0.0
    if b <= 0:
        return my, 0.0
    a = my - b * mx
    if a < 0:
        return 0.0, sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True)) / sum(
            wi * x * x for wi, x in zip(w, xs, strict=True))
    return a, b


def _fit(rows: list[int], times: list[tuple[float, float]], fwd_flops: float, bwd_flops: float) -> UnitTiming:
    """Overhead + per-row slope through the (forward, backward) timings at ``rows``."""
    fo, fs = fit_line(rows, [t[0] for t in times])
    bo, bs = fit_line(rows, [t[1] for t in times])
    return UnitTiming(fs, bs, fo, bo, fs / fwd_flops if fwd_flops > 0 else 0.0,
                      bs / bwd_flops if bwd_flops > 0 else 0.0)


def calibrate_units(model: nn.Module, sample_batch, loss_fn=None, rows: int = 16, repeats: int = 7,
                    known: dict | None = None, tracked: bool = False, precision: str = "fp32",
                    checkpointed: tuple[str, ...] = (), progress=None) -> tuple[dict[str, UnitTiming], dict[str, str]]:
    """Time every unit type of ``model`` not in ``known`` (forward and backward at ``rows // 4``, ``rows // 2``
    and ``rows`` rows, a least-squares line through them); returns ``(timings by key, key by unit name)``.
    With ``tracked`` the units are timed under the CPU memory tracker (:class:`whale.memory.tracker.StorageTracker`,
    on by default under emulation: it sees every operation) and the keys end in ``|tracked``. The model's
    gradients are cleared afterwards. ``precision`` ``"bf16"``/``"fp16"``: every unit's forward runs under CPU
    autocast of that dtype, as :mod:`whale.runtime.precision` runs it (its backward follows the low-precision
    graph); ``checkpointed`` (module FQNs): the units inside them run under the runtime's checkpoint wrapper
    (:class:`whale.memory.checkpointing._Checkpointed`), so their backward holds the recompute and the wrapper's
    fixed cost. Keys then carry the variant (:func:`whale.frontend.unit_keys.variant_keys`). ``progress``
    (a callable taking one line) is told how many types will be timed, only when some are not in ``known``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs (and thread CPU time sees only this thread)
    try:
        return _calibrate_units(model, sample_batch, loss_fn, rows, repeats, known, tracked, precision,
                                checkpointed, progress)
    finally:
        torch.set_num_threads(threads)


def _variant(fn, module: nn.Module, precision: str, checkpointed: bool):
    """``fn`` as the runtime runs the unit: under CPU autocast (``precision`` not fp32), under the checkpoint
    wrapper (``checkpointed``)."""
    if checkpointed:
        fn = _Checkpointed(fn, module)
    if precision == "fp32":
        return fn
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]

    def run(*args, **kwargs):
        """``fn`` under autocast."""
        with torch.autocast("cpu", dtype=dtype):
            return fn(*args, **kwargs)

    return run


def _calibrate_units(model, sample_batch, loss_fn, rows, repeats, known, tracked, precision="fp32",
                     checkpointed=(), progress=None):
    full = sample_rows(sample_batch)
    rows = max(2, min(rows, full))
    prof = profile(model, sample_batch, rows=2, loss_fn=loss_fn)
    names = [u.name for u in prof.units]
    seen = capture_unit_inputs(model, names, rows_of(sample_batch[0], rows, full))
    keys = variant_keys(keys_of(model, names, seen, loss_fn, tracked), precision, checkpointed)
    target = cut_rows(sample_batch[1], rows, full)
    timings: dict[str, UnitTiming] = {}
    counts = sorted({max(1, rows // 4), max(1, rows // 2), rows})
    todo = {keys[u.name] for u in prof.units if not (known and keys[u.name] in known)}
    if todo and progress is not None:
        progress(f"timing {len(todo)} layer-unit type(s) of {type(model).__name__} not cached yet, forward and "
                 f"backward at {len(counts)} row counts (seconds)")
    for u in (*prof.units, prof.rest):
        key = keys[u.name]
        if key in timings or (known and key in known):
            continue
        if u.name == "<rest>":
            if loss_fn is None:
                continue
            fn, args = (lambda out, tgt: loss_fn(out, tgt)), (seen["<output>"][0][0], target)
            kwargs: dict = {}
        else:
            mod, (args, kwargs) = model.get_submodule(u.name), seen[u.name]
            fn = _variant(mod, mod, precision, _inside(u.name, checkpointed))
        with StorageTracker() if tracked else contextlib.nullcontext():
            times = [_time_call(fn, *rows_of((args, kwargs), r, rows), repeats) for r in counts]
        timings[key] = _fit(counts, times, u.forward_flops, u.backward_flops)
    model.zero_grad(set_to_none=True)
    return timings, keys


def measure_optimizer(elements: int = 1 << 20, repeats: int = 5) -> float:
    """Seconds per parameter element of one AdamW step (fp32, one thread)."""
    p = nn.Parameter(torch.randn(elements))
    p.grad = torch.randn(elements)
    opt = torch.optim.AdamW([p], lr=1e-3)
    return _cpu_seconds(opt.step, repeats) / elements


def _comm_worker(rank: int, init_file: str, sizes: list[int], repeats: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    res = {}
    for n in sizes:
        buf = torch.zeros(max(1, n // 4))
        for kind in ("p2p", "allreduce"):
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "allreduce":
                    dist.all_reduce(buf)
                elif rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf[:1], 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf[:1], 0)
                times.append(time.perf_counter() - t0)
            res[(kind, n)] = statistics.median(times[1:])
    res[("cpu", 0)] = _collective_cpu(4 * repeats)
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _collective_cpu(calls: int) -> float:
    """Median CPU seconds of this thread per small gloo collective issued as the runtime issues ZeRO's
    (``dist.broadcast(..., async_op=True)`` then ``wait()``, the source alternating): the Python and c10d
    dispatch, gloo's enqueue and the wait's bookkeeping. The transfer itself runs on gloo's threads, off this
    thread's clock."""
    buf, times = torch.zeros(256), []
    for i in range(calls + 1):
        dist.barrier()
        t0 = time.thread_time()
        dist.broadcast(buf, src=i % 2, async_op=True).wait()
        times.append(time.thread_time() - t0)
    return statistics.median(times[1:])


def _result(queue, procs, timeout: float = 120.0) -> dict:
    """The first result on ``queue``; RuntimeError when a process dies first or ``timeout`` seconds pass."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            res = queue.get(timeout=0.5)
            break
        except q.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("gloo calibration process failed (see its error above)") from None
    else:
        raise RuntimeError(f"gloo calibration gave no result within {timeout:.0f} s")
    for p in procs:
        p.join(timeout=60)
    return res


def measure_comm(small: int = 4, large: int = 4 << 20, repeats: int = 7) -> dict[str, float]:
    """gloo on localhost between two spawned processes: ``{"p2p_latency", "p2p_bandwidth", "allreduce_latency",
    "allreduce_bandwidth", "collective_cpu_seconds"}`` (seconds, bytes/s), from a ``small`` and a ``large``
    message (bytes). A 2-rank ring all-reduce sends S bytes in 2 steps, so its latency is half the small
    message's time; ``collective_cpu_seconds``: the calling thread's CPU per collective call
    (:func:`_collective_cpu`)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(dir=os.environ.get("WHALE_SCRATCH")) as tmp:
        init = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_comm_worker, args=(r, init, [small, large], repeats, queue)) for r in range(2)]
        for p in procs:
            p.start()
        res = _result(queue, procs)
    p2p_lat = max(1e-6, res[("p2p", small)] / 2)  # a round trip of two tiny messages
    p2p_bw = (large - small) / max(1e-9, res[("p2p", large)] - res[("p2p", small)])
    ar_lat = max(1e-6, res[("allreduce", small)] / 2)
    ar_bw = (large - small) / max(1e-9, res[("allreduce", large)] - res[("allreduce", small)])  # sent 2(n-1)/n S = S
    return {"p2p_latency": p2p_lat, "p2p_bandwidth": p2p_bw, "allreduce_latency": ar_lat, "allreduce_bandwidth": ar_bw,
            "collective_cpu_seconds": res[("cpu", 0)]}
