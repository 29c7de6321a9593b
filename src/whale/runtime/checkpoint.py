"""Checkpoints: every rank saves its own shard; loading uses ``torch.load(weights_only=True)``.

Layout of a checkpoint directory::

    plan.json            the plan it was saved under (a different plan refuses to load, with the reason)
    rank00000.pt ...     per rank: model shard (original FQNs), optimizer, step, RNG states, user ``extra``
    model.pt             the consolidated full model state dict (written by rank 0) for inference/export

``extra`` must be plain Python data (numbers, strings, lists, dicts, tensors) so it loads with
``weights_only=True``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from whale.runtime.engine import Engine


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or was saved under a different plan."""


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.pt")


def _layout(plan_json: str) -> dict:
    d = json.loads(plan_json)
    return {k: d[k] for k in ("world_size", "num_replicas", "num_micro_batch")} | {
        "stages": [(tg["kind"], tg["device_count"], tg["modules"]) for tg in d["task_graphs"]]
    }


def save(engine: Engine, path: str, extra: dict) -> None:
    """Write this rank's shard (collective: every rank calls it; rank 0 also writes plan.json and model.pt)."""
    os.makedirs(path, exist_ok=True)
    state = engine.state_dict()
    state["rng"] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state()
    state["extra"] = extra
    state["plan"] = engine.plan.to_json()
    tmp = _rank_file(path, engine.rank) + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, _rank_file(path, engine.rank))
    full = gather_full_state(engine)
    if engine.rank == 0:
        torch.save(full, os.path.join(path, "model.pt"))
        with open(os.path.join(path, "plan.json"), "w") as f:
            f.write(engine.plan.to_json(indent=2))
    if engine.world_size > 1:
        dist.barrier()


def load(engine: Engine, path: str) -> dict:
    """Restore this rank's shard, optimizer, step and RNG; returns ``extra``.

    Raises:
        CheckpointError: the directory has no shard for this rank, or it was saved under another plan.
    """
    f = _rank_file(path, engine.rank)
    if not os.path.exists(f):
        raise CheckpointError(f"no checkpoint shard {f}: was {path!r} saved with {engine.world_size} ranks?")
    state = torch.load(f, map_location="cpu", weights_only=True)
    saved, now = _layout(state["plan"]), _layout(engine.plan.to_json())
    if saved != now:
        diff = [k for k in now if saved.get(k) != now[k]]
        raise CheckpointError(f"checkpoint {path!r} was saved under a different plan (differs in {diff}); "
                              "resume with the same world size, annotations and micro-batches")
    engine.load_state_dict(state)
    # lane shares are a speed setting, not a layout: a re-balanced run resumes with the shares it had
    engine.plan.lane_weights = list(json.loads(state["plan"])["lane_weights"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return state["extra"]


def gather_full_state(engine: Engine) -> dict:
    """Merge the stage shards of lane 0 into one state dict on rank 0 (CPU tensors); ``{}`` on other ranks."""
    mine = {}
    if engine.lane == 0:
        mine = {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
    if engine.world_size == 1:
        return mine
    parts = [None] * engine.world_size if engine.rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if engine.rank != 0:
        return {}
    full: dict = {}
    for part in parts:
        full.update(part)
    return full
