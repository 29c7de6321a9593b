"""Zero-bubble backward split (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2): B computes the
gradients of a stage's inputs, W only those of its parameters, without walking the activation-gradient chain
twice.

The stage's autograd graph (from its outputs, or its loss, down to the received inputs and the parameters) has
two parts: the *chain*, every node on a path to an input (its gradients are what B must produce), and the
*branches* off it that lead only to parameters (``W.t()``, casts, the parameters' ``AccumulateGrad``). A chain
node with a branch child is a *frontier* node: ``AddmmBackward0`` of ``x @ W.t() + b``, whose input-gradient
matmul is B's work and whose weight-gradient matmul is W's. :func:`backward_input` runs B as
``torch.autograd.grad`` on the inputs, which computes no branch output, and keeps each frontier node's incoming
gradients (a node pre-hook). :func:`backward_weight` runs W from those kept gradients
(``torch.autograd.graph.GradientEdge`` roots): ``torch.autograd.backward(edges, kept, inputs=params)`` per
group of frontier nodes, which re-runs the frontier node for its branch outputs only and accumulates into
``.grad`` through the parameters' ``AccumulateGrad`` nodes, so post-accumulate-grad hooks (Whale's bucketed
gradient sync, :mod:`whale.parallel.data`) fire as in a plain backward.

In W every frontier node is pinned to its kept gradients (a node pre-hook that returns them): autograd runs
the gradient hooks of the node's output tensors (``t.register_hook``) again when it runs the node again, and
the pin undoes a second change of the gradient (their side effects, such as ``retain_grad``, do happen twice;
hooks on other chain nodes do not run in W). Groups: frontier nodes whose branches reach a common parameter (a
weight tied within the stage) run in one call; there the chain between them is walked again, and the pins keep
the walk's partial gradients from counting twice. Outputs that depend on no input (and every output of a
stage whose inputs need no gradient, such as stage 0) are W's own roots, with their output gradients. The math
is the plain backward's: the same nodes compute the same products from the same gradients; only the order in
which several contributions to one tied parameter are summed can differ.

Why not ``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight``, which
follow the same idea: a private module (its names and signatures may change in any release); its weight pass
uses ``torch.autograd.grad`` and adds to ``.grad`` itself, so parameters' post-accumulate-grad hooks do not run;
a parameter reaching the outputs without crossing the input chain gets no gradient (its sanity assert is
commented out, and torch's own ``PipelineStage`` runs a full backward on stage 0 for that reason); and it finds
the groups with one Python reverse-closure walk per parameter (parameters x nodes), where this module walks the
graph once.

A Python ``torch.autograd.Function`` on the frontier (one taking a weight, such as sequence parallelism's
``_GatherLinear``) computes what its ``ctx.needs_input_grad`` (set at forward time) asks for in both passes,
its collectives included (the same calls on every rank of its group, so they still match): correct, not
cheaper. A stage that holds hooks on the chain for its W pass (ZeRO-3's gather-before-backward on unit outputs) uses the
replay instead: W as ``torch.autograd.backward(outputs, output_grads, inputs=params)``, the whole chain again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Group:
    """One W call: roots (frontier nodes with kept gradients, or output edges) and the parameters they reach."""

    frontier: list = field(default_factory=list)  # [Node]
    roots: list = field(default_factory=list)  # [(GradientEdge, gradient)]: outputs that depend on no input
    params: dict = field(default_factory=dict)  # id(param) -> param


@dataclass
class WeightWork:
    """What :func:`backward_weight` needs, kept from :func:`backward_input`: the groups and each frontier node's
    kept incoming gradients (a tuple per node, one entry per node output, ``None`` where undefined)."""

    groups: list[_Group]
    kept: dict = field(default_factory=dict)  # Node -> tuple[Tensor | None, ...]


def _edge(t: torch.Tensor) -> GradientEdge:
    """The edge whose gradient is ``t``'s gradient (its ``grad_fn`` output, or its ``AccumulateGrad``)."""
    return torch.autograd.graph.get_gradient_edge(t)


def _walk(roots: list[Node]) -> tuple[list[Node], dict]:
    """Every node reachable from ``roots``, children before parents, and each node's ``next_functions``."""
    order, kids, seen = [], {}, set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        kids[root] = root.next_functions
        stack = [(root, iter(kids[root]))]
        while stack:
            node, it = stack[-1]
            for child, _ in it:
                if child is not None and child not in seen:
                    seen.add(child)
                    kids[child] = child.next_functions
                    stack.append((child, iter(kids[child])))
                    break
            else:
                stack.pop()
                order.append(node)
    return order, kids


def _leaf_id(node: Node) -> int | None:
    """``id`` of the tensor an ``AccumulateGrad`` node accumulates into; ``None`` for any other node."""
    return id(node.variable) if type(node).__name__ == "AccumulateGrad" else None


def _plan(edges: list[GradientEdge], grads: list[torch.Tensor], leaves: list[torch.Tensor],
          params: list[torch.Tensor]) -> list[_Group]:
    """Split the graph below ``edges`` into the W groups (module docstring): one walk, then per node whether it
    reaches an input (``chain``) and which parameters its branch reaches (``reach``, off the chain only)."""
    leaf_ids, by_id = {id(t) for t in leaves}, {id(p): p for p in params}
    order, kids = _walk([e.node for e in edges])
    chain: dict = {}
    reach: dict = {}
    for node in order:  # children first
        own = _leaf_id(node)
        chain[node] = own in leaf_ids or any(c is not None and chain[c] for c, _ in kids[node])
        if not chain[node]:
            below = [reach[c] for c, _ in kids[node] if c is not None and reach[c]]
            mine = {own} if own in by_id else set()
            reach[node] = mine.union(*below) if below else frozenset(mine)
    members = []  # (frontier node | root, parameter ids), parents first
    for node in reversed(order):
        if chain[node]:
            pids = set().union(*(reach.get(c, ()) for c, _ in kids[node] if c is not None and not chain[c]))
            if pids:
                members.append((node, pids))
    members += [((e, g), reach[e.node]) for e, g in zip(edges, grads, strict=True)
                if not chain[e.node] and reach[e.node]]
    return _grouped(members, by_id)


def _grouped(members: list[tuple], by_id: dict) -> list[_Group]:
    """Members (frontier nodes or root edges, with the parameter ids they reach) merged into groups sharing no
    parameter, in member order."""
    groups: list[_Group] = []
    owner: dict[int, _Group] = {}
    for member, pids in members:
        hit = list({id(g): g for p in pids if (g := owner.get(p)) is not None}.values())
        group = hit[0] if hit else _Group()
        if not hit:
            groups.append(group)
        for other in hit[1:]:
            group.frontier += other.frontier
            group.roots += other.roots
            group.params.update(other.params)
            groups.remove(other)
        (group.roots if isinstance(member, tuple) else group.frontier).append(member)
        group.params.update((p, by_id[p]) for p in pids)
        for p in group.params:
            owner[p] = group
    return groups


def backward_input(tensors: list[torch.Tensor], grads: list[torch.Tensor] | None, leaves: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[tuple, WeightWork]:
    """B: the gradients of ``leaves`` (the stage's received inputs) from ``tensors`` (its outputs, or its loss
    with ``grads=None``) and their gradients, graph kept; no parameter gradient is computed.

    Args:
        tensors: outputs that require grad (or ``[loss]``).
        grads: one gradient per tensor, same shape and dtype; ``None``: ones (a scalar loss).
        leaves: leaf tensors (requiring grad) whose gradients B returns.
        params: the parameters (requiring grad) whose gradients :func:`backward_weight` accumulates.

    Returns:
        Per leaf its gradient (``None`` where unused), and the work of the W pass.
    """
    grads = list(grads) if grads is not None else [torch.ones_like(t) for t in tensors]
    edges = [_edge(t) for t in tensors]
    groups = _plan(edges, grads, leaves, params) if leaves else [
        _Group(roots=list(zip(edges, grads, strict=True)), params={id(p): p for p in params})]
    work = WeightWork(groups)
    frontier = [n for g in groups for n in g.frontier]
    handles = [n.register_prehook(lambda got, n=n: work.kept.__setitem__(n, got)) for n in frontier]
    try:
        got = torch.autograd.grad(tensors, leaves, grads, retain_graph=True, allow_unused=True) if leaves else ()
    finally:
        for h in handles:
            h.remove()
    return got, work


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameters' gradients into ``.grad`` from what :func:`backward_input` kept, one
    ``torch.autograd.backward`` per group (module docstring); the graph is released with ``work``."""
    for group in work.groups:
        roots = [(GradientEdge(n, i), g) for n in group.frontier for i, g in enumerate(work.kept.get(n, ()))
                 if g is not None] + group.roots
        if not roots or not group.params:
            continue
        pins = [n.register_prehook(lambda _got, kept=work.kept[n]: kept) for n in group.frontier if n in work.kept]
        try:
            torch.autograd.backward([e for e, _ in roots], [g for _, g in roots], inputs=list(group.params.values()),
                                    retain_graph=True)
        finally:
            for h in pins:
                h.remove()
    work.groups.clear()
    work.kept.clear()
