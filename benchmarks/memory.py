"""Measured memory per rank of the GPT example, with and without activation checkpointing, beside the planner's
prediction; and what measuring costs.

Four ranks (2 pipeline stages x 2 data-parallel lanes, 1F1B) on the emulated V100/P100 cluster of ``make train``
run a few AdamW steps of ``examples/gpt/model.py`` twice: as is, and with every block checkpointed
(``Config(activation_checkpoint="all")``). Every rank's peak is measured by the storage tracker
(:mod:`whale.memory.tracker`, live storage by category), never estimated; the planner's per-rank prediction
(``Plan.predicted_memory``, from the fake-tensor profile) stands beside it with the ratio. A last pair of runs
on plain CPU ranks (no emulation) times the steps with the tracker off and on, and one process times a forward
and backward plain, under a do-nothing ``TorchDispatchMode`` and under the tracker (how much of the cost is the
Python dispatch mode itself).

    python benchmarks/memory.py --out benchmarks/results/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._launch import launch  # noqa: E402

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "v100_p100.yaml")
CONFIGS = {"no_checkpointing": {"checkpoint": None, "cluster": CLUSTER, "track": None},
           "checkpointing_all_blocks": {"checkpoint": "all", "cluster": CLUSTER, "track": None},
           "cpu_tracker_off": {"checkpoint": None, "cluster": None, "track": False},
           "cpu_tracker_on": {"checkpoint": None, "cluster": None, "track": True}}


def _run(ctx, cfg: dict, extra: dict) -> dict:
    """Train a few steps of the GPT under ``extra`` (checkpointing, cluster, tracking) in this process group."""
    import dataclasses

    import torch

    import whale as wh
    from examples.gpt.model import GPT, GPTConfig
    from whale.frontend.planning import resolve_cluster

    config = ctx.config.replace(cluster=extra["cluster"], activation_checkpoint=extra["checkpoint"],
                                track_memory=extra["track"])
    run_ctx = dataclasses.replace(ctx, config=config, cluster=resolve_cluster(extra["cluster"], ctx.world_size))
    torch.manual_seed(0)
    gpt = GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4,
                    n_embd=cfg["embd"], dropout=0.1)
    model = GPT(gpt, stages=2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(cfg["steps"])]
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                            ctx=run_ctx, sample_batch=batches[0])
    times = []
    for b in batches:
        t0 = time.perf_counter()
        engine.step(b)
        times.append(time.perf_counter() - t0)
    rows, table = wh.memory_table(engine)
    return {"rows": rows, "table": table, "step_s": statistics.median(times[1:]), "plan": str(engine.plan)}


def _worker(rank, world, cfg):
    """Every configuration, one after another, in one process group."""
    import whale as wh

    ctx = wh.init(wh.Config(num_micro_batch=cfg["micro_batches"], seed=0))
    return {name: _run(ctx, cfg, extra) for name, extra in CONFIGS.items()}


def _dispatch_overhead(base: dict, repeats: int = 7) -> dict:
    """One process, one thread: best-of-``repeats`` seconds of a forward + backward of the GPT plain, under a
    do-nothing dispatch mode, and under the storage tracker."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from examples.gpt.model import GPT, GPTConfig
    from whale.memory.tracker import StorageTracker

    class Noop(TorchDispatchMode):
        """Runs every op as is."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=base["vocab"], block_size=base["seq"], n_layer=base["layers"], n_head=4,
                          n_embd=base["embd"]))
    x = torch.randint(0, base["vocab"], (base["batch"] // 4, base["seq"]))
    best = {}
    for name, mode in (("plain", None), ("noop_dispatch_mode", Noop()), ("tracker", StorageTracker())) * 2:
        for _ in range(repeats):
            t0 = time.perf_counter()
            with mode if mode is not None else torch.enable_grad():
                model(x).float().pow(2).mean().backward()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return {**{f"{k}_s": v for k, v in best.items()}, "noop_over_plain": best["noop_dispatch_mode"] / best["plain"],
            "tracker_over_plain": best["tracker"] / best["plain"]}


def _ranks(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        pred, peak = r["predicted_bytes"], r["peak_bytes"]
        out.append({"rank": r["rank"], "stage": r["stage"], "lane": r["lane"], "device": r["device"],
                    "measured_peak_bytes": peak, "bytes_at_peak": r["at_peak"],
                    "activation_peak_bytes": r["category_peaks"].get("activations"),
                    "capacity_bytes": r["capacity_bytes"], "predicted_bytes": pred,
                    "predicted_over_measured": pred / peak if pred and peak else None})
    return out


def main() -> None:
    """Run the configurations, print the tables, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    base = {"layers": args.layers, "embd": args.embd, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
            "micro_batches": args.micro_batches, "steps": args.steps}
    t0 = time.time()
    results = launch(_worker, 4, base)
    runs = {name: [r[name] for r in results] for name in CONFIGS}
    for name in CONFIGS:
        print(f"== {name}\n{runs[name][0]['table']}", flush=True)
    print(f"({time.time() - t0:.0f} s for the four runs)")
    off, on = (_ranks(runs[k][0]["rows"]) for k in ("no_checkpointing", "checkpointing_all_blocks"))
    side = [{"rank": a["rank"], "stage": a["stage"], "device": a["device"],
             "peak_bytes_without": a["measured_peak_bytes"], "peak_bytes_with": b["measured_peak_bytes"],
             "peak_with_over_without": b["measured_peak_bytes"] / a["measured_peak_bytes"],
             "activation_peak_bytes_without": a["activation_peak_bytes"],
             "activation_peak_bytes_with": b["activation_peak_bytes"],
             "predicted_bytes_without": a["predicted_bytes"], "predicted_bytes_with": b["predicted_bytes"]}
            for a, b in zip(off, on, strict=True)]
    errors = [abs(r["predicted_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
              for r in off + on if r["predicted_bytes"]]
    step_off = max(r["step_s"] for r in runs["cpu_tracker_off"])
    step_on = max(r["step_s"] for r in runs["cpu_tracker_on"])
    out = {"model": {k: base[k] for k in ("layers", "embd", "vocab", "seq")}, "global_batch": args.batch,
           "micro_batches": args.micro_batches, "world_size": 4, "layout": "2 pipeline stages x 2 lanes, 1F1B",
           "cluster": "examples/clusters/v100_p100.yaml (EMULATED: CPU ranks imitating V100/P100)",
           "no_checkpointing": off, "checkpointing_all_blocks": on, "side_by_side": side,
           "memory_prediction_max_rel_error": max(errors) if errors else None,
           "tracker_overhead": {"median_step_s_tracker_off": step_off, "median_step_s_tracker_on": step_on,
                                "ratio_on_over_off": step_on / step_off, "where": "plain CPU ranks, no emulation",
                                "one_process_forward_backward": _dispatch_overhead(base)},
           "plan_with_checkpointing": runs["checkpointing_all_blocks"][0]["plan"]}
    print(json.dumps({k: out[k] for k in ("side_by_side", "memory_prediction_max_rel_error", "tracker_overhead")},
                     indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
