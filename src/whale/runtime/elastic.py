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

Re-expansion (a node joins): torchrun's agent restarts a healthy worker group when the rendezvous has nodes on
its wait list. Two settings make that work with the c10d backend (:func:`agent_env`, :func:`check_keep_alive`):
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with the shared store, an agent that was rank 0 of an earlier round reuses
its old bootstrap info and never publishes ``MASTER_ADDR`` for the new round, so the joining agent waits 60 s and
both fail), and ``keep_alive_max_attempt >= 3`` (an agent refreshes its heartbeat only about every 1-2 intervals; at
2 a live agent looks dead to a joining one, which then forms a rendezvous of its own). A job whose nodes cannot hold
the model waits for more (:func:`wait_for_nodes`) while fewer than the maximum are present.

Pure functions except :func:`gather_nodes` and :func:`resolve` (collective over the world group) and
:func:`wait_for_nodes` (sleeps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence

import torch.distributed as dist

from whale.cluster import ClusterError, ClusterSpec, NodeSpec

__all__ = ["NODE_ENV", "NNODES_ENV", "agent_env", "check_keep_alive", "nodes_short", "wait_for_nodes",
           "node_name", "present_cluster", "gather_nodes", "resolve", "membership", "change_note"]

NODE_ENV = "WHALE_NODE"
"""Environment variable naming the spec node this agent's workers run on (``whale launch --node-name NAME``)."""

NNODES_ENV = "WHALE_NNODES"
"""``MIN:MAX`` of an elastic ``whale launch --nnodes MIN:MAX`` (MIN < MAX), exported to the workers."""

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_keep_alive(rdzv_conf: str | None) -> None:
    """Refuse ``keep_alive_max_attempt < 3`` in ``--rdzv-conf`` (``"k=v,k=v"``): torchrun refreshes an agent's
    heartbeat only when it is at least ``keep_alive_interval`` old, on a timer of that period, so a live agent's
    heartbeat is up to ~2 intervals old; it expires after ``interval x max_attempt``.

    Raises:
        ValueError: naming the value, the limit and the fix.
    """
    conf = dict(kv.split("=", 1) for kv in (rdzv_conf or "").split(",") if "=" in kv)
    attempts = conf.get("keep_alive_max_attempt", "3")
    if attempts.isdigit() and int(attempts) < 3:
        raise ValueError(f"--rdzv-conf keep_alive_max_attempt={attempts}: an elastic job needs >= 3 (a live agent's "
                         f"heartbeat can be 2 keep_alive_interval old, so a joining node would drop it and "
                         f"rendezvous alone); use keep_alive_max_attempt=4")


def agent_env(nnodes, rdzv_backend: str | None, rdzv_conf: str | None, base=None) -> dict[str, str]:
    """What an elastic agent (``--rdzv-backend`` with ``--nnodes MIN:MAX``, MIN < MAX) adds to its environment:
    ``WHALE_NNODES=MIN:MAX`` for the workers and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless ``base``, default
    ``os.environ``, sets it) so that a re-expanded round publishes its master address. ``{}`` otherwise.

    Raises:
        ValueError: :func:`check_keep_alive`.
    """
    parts = str(nnodes or "").split(":")
    if rdzv_backend is None or len(parts) != 2 or parts[0] == parts[1]:
        return {}
    check_keep_alive(rdzv_conf)
    env = {NNODES_ENV: f"{parts[0]}:{parts[1]}"}
    if SHARE_STORE_ENV not in (os.environ if base is None else base):
        env[SHARE_STORE_ENV] = "1"
    return env


def nodes_short() -> tuple[int, int] | None:
    """``(nodes present, MAX)`` when this worker belongs to an elastic job with fewer than ``MAX`` nodes present
    (``WHALE_NNODES`` and torchrun's ``GROUP_WORLD_SIZE``), else ``None`` (no node can join)."""
    spec, present = os.environ.get(NNODES_ENV, ""), os.environ.get("GROUP_WORLD_SIZE", "")
    if ":" not in spec or not present.isdigit():
        return None
    high = int(spec.split(":")[1])
    return (int(present), high) if int(present) < high else None


def _waited_s(world: int) -> float:
    """Seconds this launcher's workers have already waited at this world size (a file in ``WHALE_ERROR_DIR``,
    which outlives the worker group's restarts; a new world restarts the clock). 0 without the folder."""
    folder = os.environ.get("WHALE_ERROR_DIR")
    if not folder:
        return 0.0
    path = os.path.join(folder, ".waiting-for-nodes.json")
    try:
        with open(path) as f:
            old = json.load(f)
        if old.get("world") == world:
            return max(0.0, time.time() - float(old["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"world": world, "since": time.time()}, f)
    os.replace(tmp, path)
    return 0.0


def wait_for_nodes(reason: str, timeout_s: float, rank: int, world: int, poll_s: float = 1.0) -> bool:
    """Keep this worker alive while an elastic job waits for a node to join: torchrun's agent sees the joining node
    on the rendezvous wait list and restarts the worker group (SIGTERM ends this wait) on the larger world.

    Args:
        reason: why the nodes present are not enough (the planner's error, naming the shortfall).
        timeout_s: seconds to wait in all, counted across the worker group's restarts at this world size.
        rank, world: this worker's global rank and the world size (rank 0 prints the waiting line).
        poll_s: seconds between two checks of the deadline.

    Returns:
        ``False`` at once when no node can join (not elastic, or the maximum is present) or ``timeout_s`` is 0;
        ``True`` when the deadline passed with no node joining (the caller exits non-zero with ``reason``).
    """
    short = nodes_short()
    if short is None or timeout_s <= 0:
        return False
    left = timeout_s - _waited_s(world)
    if rank == 0:
        print(f"elastic: waiting up to {max(left, 0):.0f} s for more nodes ({short[0]} of at most {short[1]} "
              f"present; the job re-plans when one joins): {reason}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + left
    while time.monotonic() < deadline:
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))
    return True


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
