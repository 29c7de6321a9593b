"""Checkpoints: every rank saves its own shard; loading uses ``torch.load(weights_only=True)``.

Layout of a checkpoint directory::

    plan.json            the plan it was saved under (a different plan refuses to load, with the reason)
    rank00000.pt ...     per rank: model shard (original FQNs), optimizer, step, RNG states, user ``extra``
    model.pt             the consolidated full model state dict (written by rank 0) for inference/export

``extra`` must be plain Python data (numbers, strings, lists, dicts, tensors) so it loads with
``weights_only=True``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from whale.parallel.bridge import SplitRegion
from whale.parallel.split_state import gather_full_state as gather_region
from whale.plan.plan import Plan


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or was saved under a different plan."""


@dataclass(frozen=True)
class Restored:
    """What :func:`load` brings back besides tensors: the ``step`` count, the user's ``extra`` and the
    ``lane_weights`` (``stage_lane_weights`` for stages of different widths) the checkpoint ran with (a speed
    setting, not a layout: a re-balanced run resumes with them)."""

    step: int
    extra: dict
    lane_weights: tuple[float, ...]
    stage_lane_weights: tuple[tuple[float, ...], ...] = ()
    loss_scale: dict | None = None  # fp16: the dynamic loss scaler's state (runtime/precision.py)


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.pt")


def _holdings(plan: Plan) -> dict:
    """What must match for a checkpoint to load: the rank layout and who holds which tensors."""
    return {"world_size": plan.world_size, "num_replicas": plan.num_replicas,
            "num_micro_batch": plan.num_micro_batch,
            "stages": [(tg.kind, tg.device_count, tg.modules) for tg in plan.task_graphs],
            "stage_cuts": [(c.params, c.buffers) for c in plan.stage_cuts],
            "zero": (plan.zero, plan.zero_weights)}  # ZeRO: each rank's optimizer state is its own slice


def save(path: str, module: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, rank: int, step: int,
         extra: dict, loss_scale: dict | None = None) -> None:
    """Write this rank's shard (collective: every rank calls it; rank 0 also writes plan.json and model.pt);
    ``loss_scale``: fp16's scaler state, if any."""
    os.makedirs(path, exist_ok=True)
    state = {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "rng": {"torch": torch.get_rng_state()}, "extra": extra, "plan": plan.to_json()}
    if loss_scale is not None:
        state["loss_scale"] = loss_scale
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state()
    tmp = _rank_file(path, rank) + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, _rank_file(path, rank))
    full = gather_full_state(module, plan, rank)
    if rank == 0:
        torch.save(full, os.path.join(path, "model.pt"))
        with open(os.path.join(path, "plan.json"), "w") as f:
            f.write(plan.to_json(indent=2))
    if plan.world_size > 1:
        dist.barrier()


def load(path: str, module: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, rank: int) -> Restored:
    """Restore this rank's shard, optimizer and RNG.

    Raises:
        CheckpointError: the directory has no shard for this rank, or it was saved under another plan.
    """
    f = _rank_file(path, rank)
    if not os.path.exists(f):
        raise CheckpointError(f"no checkpoint shard {f}: was {path!r} saved with {plan.world_size} ranks?")
    state = torch.load(f, map_location="cpu", weights_only=True)
    try:
        saved = Plan.from_json(state["plan"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path!r} holds a plan this Whale version cannot read ({exc}); it was "
                              "saved by another version") from None
    before, now = _holdings(saved), _holdings(plan)
    if before != now:
        diff = [k for k in now if before.get(k) != now[k]]
        raise CheckpointError(f"checkpoint {path!r} was saved under a different plan (differs in {diff}); "
                              "resume with the same world size, annotations and micro-batches")
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return Restored(int(state.get("step", 0)), state["extra"], saved.lane_weights, saved.stage_lane_weights,
                    state.get("loss_scale"))


def _full_stage_state(module: nn.Module) -> dict:
    """This stage's state dict with every split region's shards gathered whole under the original names
    (``head.sharded.weight`` [size_r, d] -> ``head.weight`` [C, d]), CPU tensors. Collective over each
    region's split group (every rank of the group calls it; regions and tensors in module order)."""
    whole: dict[str, tuple[str, torch.Tensor]] = {}  # state key -> (original name, whole tensor)
    done: dict[int, torch.Tensor] = {}  # a weight tied across regions is gathered once
    for prefix, region in module.named_modules():
        if isinstance(region, SplitRegion):
            for name, t in gather_region(region.sharded, region.group, done).items():
                key, orig = (f"{prefix}.sharded.{name}", f"{prefix}.{name}") if prefix else (f"sharded.{name}", name)
                whole[key] = (orig, t)
    out = {}
    for key, t in module.state_dict().items():
        key, t = whole.get(key, (key, t))
        out[key] = t.detach().cpu()
    return out


def gather_full_state(module: nn.Module, plan: Plan, rank: int) -> dict:
    """The whole model's state dict on rank 0 (original names and full shapes, CPU tensors, loadable with
    ``load_state_dict(strict=True)`` into the unparallelized model); ``{}`` on other ranks. Collective.

    Each stage's lane 0 contributes its stage; split shards are first all-gathered over their group with the
    plan's (uneven) sizes, in replica 0 only (nested replicas hold the same shards).
    """
    stage, lane = plan.coords(rank)
    mine = _full_stage_state(module) if lane < plan.width_of(stage) else {}
    if lane != 0:
        mine = {}
    if plan.world_size == 1:
        return mine
    parts = [None] * plan.world_size if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return {}
    full: dict = {}
    for part in parts:
        full.update(part)
    return full
