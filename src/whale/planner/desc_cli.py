"""``whale plan`` / ``whale simulate`` on a described model: ``--model-desc gpt:layers=..,hidden=..,heads=..``
(or a YAML file of the same keys) with forced degrees ``--dp/--pp/--split/--micro-batches`` (issue 28,
part 4).

The model is never built: :class:`whale.planner.transformer_estimate.TransformerEstimator` plans and predicts
it from its shape (roofline compute per device type, Korthikanti memory), so a 1T-parameter model plans in
seconds with no per-unit timing run. Without ``--cluster`` the devices are ``--world`` ``--device`` GPUs in
nodes of ``--gpus-per-node``, links per GPU and direction ``--intra-bandwidth`` / ``--inter-bandwidth``
(defaults: a DGX A100 cluster as in Megatron-LM SC'21). Degrees not given are searched; with every degree
given the plan is forced.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_GEMM_EFFICIENCY = 0.58
"""Roofline GEMM efficiency used when ``--gemm-efficiency`` is not given: the A100-80GB value that
``benchmarks/published.py`` fits on Megatron-LM's 1.7B row (0.5834); for other device types a starting
point, not a calibration."""

DESC_DEFAULTS = {"device": "A100-80GB", "gpus_per_node": 8, "intra_bandwidth": 300e9, "inter_bandwidth": 25e9,
                 "gemm_efficiency": DEFAULT_GEMM_EFFICIENCY}
"""The described-model flags' defaults, filled in by :func:`describe_run` (the parser leaves them ``None`` so
that :func:`desc_only_flags` sees which were given)."""
DESC_ONLY = ("batch", "dp", "pp", "split", "sequence_parallel", "recompute", "cross_nodes", *DESC_DEFAULTS)
"""The described-model flags that a ``--model`` run has no use for (its stages and split come from the model's
own scopes)."""


def add_desc_args(p: argparse.ArgumentParser) -> None:
    """The described-model arguments of ``whale plan`` and ``whale simulate``."""
    g = p.add_argument_group("described model (no module built; see whale.planner.desc_cli)")
    g.add_argument("--model-desc", metavar="gpt:k=v,...|FILE.yaml",
                   help="e.g. gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200 (instead of --model)")
    g.add_argument("--batch", type=int, help="global batch in samples (default: the world size)")
    g.add_argument("--dp", type=int, help="force the data-parallel degree")
    g.add_argument("--pp", type=int, help="force the pipeline stage count")
    g.add_argument("--split", type=int, help="force the split (tensor-parallel) degree")
    g.add_argument("--virtual-stages", type=int, help="force interleaved 1F1B with this many chunks per device "
                   "(>= 2; 1: no interleaving; predicted; split stages interleaved as Megatron-LM does; with "
                   "--model: the model's stage scopes per device, default 2 under --schedule interleaved)")
    g.add_argument("--sequence-parallel", choices=["on", "off"], help="force sequence parallelism (default: searched)")
    g.add_argument("--recompute", action="store_true", help="force full activation recomputation")
    g.add_argument("--cross-nodes", action="store_true", help="allow split groups across nodes")
    g.add_argument("--device", help="catalog device type without --cluster (default A100-80GB)")
    g.add_argument("--gpus-per-node", type=int, help="devices per node without --cluster (default 8)")
    g.add_argument("--intra-bandwidth", type=float, help="bytes/s per GPU each way in a node (default 300e9)")
    g.add_argument("--inter-bandwidth", type=float, help="bytes/s per GPU each way between nodes (default 25e9)")
    g.add_argument("--gemm-efficiency", type=float,
                   help=f"roofline GEMM efficiency (default {DEFAULT_GEMM_EFFICIENCY})")


def desc_only_flags(ns: argparse.Namespace) -> list[str]:
    """The flags of the described-model group given on ``ns`` that only a ``--model-desc`` run reads (all but
    ``--model-desc`` and ``--virtual-stages``), as ``--flag``: a ``--model`` run refuses them instead of
    ignoring them."""
    return [f"--{k.replace('_', '-')}" for k in DESC_ONLY if getattr(ns, k, None) not in (None, False)]


def check_virtual_flags(ns: argparse.Namespace) -> None:
    """``--virtual-stages`` against ``--schedule`` (the value given, before any default fills it in).

    Raises:
        ValueError: one line naming the value, the limit (>= 2 chunks per stage under interleaved) and the fix.
    """
    v, sched = ns.virtual_stages, getattr(ns, "schedule", None)
    if v is None:
        return
    if v < 1:
        raise ValueError(f"--virtual-stages {v}: interleaved 1F1B needs >= 2 chunks per stage (1: not "
                         "interleaved); use --virtual-stages 2 or more, or leave it out")
    if v == 1 and sched == "Interleaved1F1B":
        raise ValueError("--virtual-stages 1 with --schedule Interleaved1F1B: interleaved needs >= 2 chunks per "
                         "stage; use --virtual-stages 2 or more, or --schedule 1F1B")
    if v > 1 and sched not in (None, "Interleaved1F1B"):
        raise ValueError(f"--virtual-stages {v} needs --schedule Interleaved1F1B (or interleaved), got --schedule "
                         f"{sched}; use --schedule interleaved or drop --virtual-stages")


def load_shape(text: str):
    """A GPTShape from ``gpt:...`` or a YAML file of GPTShape's fields.

    Raises:
        ValueError: an unreadable file or a bad description (the message names it)."""
    from whale.planner.gpt import GPTShape, parse_gpt

    if text.startswith("gpt:"):
        return parse_gpt(text)
    import yaml  # CLI start-up: only for a YAML description

    try:
        data = yaml.safe_load(Path(text).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--model-desc {text!r}: not 'gpt:...' and not a readable YAML file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model-desc {text!r}: the YAML must be a mapping of layers, hidden, heads, ...")
    data.pop("kind", None)
    return GPTShape(**data)


def _pool(ns: argparse.Namespace):
    from whale.cluster import CATALOG, ClusterSpec
    from whale.planner.steptime.estimate import DevicePool, pool_from_cluster

    if ns.cluster:
        return pool_from_cluster(ClusterSpec.from_yaml(ns.cluster), "bf16")
    if ns.device not in CATALOG:
        raise ValueError(f"--device {ns.device!r} is not in the catalog; choose one of {sorted(CATALOG)}")
    d = CATALOG[ns.device]
    return DevicePool((d,), (ns.world,), (d.memory_bytes,), (2e12 / 8,), ns.gpus_per_node, ns.intra_bandwidth,
                      ns.inter_bandwidth, 1e-5, (), "bf16", ())


def describe_run(ns: argparse.Namespace, simulate: bool) -> dict:
    """Plan (and with ``simulate`` predict) the described model; a dict of the chosen plan and its prediction.

    Raises:
        ValueError: a bad description, degree or cluster; NoFeasiblePlanError: nothing fits."""
    from whale.planner.legality import check_split, check_virtual
    from whale.planner.memory import MemoryOptions
    from whale.planner.roofline import Roofline
    from whale.planner.search import Constraints
    from whale.planner.transformer_estimate import TransformerEstimator
    from whale.planner.transformer_search import transformer_search

    check_virtual_flags(ns)
    ns = argparse.Namespace(**vars(ns))
    for k, default in DESC_DEFAULTS.items():
        if getattr(ns, k, None) is None:
            setattr(ns, k, default)
    shape, pool = load_shape(ns.model_desc), _pool(ns)
    if ns.split:
        check_split(shape, ns.split, pool.devices_per_node, ns.cross_nodes)
    batch = ns.batch or pool.size
    roofs = tuple(Roofline.of(t, ns.gemm_efficiency) for t in pool.types)
    est = TransformerEstimator(shape, pool, batch, roofs, cross_nodes=ns.cross_nodes)
    micro = ns.micro_batches if ns.micro_batches and ns.micro_batches > 1 else None
    v, sched = ns.virtual_stages, getattr(ns, "schedule", None)  # whale plan's --schedule (None: searched)
    if v is not None and v > 1:
        sched = sched or "Interleaved1F1B"
        if ns.pp:  # forced stages x chunks checked up front (micro-batches too when forced, else searched)
            check_virtual(shape.layers, ns.pp, v, micro or ns.pp)
    forbid = ("zero3", "offload", "offload_params")
    cons = Constraints(stages=ns.pp, split=ns.split, data_parallel=ns.dp, num_micro_batch=micro, schedule=sched,
                       floor=MemoryOptions(activation_checkpoint=ns.recompute), forbid=forbid, stage_order="memory")
    sp = None if ns.sequence_parallel is None else ns.sequence_parallel == "on"
    res = transformer_search(est, cons, virtual=v, sequence_parallel=sp, split_interleaved=v is not None and v > 1)
    best, e = res.best.candidate, res.best.estimate
    out = {"model": shape.describe(), "parameters": shape.params, "devices": pool.size, "batch": batch,
           "plan": best.describe(), "step_seconds": e.step_seconds, "fits": bool(e.fits),
           "tflops_per_device": shape.iteration_flops(batch) / e.step_seconds / pool.size / 1e12,
           "peak_bytes_per_device": max(e.peak_bytes), "capacity_bytes": max(e.capacity),
           "search": res.stats, "runner_ups": [r.candidate.describe() for r in res.runner_ups]}
    if simulate:
        out |= {k: e.detail[k] for k in ("pipeline_seconds", "post_seconds", "p2p_seconds")}
        out["stage_forward_seconds"] = list(e.detail["stage_forward_seconds"])
        out["stage_backward_seconds"] = list(e.detail["stage_backward_seconds"])
        out["stage_peak_bytes"] = list(e.peak_bytes)
    return out


def run_desc(ns: argparse.Namespace, simulate: bool = False) -> int:
    """Print :func:`describe_run` (JSON with ``--json``); a bad input prints one line and returns 2."""
    from whale.planner.balance import InfeasiblePlanError

    name = "simulate" if simulate else "plan"
    try:
        out = describe_run(ns, simulate)
    except (ValueError, TypeError, InfeasiblePlanError) as exc:
        print(f"whale {name}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(out, indent=2, default=float))
    else:
        print(f"{out['model']}: {out['parameters'] / 1e9:.4g}B parameters on {out['devices']} devices, batch "
              f"{out['batch']}\nplan: {out['plan']}\npredicted step {out['step_seconds']:.4g} s, "
              f"{out['tflops_per_device']:.1f} TFLOP/s per device, peak {out['peak_bytes_per_device'] / 1e9:.1f} GB "
              f"of {out['capacity_bytes'] / 1e9:.0f} GB per device")
        if simulate:
            print(f"pipeline {out['pipeline_seconds']:.4g} s + after the pipeline {out['post_seconds']:.4g} s; "
                  f"stage 0 forward/backward per micro-batch {out['stage_forward_seconds'][0]:.4g} / "
                  f"{out['stage_backward_seconds'][0]:.4g} s (from the step-time model, no timing run)")
    if ns.out:
        Path(ns.out).write_text(json.dumps(out, indent=2, default=float) + "\n")
    return 0
