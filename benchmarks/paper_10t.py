"""The Whale paper's headline planned: a 10-trillion-parameter M6 MoE on 512 V100-32GB (issue 28, ``paper_10t_fits``).

    python benchmarks/paper_10t.py --out benchmarks/results/paper_10t.json     # seconds, no processes

Sources. Whale (Jia et al., USENIX ATC 2022, abstract): "Deployed in a production cluster with 512 GPUs, Whale
successfully trains ... M6 ... with over ten trillion parameters". M6-10T (Lin et al., arXiv 2110.03888,
abstract): a 10-trillion-parameter model pretrained on 512 GPUs in 10 days, with *granular CPU offloading* to
manage CPU memory. M6-T (Yang et al., arXiv 2105.15082, abstract): the 1T version on 480 V100-32GB. How EPL
(Whale's open-source release) writes M6: attention and gating under ``replicate(all GPUs)``, the MoE variables
under ``split(all GPUs)`` (alibaba/EasyParallelLibrary, ``docs/en/tutorials/moe.md``): expert parallelism over
every device, the rest data parallel.

The configuration used (the papers' tables could not be read here; the shape is ASSUMED, the same as
``benchmarks/_planner_scale.py``'s, whose 960-expert version gives M6-T's 1.0T parameters): 24 layers, d_model
1024, 16 heads, FFN width 21248, every FFN an MoE layer of 10240 experts with top-1 routing and capacity factor
1.25 (Switch Transformer's training default, ASSUMED), 512 tokens per sample, vocabulary 21128; 10.7T parameters;
global batch 1024 sequences. Cluster: 64 nodes of 8 V100-32GB, the catalog's NVLink inside, 50 Gb/s between
nodes (the cluster spec's default ``inter_node_bandwidth``), and ``HOST_BYTES_PER_NODE`` of host memory declared
per node (``nodes[i].host_memory_bytes``; ASSUMED: not stated in what could be read; the plan's own need is
reported beside it). Compute at the V100's datasheet fp16 tensor-core peak (no V100 calibration exists here;
compute is under 1% of the predicted step).

The techniques the paper names, as :class:`whale.planner.steptime.expert_offload.ExpertOffloadEstimator` models
them: fp16 mixed precision (fp32 master + AdamW moments with the optimizer), expert parallelism over all devices,
and offload to each node's declared host memory, up to granular parameter offload. The search
(:func:`whale.planner.steptime.estimate.plan_search`, split groups inside a node, legal degrees only) picks the
plan; the same search with offload forbidden, and with the DGX-1 default host memory (512 GB per node), shows
that it does not fit without them, naming the shortfall.

Keys: ``paper_10t_fits``, ``paper_10t`` (plan, per-device bytes by category, per-host bytes against the declared
capacity, predicted step seconds and their parts, runner-ups, search CPU seconds), ``paper_10t_without_offload``
and ``paper_10t_default_host_memory`` (each ``fits`` and the shortfall), ``configuration``, ``provenance``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._provenance import Run  # noqa: E402
from whale.cluster import ClusterSpec, NodeSpec, get_device_type  # noqa: E402
from whale.memory.host import node_host_memory  # noqa: E402
from whale.planner.model_desc import ModelDesc, transformer  # noqa: E402
from whale.planner.search import Constraints, NoFeasiblePlanError  # noqa: E402
from whale.planner.steptime.estimate import plan_search, pool_from_cluster  # noqa: E402
from whale.planner.steptime.expert_offload import ExpertOffloadEstimator  # noqa: E402

NODES, PER_NODE, BATCH = 64, 8, 1024
HOST_BYTES_PER_NODE = 3e12
"""Declared host memory per node, bytes (ASSUMED, see the module docstring)."""
SHAPE = {"n_layer": 24, "d_model": 1024, "seq": 512, "vocab": 21128, "d_ff": 21248, "experts": 10240, "top_k": 1,
         "heads": 16, "capacity_factor": 1.25}


def model() -> ModelDesc:
    """The assumed M6-10T shape (module docstring)."""
    return transformer(**SHAPE, name="M6-10T")


def cluster(host_bytes: float | None = HOST_BYTES_PER_NODE) -> ClusterSpec:
    """64 nodes of 8 V100-32GB, each declaring ``host_bytes`` of host memory (``None``: the catalog default)."""
    v100 = get_device_type("V100-32GB")
    return ClusterSpec(tuple(NodeSpec((v100,) * PER_NODE, host_memory_bytes=host_bytes) for _ in range(NODES)))


def plan(desc: ModelDesc, spec: ClusterSpec, forbid: tuple[str, ...] = ()) -> dict:
    """Search ``desc`` on ``spec``: the chosen plan with its bytes and step time, or the shortfall."""
    pool = pool_from_cluster(spec, "fp16")
    est = ExpertOffloadEstimator(desc, pool, BATCH)
    cpu = time.process_time()
    host_node = node_host_memory(spec.nodes[0])
    try:
        res = plan_search(desc, pool, BATCH, Constraints(forbid=forbid), estimator=est)
    except NoFeasiblePlanError as e:
        return {"fits": False, "shortfall": str(e), "lacking_bytes": e.lacking_bytes,
                "declared_host_bytes_per_node": host_node, "search_cpu_seconds": time.process_time() - cpu}
    c, e = res.best.candidate, res.best.estimate
    worst = max(range(len(e.groups)), key=lambda i: e.peak_bytes[i] / e.capacity[i])
    rows = max(r for _, r in est._lanes(c, 0)[1])
    dev = est.breakdown(c, 0, int(rows))
    host_dev = dev.pop("host")
    return {"fits": True, "plan": c.describe(), "predicted_step_seconds": e.step_seconds,
            "step_parts_seconds": {k: e.detail[k] for k in ("pipeline_seconds", "post_seconds")},
            "device_bytes_by_category": dev, "device_bytes": e.peak_bytes[worst],
            "device_capacity_bytes": e.capacity[worst], "host_bytes_per_device": host_dev,
            "host_bytes_per_node": host_dev * PER_NODE, "declared_host_bytes_per_node": host_node,
            "host_fits": host_dev * PER_NODE <= host_node,
            "runner_ups": [f"{r.candidate.describe()}: {r.reason}" for r in res.runner_ups],
            "stats": res.stats, "search_cpu_seconds": time.process_time() - cpu}


def main() -> None:
    """Plan the 10T model three ways and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/paper_10t.json")
    args = ap.parse_args()
    run = Run()
    desc = model()
    best = plan(desc, cluster())
    no_off = plan(desc, cluster(), forbid=("offload",))
    default_host = plan(desc, cluster(None))
    out = {"paper_10t_fits": bool(best["fits"]) and not no_off["fits"], "paper_10t": best,
           "paper_10t_without_offload": no_off, "paper_10t_default_host_memory": default_host,
           "configuration": {"model": desc.summary(), "shape": SHAPE, "global_batch": BATCH,
                             "cluster": f"{NODES} nodes x {PER_NODE} V100-32GB, {HOST_BYTES_PER_NODE:.3g} bytes of "
                                        "host memory declared per node (ASSUMED)",
                             "techniques": "fp16 mixed precision (fp32 master + AdamW moments with the optimizer), "
                                           "expert parallelism over every device of a stage, offload to host "
                                           "memory up to granular parameter offload (ExpertOffloadEstimator)",
                             "source": "see benchmarks/paper_10t.py's docstring"}}
    out = run.write(args.out, out)
    run.stop()
    print(json.dumps({"paper_10t_fits": out["paper_10t_fits"], "plan": best.get("plan"),
                      "step_s": best.get("predicted_step_seconds"), "device_bytes": best.get("device_bytes"),
                      "host_bytes_per_node": best.get("host_bytes_per_node"),
                      "without_offload": no_off.get("shortfall"), "default_host": default_host.get("shortfall")},
                     indent=1))


if __name__ == "__main__":
    main()
