"""Checkpoints that load under any plan: ``torch.distributed.checkpoint`` (DCP) files of whole tensors keyed by
the unannotated model's FQNs, published atomically.

What a checkpoint holds (see :mod:`whale.runtime.fqn_state` for the keys, :mod:`whale.runtime.ckpt_store`
for the directory layout and the atomic save, :mod:`whale.runtime.ckpt_io` for who writes and hashes which
bytes): every parameter and buffer whole, once (split shards gathered over their group, each tensor written by
one of the ranks holding it, spread evenly over them, a weight tied across stages under each of its names);
the optimizer state per parameter whole under the parameter's canonical FQN (ZeRO slices assembled); the
optimizer's param-group hyperparameters by group index; the step; the user streams' RNG state of rank 0 (the
same on every rank, :mod:`whale.runtime.rng`); fp16's loss-scaler state; the user's ``extra`` (plain Python,
e.g. the data position and LR-scheduler ``state_dict()``); and the plan it was saved under.

Loading under another plan (other world size, stages, shard sizes, ZeRO) works because each rank reads the
whole tensors its new stage needs and cuts its own shard and ZeRO range from them; the lane shares of the saved
plan come back only when the rank layout is unchanged (they are a measured speed setting of that layout).
The per-lane dropout streams need no state: they are derived from the seed and the step.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from whale.plan.plan import Plan
from whale.runtime import ckpt_io
from whale.runtime import ckpt_store as store
from whale.runtime.ckpt_store import CheckpointError
from whale.runtime.fqn_state import (
    MODEL,
    StateMismatchError,
    load_whole_state,
    model_slots,
    whole_model_state,
    whole_optim_state,
)

__all__ = ["CheckpointError", "Restored", "save", "load", "gather_full_state", "read_model_state", "latest"]

latest = store.latest


@dataclass(frozen=True)
class Restored:
    """What :func:`load` brings back besides tensors: the ``step`` count, the user's ``extra``, the directory
    it was read from, and the ``lane_weights`` (``stage_lane_weights``) to resume with (the saved ones under an
    unchanged rank layout, else the current plan's)."""

    step: int
    extra: dict
    lane_weights: tuple[float, ...]
    stage_lane_weights: tuple[tuple[float, ...], ...] = ()
    loss_scale: dict | None = None  # fp16: the dynamic loss scaler's state (runtime/precision.py)
    path: str = ""


def _layout(plan: Plan) -> dict:
    """The rank layout and its devices: when both are unchanged, the saved lane shares are restored (another
    cluster spec keeps the new plan's shares)."""
    return {"world_size": plan.world_size, "num_replicas": plan.num_replicas,
            "stages": [(tg.kind, tg.device_count, tg.modules) for tg in plan.task_graphs],
            "stage_cuts": [(c.params, c.buffers) for c in plan.stage_cuts], "devices": list(plan.devices)}


def _meta(engine, step: int, extra: dict, loss_scale: dict | None) -> dict:
    rng = {"torch": torch.get_rng_state()}
    if engine.ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(engine.ctx.device)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    return {"step": step, "extra": extra, "rng": rng, "loss_scale": loss_scale, "param_groups": groups}


def save(path: str, engine, extra: dict, loss_scale: dict | None = None, keep: int = 2) -> str:
    """Save ``engine``'s state as checkpoint ``step-N`` under ``path`` (N: ``engine.steps_done``). Collective:
    every rank calls it. ``extra`` must be plain Python data (loads with ``weights_only=True``); ``keep``: how
    many complete checkpoints stay (older ones are removed once this one is published).

    Returns:
        The published directory, e.g. ``path/step-00000040``.

    Raises:
        CheckpointError: ``path`` is a file or lies under one, on every rank before any collective
            (:func:`whale.runtime.ckpt_store.check_root`).
    """
    store.check_root(path)

    step, plan, rank = engine.steps_done, engine.plan, engine.rank
    many = dist.is_initialized() and dist.get_world_size() > 1
    slots = model_slots(engine.module)
    state = whole_model_state(slots)  # collectives first, in the same order on every rank
    state.update(whole_optim_state(engine.optimizer, slots, plan, engine.zero))
    files = {}  # every lane keeps its whole tensors: DCP writes each once, spread over its holders (ckpt_io)
    if rank == 0:
        tmp = store.begin(path, step)
        files[store.META] = ckpt_io.write_meta(tmp / store.META, _meta(engine, step, extra, loss_scale))
    if many:
        dist.barrier()
    files.update(ckpt_io.save_state(state, store.tmp_dir(path, step), rank))
    files = ckpt_io.gather_entries(files)  # the writers' digests, on rank 0
    final = ""
    if rank == 0:
        info = {"format": ckpt_io.FORMAT, "world_size": plan.world_size, "plan": plan.to_json(), "files": files}
        final = os.fspath(store.publish(path, step, info, keep))
    if many:
        dist.barrier()
    return final or os.fspath(store.tmp_dir(path, step).with_name(store.step_name(step)))


def read_meta(ckpt, info: dict | None = None) -> dict:
    """``whale.pt`` of a checkpoint directory, read with ``weights_only=True``; with the manifest ``info`` of a
    checkpoint hashed by its writers, its bytes are checked against their digest as read (else the directory
    must have been verified).

    Raises:
        CheckpointError: the file is missing, truncated or corrupted, or does not unpickle as plain data (named).
    """
    f = ckpt / store.META
    source = io.BytesIO(ckpt_io.read_whole(f, info["files"][store.META])) \
        if info is not None and ckpt_io.hashed_by_writers(info) else f
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointError(f"checkpoint file {f} cannot be read as plain data ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); load an earlier step directory") from None


def load(path: str, engine) -> Restored:
    """Restore ``engine``'s parameters, optimizer state, RNG from the latest complete checkpoint under ``path``
    (or ``path`` itself when it is a step directory), whatever plan saved it. No collective: every rank reads
    what it needs, and checks what it reads against its writer's SHA-256 (:mod:`whale.runtime.ckpt_io`).

    Raises:
        CheckpointError: no complete checkpoint; a missing, truncated or corrupted file (named); a checkpoint of
            another model (missing tensors or other shapes) or an optimizer with another number of param groups.
    """
    ckpt = store.resolve(path)
    info = ckpt_io.read_manifest(ckpt)
    meta = read_meta(ckpt, info)
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {ckpt} has {len(saved_groups)} optimizer param group(s) but this "
                              f"optimizer has {len(engine.optimizer.param_groups)}; build the optimizer with the "
                              "groups it was trained with")
    try:
        load_whole_state(model_slots(engine.module), engine.optimizer, engine.plan,
                         lambda request: ckpt_io.read_tensors(ckpt, request, info), ckpt_io.saved_tensors(ckpt, info),
                         os.fspath(ckpt), engine.zero)
    except StateMismatchError as exc:
        raise CheckpointError(str(exc)) from None
    for group, hyper in zip(engine.optimizer.param_groups, saved_groups, strict=True):
        group.update(hyper)
    torch.set_rng_state(meta["rng"]["torch"])
    if "cuda" in meta["rng"] and engine.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(meta["rng"]["cuda"], engine.ctx.device)
    saved = Plan.from_json(info["plan"])
    same = _layout(saved) == _layout(engine.plan)
    plan = saved if same else engine.plan
    return Restored(int(meta["step"]), meta["extra"], plan.lane_weights, plan.stage_lane_weights,
                    meta.get("loss_scale"), os.fspath(ckpt))


def read_model_state(path: str) -> dict[str, torch.Tensor]:
    """The whole model's state dict (original FQNs, CPU tensors) from the latest complete checkpoint under
    ``path``, in this process alone: loads into the unannotated model with ``strict=True``.

    Raises:
        CheckpointError: no complete checkpoint, or a damaged file (named).
    """
    ckpt = store.resolve(path)
    store.read_manifest(ckpt)
    request = {k: torch.empty(s, dtype=d) for k, (s, d) in store.saved_tensors(ckpt).items() if k.startswith(MODEL)}
    store.read_tensors(ckpt, request)
    return {k[len(MODEL):]: v for k, v in request.items()}


def gather_full_state(module: nn.Module, plan: Plan, rank: int) -> dict:
    """The whole model's state dict on rank 0 (original names and full shapes, CPU tensors, loadable with
    ``load_state_dict(strict=True)`` into the unparallelized model); ``{}`` on other ranks. Collective.

    Each stage's lane 0 contributes its stage; split shards are first all-gathered over their group with the
    plan's (uneven) sizes (:func:`whale.runtime.fqn_state.whole_model_state`).
    """
    _, lane = plan.coords(rank)
    whole = whole_model_state(model_slots(module))
    mine = {k[len(MODEL):]: v for k, v in whole.items()} if lane == 0 else {}
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
