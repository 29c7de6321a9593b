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
