"""Legal split (tensor-parallel) degrees of a transformer and of a cluster (issue 28, part 3).

A Megatron-LM tensor-parallel split cuts attention by heads (and key/value heads), the FFN by its width and
the embedding and LM head by vocabulary rows, so a degree t is legal only when it divides each of them
(Shoeybi et al. 2019; the runtime's split rules, :mod:`whale.splitrules`, cut the same dimensions evenly).
A split group all-reduces in every layer, so it stays inside one node unless the caller allows crossing nodes
(then the estimator costs it on the inter-node link).
"""

from __future__ import annotations

from whale.planner.gpt import GPTShape


def split_blockers(shape: GPTShape, t: int) -> list[str]:
    """The dimensions of ``shape`` that split degree ``t`` does not divide (empty: ``t`` is legal), each as
    ``"heads=160"``."""
    dims = {"heads": shape.heads, "kv_heads": shape.kv_heads, "hidden": shape.hidden, "ffn": shape.ffn,
            "vocab": shape.vocab}
    return [f"{k}={v}" for k, v in dims.items() if v % t]


def split_legal(shape: GPTShape, t: int, devices_per_node: int, cross_nodes: bool = False) -> bool:
    """True when ``t`` divides every split dimension and (unless ``cross_nodes``) the group fits one node:
    ``t <= devices_per_node`` and ``devices_per_node % t == 0`` (groups never straddle a node boundary)."""
    if t < 1 or split_blockers(shape, t):
        return False
    return cross_nodes or (t <= devices_per_node and devices_per_node % t == 0)


def legal_split_degrees(shape: GPTShape, devices: int, devices_per_node: int, cross_nodes: bool = False) -> list[int]:
    """Split degrees dividing ``devices`` that :func:`split_legal` accepts, ascending."""
    return [t for t in range(1, devices + 1) if devices % t == 0 and split_legal(shape, t, devices_per_node,
                                                                                   cross_nodes)]


def check_split(shape: GPTShape, t: int, devices_per_node: int, cross_nodes: bool = False) -> None:
    """Raise ValueError naming the dimension or the node size a forced split degree ``t`` breaks."""
    bad = split_blockers(shape, t)
    if bad:
        raise ValueError(f"split degree {t} does not divide {', '.join(bad)}; choose a common divisor "
                         f"(legal: the divisors of {shape.heads} that divide the other dimensions)")
    if not cross_nodes and (t > devices_per_node or devices_per_node % t):
        raise ValueError(f"split degree {t} spans nodes of {devices_per_node} devices; use a divisor of "
                         f"{devices_per_node} or allow split groups across nodes")


def virtual_blockers(layers: int, stages: int, virtual: int, micro_batches: int) -> list[str]:
    """Why ``virtual`` chunks per device of the interleaved 1F1B schedule do not fit a pipeline of ``stages``
    stages over ``layers`` transformer blocks with ``micro_batches`` micro-batches (empty: legal). Megatron-LM's
    rules (Narayanan et al. SC'21 §2.2; its ``--num-layers-per-virtual-pipeline-stage``): at least 2 stages and
    2 chunks, the blocks divided evenly into ``stages * virtual`` chunks, the micro-batches a multiple of
    ``stages`` (they go through the chunks in groups of p; :func:`whale.plan.schedule.interleaved_1f1b`)."""
    out = []
    if stages < 2 or virtual < 2:
        out.append(f"needs >= 2 stages and >= 2 chunks (got {stages} and {virtual})")
    elif stages * virtual > layers:
        out.append(f"{stages} stages x {virtual} chunks = {stages * virtual} chunks > layers={layers} (each chunk "
                   "holds >= 1 layer)")
    elif layers % (stages * virtual):
        out.append(f"layers={layers} is not a multiple of stages x virtual = {stages * virtual}")
    if stages >= 1 and micro_batches % stages:
        out.append(f"micro_batches={micro_batches} is not a multiple of stages={stages}")
    return out


def legal_virtual_stages(layers: int, stages: int, micro_batches: int) -> list[int]:
    """Chunk counts v >= 2 that :func:`virtual_blockers` accepts, ascending (empty with fewer than 2 stages)."""
    if stages < 2 or layers % stages:
        return []
    return [v for v in range(2, layers // stages + 1) if not virtual_blockers(layers, stages, v, micro_batches)]


def check_virtual(layers: int, stages: int, virtual: int, micro_batches: int) -> None:
    """Raise ValueError naming the rule a forced interleaved plan breaks and the legal chunk counts."""
    bad = virtual_blockers(layers, stages, virtual, micro_batches)
    if bad:
        raise ValueError(f"interleaved 1F1B with virtual={virtual}: {'; '.join(bad)}; legal chunk counts here: "
                         f"{legal_virtual_stages(layers, stages, micro_batches) or 'none'} (or use 1F1B)")


def sequence_parallel_legal(shape: GPTShape, t: int) -> bool:
    """Sequence parallelism (Korthikanti et al. 2022) shards the activations between split layers along the
    sequence: it needs a split degree t >= 2 that divides the sequence (the runtime refuses an indivisible one)."""
    return t >= 2 and shape.seq % t == 0


def schedule_legal(schedule: str, stages: int, micro_batches: int, split: int, virtual: int, layers: int,
                   split_interleaved: bool = False) -> bool:
    """Whether the runtime runs ``schedule`` (with ``virtual`` chunks) on this pipeline: 1F1B and GPipe always
    (virtual 1); ZB-H1 with >= 2 stages (virtual 1); interleaved 1F1B by :func:`virtual_blockers` and, since
    Whale's interleaved plans hold no split regions (:mod:`whale.plan.validation`), only at split 1 unless
    ``split_interleaved`` (Megatron-LM's runtime interleaves tensor-parallel stages; a what-if for Whale)."""
    if schedule == "Interleaved1F1B":
        return not virtual_blockers(layers, stages, virtual, micro_batches) and (split == 1 or split_interleaved)
    if virtual != 1:
        return False
    return schedule in ("1F1B", "GPipe") or (schedule == "ZB-H1" and stages >= 2)
