"""Whale's planner against published measurements: the 10 rows of Megatron-LM SC'21 Table 1 (issue 28).

    python benchmarks/published.py --out benchmarks/results/published.json     # seconds, no processes

Each published plan (tensor / pipeline / data degrees, micro-batches, interleaving, full recompute, 16-bit
gradients, the DDP overlap each row ran with; :mod:`benchmarks._published_rows`) is forced through Whale's
step-time and memory model (:class:`whale.planner.transformer_estimate.TransformerEstimator`: roofline
compute per A100, the 1F1B event simulation or the interleaved formula, ring collectives on the node's NVLink
and the per-GPU InfiniBand) and the predicted TFLOP/s per GPU (Megatron's eq. 3 FLOPs over the predicted step
time) is compared with the published one. ONE calibration for the A100-80GB: the roofline's GEMM efficiency,
fitted on ``--calibrate-on`` (default the smallest row, 1.7B) so that row's prediction equals its published
throughput; every other row uses that value unchanged.

Keys: ``published_median_abs_rel_error`` (goal <= 0.10), ``published_max_abs_rel_error`` (goal <= 0.20),
``rows`` (per row predicted vs published TFLOP/s and per-GPU peak bytes), ``calibration``,
``calibration_sensitivity`` (the same errors had each other row been the calibration row),
``auto`` (per row: the auto search on the row's cluster, ``auto_vs_published_predicted`` = the published plan's
predicted step over the auto plan's, ``auto_seconds``, and the closed-form pipeline against the 1F1B event
simulation, ``estimator_vs_simulator_rel_gap``; skipped with ``--skip-auto``),
``published_1t_fits`` (with the predicted bytes beside Megatron's accounting), ``provenance``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._provenance import Run  # noqa: E402
from benchmarks._published_rows import ROWS, SEQ, VOCAB, Row  # noqa: E402
from whale.cluster import CATALOG  # noqa: E402
from whale.planner.gpt import GPTShape  # noqa: E402
from whale.planner.memory import MemoryOptions  # noqa: E402
from whale.planner.roofline import Roofline  # noqa: E402
from whale.planner.search import Candidate, Constraints  # noqa: E402
from whale.planner.steptime.estimate import DevicePool  # noqa: E402
from whale.planner.transformer_estimate import TransformerEstimator  # noqa: E402
from whale.planner.transformer_memory import in_flight_layers, stage_peak  # noqa: E402
from whale.planner.transformer_search import transformer_candidates, transformer_search  # noqa: E402

A100 = CATALOG["A100-80GB"]
GPUS_PER_NODE, NVLINK_EACH_WAY, IB_PER_GPU_EACH_WAY, LATENCY = 8, 300e9, 25e9, 1e-5
HOST_BYTES_PER_GPU = 2e12 / 8  # DGX A100 80GB: 2 TB of host memory per 8 GPUs


def shape_of(row: Row) -> GPTShape:
    """The row's model."""
    return GPTShape(row.layers, row.hidden, row.heads, SEQ, VOCAB)


def pool_of(row: Row) -> DevicePool:
    """The row's cluster: ``row.gpus`` A100-80GB, 8 per node, links per GPU and direction."""
    return DevicePool((A100,), (row.gpus,), (A100.memory_bytes,), (HOST_BYTES_PER_GPU,), GPUS_PER_NODE,
                      NVLINK_EACH_WAY, IB_PER_GPU_EACH_WAY, LATENCY, (), "bf16", ())


def published_plan(row: Row) -> Candidate:
    """The plan Megatron-LM ran: l/p blocks per stage, the embedding on the first, the head on the last."""
    per = 2 * (row.layers // row.pp)
    cut = [per] * row.pp
    cut[0] += 1
    cut[-1] += 1
    sched = "Interleaved1F1B" if row.virtual > 1 else "1F1B"
    return Candidate(row.dp, row.pp, row.tp, row.micro_batches, sched, MemoryOptions(activation_checkpoint=True),
                     tuple(cut), ((row.gpus // row.pp,),) * row.pp, row.virtual)


def estimator(row: Row, efficiency: float) -> TransformerEstimator:
    """Whale's step-time and memory model for the row's model, cluster and runtime settings."""
    return TransformerEstimator(shape_of(row), pool_of(row), row.batch, (Roofline.of(A100, efficiency),),
                                overlap_grad_sync=row.ddp == "torch")


def predict(row: Row, efficiency: float) -> dict:
    """Predicted step seconds, TFLOP/s per GPU and worst per-GPU peak bytes of the row's published plan."""
    est = estimator(row, efficiency)
    e = est(published_plan(row))
    tflops = shape_of(row).iteration_flops(row.batch) / e.step_seconds / row.gpus / 1e12
    return {"step_seconds": e.step_seconds, "tflops_per_gpu": tflops, "peak_bytes": max(e.peak_bytes),
            "fits": e.fits, "pipeline_seconds": e.detail["pipeline_seconds"], "post_seconds": e.detail["post_seconds"]}


def calibrate(row: Row, steps: int = 40) -> float:
    """The GEMM efficiency at which ``row``'s predicted TFLOP/s per GPU equals its published one (bisection;
    the prediction grows with the efficiency)."""
    lo, hi = 0.05, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(row, mid)["tflops_per_gpu"] < row.tflops_per_gpu else (lo, mid)
    return (lo + hi) / 2


def errors(efficiency: float) -> list[float]:
    """|predicted / published - 1| of every row at one GEMM efficiency."""
    return [abs(predict(r, efficiency)["tflops_per_gpu"] / r.tflops_per_gpu - 1) for r in ROWS]


def sensitivity() -> dict:
    """For each row taken as the (one) calibration row instead: the efficiency and the median / max error over
    the ten rows (how much the headline depends on which row was fitted)."""
    out = {}
    for r in ROWS:
        eff = calibrate(r, 25)
        errs = errors(eff)
        out[r.name] = {"gemm_efficiency": round(eff, 4), "median_abs_rel_error": round(statistics.median(errs), 4),
                       "max_abs_rel_error": round(max(errs), 4)}
    return out


def auto_row(row: Row, efficiency: float, split_interleaved: bool = False) -> dict:
    """The auto search on the row's cluster and model (:func:`whale.planner.transformer_search.transformer_search`:
    schedules 1F1B, ZB-H1 and interleaved 1F1B with every legal v, sequence parallelism on/off, checkpointing,
    ZeRO 0-2, legal splits inside a node; interleaving split stages only with ``split_interleaved``): its best
    plan's predicted step over the published plan's (the same estimator, the row's DDP overlap), the search
    seconds, whether the published plan lies in the searched space, and both plans' closed-form vs
    event-simulated pipeline seconds."""
    est = estimator(row, efficiency)
    start = time.perf_counter()
    cons = Constraints(stage_order="memory", forbid=("zero3", "offload", "offload_params"))
    res = transformer_search(est, cons, split_interleaved=split_interleaved)
    seconds = time.perf_counter() - start
    best, pub = res.best.candidate, published_plan(row)
    published = est(pub).step_seconds
    in_space = any(c == pub for c in transformer_candidates(est, dataclasses.replace(
        cons, stages=row.pp, split=row.tp, data_parallel=row.dp, num_micro_batch=row.micro_batches),
        split_interleaved=split_interleaved))
    gaps = [abs(est.pipeline_seconds(c) / est.simulated_pipeline_seconds(c) - 1) for c in (best, pub)]
    return {"name": row.name, "auto_plan": best.describe(),
            "auto_step_seconds": round(res.best.estimate.step_seconds, 4),
            "published_step_seconds": round(published, 4),
            "auto_vs_published_predicted": round(published / res.best.estimate.step_seconds, 4),
            "auto_legal": bool(est.split_ok(best.split)), "auto_fits": bool(res.best.estimate.fits),
            "published_in_space": bool(in_space), "auto_schedule": best.schedule, "auto_virtual": best.virtual,
            "auto_sequence_parallel": best.sequence_parallel,
            "auto_seconds": round(seconds, 2), "candidates": res.stats["candidates"],
            "estimator_vs_simulator_rel_gap": round(max(gaps), 5)}


def megatron_accounting(row: Row) -> dict:
    """Stage 0's per-GPU bytes by the published formulas alone (16 bytes per parameter element of mixed-precision
    Adam, Korthikanti et al.'s 2·s·b·h per layer under full recompute for the p in-flight micro-batches of
    1F1B plus one recomputed layer's 34·s·b·h/... working set), no allocator factor."""
    sh = shape_of(row)
    per = row.layers // row.pp
    elements = (per * sh.layer_params + (VOCAB + SEQ) * sh.hidden) / row.tp
    held = in_flight_layers(0, row.pp, row.micro_batches, per, row.virtual)
    flight = min(row.pp, row.micro_batches)
    pk = stage_peak(SEQ, row.micro_batch, sh.hidden, sh.heads, VOCAB, elements, per, held, flight, True,
                    row.pp == 1, row.tp, recompute="full")
    return {"model_state_bytes": pk.state.total, "activation_bytes": pk.activations, "working_bytes": pk.working,
            "total_bytes": pk.total}


def main() -> None:
    """Calibrate on one row, predict all ten, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/published.json")
    ap.add_argument("--calibrate-on", default="1.7B", choices=[r.name for r in ROWS])
    ap.add_argument("--skip-auto", action="store_true", help="only the forced published plans")
    args = ap.parse_args()
    run = Run()
    cal_row = next(r for r in ROWS if r.name == args.calibrate_on)
    eff = calibrate(cal_row)
    rows, errs = [], []
    for r in ROWS:
        p = predict(r, eff)
        err = p["tflops_per_gpu"] / r.tflops_per_gpu - 1
        errs.append(abs(err))
        rows.append({"name": r.name, "plan": f"tp {r.tp} x pp {r.pp} x dp {r.dp}, micro-batch {r.micro_batch}, "
                     f"{r.micro_batches} micro-batches, v {r.virtual}, DDP {r.ddp}", "gpus": r.gpus,
                     "batch": r.batch, "published_tflops_per_gpu": r.tflops_per_gpu,
                     "predicted_tflops_per_gpu": round(p["tflops_per_gpu"], 2), "rel_error": round(err, 4),
                     "predicted_step_seconds": round(p["step_seconds"], 4),
                     "predicted_peak_bytes_per_gpu": round(p["peak_bytes"]), "fits": bool(p["fits"]),
                     "calibration_row": r.name == cal_row.name})
        print(f"{r.name:>5}: published {r.tflops_per_gpu:5.1f} predicted {p['tflops_per_gpu']:6.1f} TFLOP/s "
              f"({100 * err:+.1f}%), peak {p['peak_bytes'] / 1e9:.1f} GB", flush=True)
    autos = [] if args.skip_auto else [auto_row(r, eff) for r in ROWS]
    megatron = [] if args.skip_auto else [auto_row(r, eff, split_interleaved=True) for r in ROWS]
    for a in autos:
        print(f"{a['name']:>5}: auto {a['auto_plan']}: x{a['auto_vs_published_predicted']:.3f} of the published "
              f"plan's predicted throughput, {a['auto_seconds']:.1f} s", flush=True)
    one_t = ROWS[-1]
    p1t = predict(one_t, eff)
    out = {"published_median_abs_rel_error": round(statistics.median(errs), 4),
           "published_max_abs_rel_error": round(max(errs), 4),
           "calibration": {"device": A100.name, "parameter": "roofline GEMM efficiency (fraction of the 312 "
                           "TFLOP/s 16-bit peak)", "value": round(eff, 4), "fitted_on_row": cal_row.name,
                           "per_row_fit": False},
           "rows": rows,
           "calibration_sensitivity": sensitivity(),
           "published_1t_fits": bool(p1t["fits"]),
           "published_1t_memory": {"predicted_peak_bytes_per_gpu": round(p1t["peak_bytes"]),
                                   "capacity_bytes": A100.memory_bytes,
                                   "megatron_accounting_stage0": megatron_accounting(one_t),
                                   "allocator_factor_in_prediction": True},
           **({"auto": autos, "auto_vs_published_predicted_min": min(a["auto_vs_published_predicted"] for a in autos),
               "auto_seconds_max": max(a["auto_seconds"] for a in autos),
               "estimator_vs_simulator_max_rel_gap": max(a["estimator_vs_simulator_rel_gap"]
                                                         for a in autos + megatron),
               "auto_space": "what Whale's runtime runs: 1F1B, ZB-H1, interleaved 1F1B at split 1 (the runtime's "
                             "interleaved plans hold no split regions), sequence parallelism on/off",
               "auto_megatron_space": megatron,
               "auto_megatron_space_vs_published_predicted_min": min(a["auto_vs_published_predicted"]
                                                                     for a in megatron),
               "published_in_megatron_space_all": all(a["published_in_space"] for a in megatron)}
              if autos else {})}
    out = run.write(args.out, out)  # with provenance: commit, command, dates, host load, wall time
    run.stop()
    print(json.dumps({k: v for k, v in out.items() if k.startswith(("published_m", "published_1t_fits", "auto_v",
                                                                      "auto_s", "estimator"))}))


if __name__ == "__main__":
    main()
