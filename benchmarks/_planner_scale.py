"""Search time at scale and the paper's configurations (part of :mod:`benchmarks.planner`).

Models are described without weights (:func:`whale.planner.model_desc.transformer`). M6-MoE shapes ASSUMED (the
M6-T / M6-10T papers' tables could not be checked here): d_model 1024, FFN width 21248, 24 layers, every FFN
an MoE layer with top-1 routing, 512 tokens per sample, vocabulary 21128; 960 experts gives 1.0T parameters
("M6-1T"), 10240 experts 10.7T ("M6-10T"). Global batch 1024 sequences. Clusters: nodes of 8 devices, NVLink
inside, 50 Gb/s Ethernet between nodes (the paper's testbed), host memory per node from
:mod:`whale.memory.host` (512 GB for 8 V100s) unless stated.

Keys: ``plan_seconds_512_gpus`` (10T on 512 V100-32GB; goal < 10 s), ``plan_seconds_1024_mixed`` (1T on 256
A100-40GB + 512 V100-32GB + 256 T4; goal < 30 s), ``search_time_table`` (8 to 1024 V100-32GB, the 1T model),
``paper_configs`` (plans with per-device memory breakdowns, whether they fit and under which assumption they
would). Search times are the CPU seconds of the one process (``time.process_time``: one core, single-threaded
Python; the wall seconds on this shared 2-core machine, loaded by other jobs, are reported beside them as
``wall_seconds``): the whole search, enumeration, memory bounds and simulation, from the model description to
the ranked result.
"""

from __future__ import annotations

import time

from whale.cluster import ClusterSpec, NodeSpec, get_device_type
from whale.planner.model_desc import transformer
from whale.planner.search import NoFeasiblePlanError
from whale.planner.steptime.estimate import DefaultEstimator, plan_search, pool_from_cluster

BATCH = 1024
CROSS_NODES = True
"""Split groups may span nodes here (the MoE layers' expert parallelism is cross-node, GShard-style); the search
costs such groups on the inter-node link. The default search keeps split groups inside a node (issue 28)."""
SHAPES = {"M6-1T": 960, "M6-10T": 10240}


def model(name: str):
    """The assumed M6-MoE shape (module docstring) by name."""
    return transformer(24, 1024, 512, 21128, d_ff=21248, experts=SHAPES[name], top_k=1, name=name)


def cluster(parts: list[tuple[str, int]], per_node: int = 8, host: float | None = None) -> ClusterSpec:
    """Nodes of ``per_node`` devices of one type each, ``parts`` = [(type, devices)]."""
    nodes = []
    for name, count in parts:
        dev = get_device_type(name)
        nodes += [NodeSpec((dev,) * per_node, host_memory_bytes=host) for _ in range(count // per_node)]
    return ClusterSpec(tuple(nodes))


def timed(desc, spec) -> dict:
    """Search ``desc`` on ``spec``; seconds, counts, and the answer (plan or shortfall)."""
    pool = pool_from_cluster(spec)
    start, cpu = time.perf_counter(), time.process_time()
    try:
        result = plan_search(desc, pool, BATCH, cross_nodes=CROSS_NODES)
        answer = {"fits": True, "plan": result.best.candidate.describe([t.name for t in pool.types]),
                  "predicted_step_seconds": result.best.estimate.step_seconds, "stats": result.stats,
                  "runner_ups": [f"{r.candidate.describe()}: {r.reason}" for r in result.runner_ups]}
    except NoFeasiblePlanError as e:
        answer = {"fits": False, "why": str(e), "lacking_bytes": e.lacking_bytes}
    return {"seconds": time.process_time() - cpu, "wall_seconds": time.perf_counter() - start,
            "devices": spec.world_size, **answer}


def _breakdown(desc, spec, candidate, estimate) -> dict:
    """Per stage group: device bytes by category, host bytes, capacity."""
    est = DefaultEstimator(desc, pool_from_cluster(spec), BATCH, CROSS_NODES)
    rows = {}
    for s in range(candidate.stages):
        for k, r in est._lanes(candidate, s)[1]:
            rows[f"stage {s} {est.pool.types[k].name}"] = est.breakdown(candidate, s, int(-(-r // 1)))
    worst = max(range(len(estimate.groups)), key=lambda i: estimate.peak_bytes[i] / estimate.capacity[i])
    g = estimate.groups[worst]
    return {"worst_group": g, "device_bytes_by_category": {k: v for k, v in rows[g].items() if k != "host"},
            "device_total_bytes": estimate.peak_bytes[worst], "device_capacity_bytes": estimate.capacity[worst],
            "host_bytes_per_device": rows[g]["host"], "host_capacity_per_device": estimate.host_capacity[worst]}


def paper_config(name: str, devices: int) -> dict:
    """The search's answer for ``name`` on ``devices`` V100-32GB, with the memory breakdown of the chosen plan
    (or of the closest one that does not fit), and the bytes an alternative precision/offload would need."""
    desc, spec = model(name), cluster([("V100-32GB", devices)])
    pool = pool_from_cluster(spec)
    out = {"model": desc.summary(), "devices": f"{devices} x V100-32GB, 8 per node, "
           f"{pool.host_capacity[0] * 8 / 1e9:.0f} GB host memory per node", "global_batch": BATCH,
           "memory_model": "fp32 parameters and gradients on the device, AdamW state 8 bytes/param "
                           "(whale.planner.memory); activations 16-bit per the analytic description"}
    try:
        res = plan_search(desc, pool, BATCH, cross_nodes=CROSS_NODES)
        c, e, fits = res.best.candidate, res.best.estimate, True
    except NoFeasiblePlanError:
        from whale.planner.search import Constraints, enumerate_candidates
        est = DefaultEstimator(desc, pool, BATCH, CROSS_NODES)
        cands = enumerate_candidates(len(desc.layers), pool.counts, BATCH, Constraints(), est.cuts, est.split_ok)
        c, e = min(((c, est.memory(c)) for c in cands), key=lambda x: (x[1].overflow, x[0]))
        fits = False
    out.update({"fits": fits, "plan": c.describe(),
                "predicted_step_seconds": e.step_seconds if fits else None, **_breakdown(desc, spec, c, e)})
    params = desc.params
    out["assumptions"] = {
        "fp32_params_grads_on_device_bytes_per_device": 8 * params / devices,
        "fp16_params_grads_on_device_bytes_per_device": 4 * params / devices,
        "host_bytes_per_node_for_fp32_master_and_adam_offloaded": 16 * params / devices * 8,
        "statement": _statement(fits, params, devices, out),
    }
    return out


def _statement(fits: bool, params: int, devices: int, out: dict) -> str:
    gb = 1e9
    if fits:
        return (f"fits under the memory model: worst device {out['device_total_bytes'] / gb:.1f} GB of "
                f"{out['device_capacity_bytes'] / gb:.1f} GB, host {out['host_bytes_per_device'] / gb:.1f} GB of "
                f"{out['host_capacity_per_device'] / gb:.1f} GB per device")
    over = out["device_total_bytes"] - out["device_capacity_bytes"]
    return (f"does NOT fit: the closest plan still needs {out['device_total_bytes'] / gb:.1f} GB on a 32 GB device "
            f"({over / gb:.1f} GB = {over:.3g} bytes over). Even fp16 parameters and gradients alone are "
            f"{4 * params / devices / gb:.1f} GB per device with every parameter sharded over all {devices} "
            f"devices, so it fits only if parameters live in host memory and stream to the device layer by layer "
            f"(M6-10T's granular CPU offloading; Whale's ZeRO-3 offloads the optimizer but does not stream "
            f"parameters from the host), which needs "
            f"{16 * params / devices * 8 / 1e12:.2f} TB of host memory per 8-GPU node for fp32 masters + AdamW "
            f"(or {12 * params / devices * 8 / 1e12:.2f} TB with fp16 parameters on the host)")


def run(args) -> dict:
    """All keys of this part (see the module docstring)."""
    out: dict = {"assumed_shapes": {k: model(k).summary() for k in SHAPES}, "global_batch": BATCH}
    r512 = timed(model("M6-10T"), cluster([("V100-32GB", 512)]))
    out["plan_seconds_512_gpus"] = r512["seconds"]
    out["plan_512_gpus"] = r512
    mixed = cluster([("A100-40GB", 256), ("V100-32GB", 512), ("T4", 256)])
    rmix = timed(model("M6-1T"), mixed)
    out["plan_seconds_1024_mixed"] = rmix["seconds"]
    out["plan_1024_mixed"] = rmix
    table = []
    for n in (8, 16, 32, 64, 128, 256, 512, 1024):
        r = timed(model("M6-1T"), cluster([("V100-32GB", n)]))
        table.append({"devices": n, "seconds": r["seconds"], "wall_seconds": r["wall_seconds"], "fits": r["fits"],
                      "candidates": r.get("stats", {}).get("candidates")})
        print(f"search 1T MoE on {n:>5} V100-32GB: {r['seconds']:6.2f} s, fits={r['fits']}", flush=True)
    out["search_time_table"] = table
    out["paper_configs"] = {"M6-1T on 480 V100-32GB": paper_config("M6-1T", 480),
                            "M6-10T on 512 V100-32GB": paper_config("M6-10T", 512)}
    return out
