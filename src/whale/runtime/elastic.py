"""Elastic membership: which nodes of the cluster spec are present now, and what changed since the checkpoint.

Membership itself comes from torchrun's elastic agent with the c10d rendezvous (``whale launch --nnodes MIN:MAX
--rdzv-backend c10d ...``): when a node's agent dies or joins, torchrun restarts the worker group with a new
``WORLD_SIZE``. Each agent says which node of the spec it is by ``WHALE_NODE`` (``whale launch --node-name NAME``: a
node's ``name`` in the spec, or its index). At start-up every rank's node name is gathered (one all-gather);
torchrun numbers ranks agent by agent, so consecutive ranks with the same name form one present node, and the
job runs on the spec cut down to those nodes (:func:`present_cluster`). The planner then plans for that cluster
as it would for any other, and a checkpoint from the old plan reshards into the new one on load
(:mod:`whale.runtime.checkpoint`). :func:`membership` / :func:`change_note` record the nodes in a checkpoint's
``extra`` and say, after a restart, what changed ("world 4 -> 2: node b (2x P100-16GB) left; re-planned").

Pure functions except :func:`gather_nodes` and :func:`resolve` (collective over the world group).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Sequence

import torch.distributed as dist

from whale.cluster import ClusterError, ClusterSpec, NodeSpec

__all__ = ["NODE_ENV", "node_name", "present_cluster", "gather_nodes", "resolve", "membership", "change_note"]

NODE_ENV = "WHALE_NODE"
"""Environment variable naming the spec node this agent's workers run on (``whale launch --node-name NAME``)."""


def node_name(spec: ClusterSpec, index: int) -> str:
    """The name of ``spec.nodes[index]``: its ``name``, else its index as a string."""
    return spec.nodes[index].name or str(index)


def _find(spec: ClusterSpec, name: str) -> int:
    """Index of the node called ``name`` (or numbered ``name``). Raises ClusterError listing the names."""
    names = [node_name(spec, i) for i in range(len(spec.nodes))]
    if name in names:
        return names.index(name)
    if name.isdigit() and int(name) < len(spec.nodes) and spec.nodes[int(name)].name is None:
        return int(name)
    raise ClusterError(f"{NODE_ENV}={name!r} names no node of the cluster spec; its nodes are {', '.join(names)} "
                       f"(start each agent with whale launch --node-name NAME, one of those)")


def present_cluster(spec: ClusterSpec, rank_nodes: Sequence[str]) -> ClusterSpec:
    """The spec cut down to the nodes present, in rank order.

    Args:
        spec: the full cluster spec (every node the job may ever have).
        rank_nodes: the node name every rank reported (``WHALE_NODE``), indexed by global rank; ranks of one
            node are consecutive (torchrun numbers them agent by agent).

    Returns:
        A spec with one node per run of equal names, each the spec's node (all its devices), other fields kept.

    Raises:
        ClusterError: a rank gave no name or an unknown one, a node's ranks are not consecutive, or a node
            started a different number of workers than the devices it declares.
    """
    runs: list[tuple[str, int]] = []
    for r, name in enumerate(rank_nodes):
        if not name:
            raise ClusterError(f"rank {r} has no {NODE_ENV}: an elastic job needs every agent started with "
                               f"whale launch --node-name NAME (or {NODE_ENV}=NAME)")
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1)
        elif any(n == name for n, _ in runs):
            raise ClusterError(f"node {name!r} appears twice among the ranks {list(rank_nodes)}: two agents were "
                               f"started with {NODE_ENV}={name}; give each agent its own node")
        else:
            runs.append((name, 1))
    nodes: list[NodeSpec] = []
    for name, count in runs:
        node = spec.nodes[_find(spec, name)]
        if count != len(node.devices):
            raise ClusterError(f"node {name!r} declares {len(node.devices)} device(s) but {count} worker(s) run on "
                               f"it; start its agent with -n {len(node.devices)}")
        nodes.append(dataclasses.replace(node, name=name))
    return dataclasses.replace(spec, nodes=tuple(nodes))


def gather_nodes() -> list[str]:
    """Every rank's ``WHALE_NODE`` (``""`` when unset), by global rank. Collective over the world group."""
    mine = os.environ.get(NODE_ENV, "")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def resolve(cluster, world_size: int):
    """``cluster`` (a spec or YAML path, as in :class:`whale.Config`) cut to the nodes present when this rank has
    ``WHALE_NODE`` set; otherwise ``cluster`` unchanged. Collective when it cuts (every rank must call it).

    Raises:
        ClusterError: as :func:`present_cluster`, or the spec file does not load.
    """
    if cluster is None or not os.environ.get(NODE_ENV):
        return cluster
    spec = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec.from_yaml(os.fspath(cluster))
    names = gather_nodes()
    if len(names) != world_size:
        raise ClusterError(f"gathered {len(names)} node names for a world of {world_size}")
    return present_cluster(spec, names)


def _devices(node: NodeSpec) -> str:
    """``"2x V100-32GB"`` or ``"1x V100-32GB + 1x P100-16GB"``."""
    counts = Counter(d.name for d in node.devices)
    return " + ".join(f"{k}x {name}" for name, k in counts.items())


def membership(spec: ClusterSpec) -> dict:
    """The present nodes as plain data for a checkpoint's ``extra``: ``{"world": ranks, "nodes": [{"name",
    "devices"}]}`` (``devices`` as text, e.g. ``"2x P100-16GB"``)."""
    return {"world": spec.world_size,
            "nodes": [{"name": node_name(spec, i), "devices": _devices(n)} for i, n in enumerate(spec.nodes)]}


def change_note(before: dict | None, after: dict) -> str | None:
    """One line saying how membership changed between two :func:`membership` records, e.g. ``"world 4 -> 2: node
    b (2x P100-16GB) left; re-planned"``; ``None`` when ``before`` is missing or the nodes are the same."""
    if not before or [n["name"] for n in before["nodes"]] == [n["name"] for n in after["nodes"]]:
        return None
    old = {n["name"]: n["devices"] for n in before["nodes"]}
    new = {n["name"]: n["devices"] for n in after["nodes"]}
    parts = [f"node {k} ({v}) left" for k, v in old.items() if k not in new]
    parts += [f"node {k} ({v}) joined" for k, v in new.items() if k not in old]
    parts = parts or [f"nodes reordered {list(old)} -> {list(new)}"]
    return f"world {before['world']} -> {after['world']}: {', '.join(parts)}; re-planned"
