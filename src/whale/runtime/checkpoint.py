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
from whale.runtime import ckpt_io, ckpt_runs
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
    run: str = ""  # the run id of the loaded checkpoint (the engine adopts it: its next saves continue that run)


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
    many complete checkpoints of this run stay (the older ones by publish order are removed once this one is
    published; another run's are never touched). The manifest records the run (``engine.run_id``, made at the
    first save of a fresh engine), the job and the publish counter (:mod:`whale.runtime.ckpt_runs`).

    Returns:
        The published directory, e.g. ``path/step-00000040``.

    Raises:
        CheckpointError: on every rank: ``path`` is a file or lies under one, or is one ``step-N``
            checkpoint (before any collective); it holds another run's checkpoints (a fresh engine never prunes
            them: :func:`whale.runtime.ckpt_runs.claim_checkpoint_dir`); the disk is full or not writable (one
            line with the bytes needed and free, :func:`whale.runtime.ckpt_runs.disk_error`).
    """
    store.check_root(path)
    ckpt_runs.refuse_step_dir(path)

    step, plan, rank = engine.steps_done, engine.plan, engine.rank
    many = dist.is_initialized() and dist.get_world_size() > 1
    slots = model_slots(engine.module)
    state = whole_model_state(slots)  # collectives first, in the same order on every rank
    state.update(whole_optim_state(engine.optimizer, slots, plan, engine.zero))
    need = ckpt_runs.total_bytes(ckpt_runs.state_bytes(state), many)  # each key once, whoever holds it

    def begin() -> dict:
        """Rank 0: another run's directory refused, space checked, the temporary directory and whale.pt."""
        error, run, _ = ckpt_runs.decide_run(os.fspath(path), engine.run_id, overwrite=False)
        if error:
            raise CheckpointError(error)
        ckpt_runs.check_space(path, step, need)
        with ckpt_runs.disk_errors(path, step, need, rank):
            tmp = store.begin(path, step)
            meta = ckpt_io.write_meta(tmp / store.META, _meta(engine, step, extra, loss_scale))
        return {**run, "meta": meta}

    run = ckpt_runs.on_rank0(begin, rank, many, "starting the checkpoint save")
    files = {store.META: run.pop("meta")} if rank == 0 else {}
    engine.run_id = run["run"]
    with ckpt_runs.disk_errors(path, step, need, rank):  # every lane keeps its whole tensors: DCP writes each
        files.update(ckpt_io.save_state(state, store.tmp_dir(path, step), rank))  # once, spread (ckpt_io)
    files = ckpt_io.gather_entries(files)  # the writers' digests, on rank 0

    def finish() -> str:
        """Rank 0: the manifest, the rename, ``latest``, then the run's older checkpoints pruned."""
        info = {"format": ckpt_io.FORMAT, "world_size": plan.world_size, "plan": plan.to_json(), **run,
                "files": files}
        with ckpt_runs.disk_errors(path, step, need, rank):
            final = store.publish(path, step, info)
        ckpt_runs.prune(path, run["run"], keep, final)
        return os.fspath(final)

    return ckpt_runs.on_rank0(finish, rank, many, "publishing the checkpoint")


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
                              f"{str(exc)[:200]})") from None


def _read_checked(ckpt, engine) -> tuple[dict, dict]:
    """Checkpoint directory ``ckpt`` read into ``engine``'s parameters and optimizer state: ``(manifest, whale.pt
    contents)``. Each rank checks the sizes of all files and the SHA-256 of the bytes it reads.

    Raises:
        CheckpointError: a missing, truncated or corrupted file (named).
        NotThisModelError: a checkpoint of another model (missing tensors or other shapes) or an optimizer with
            another number of param groups.
    """
    info = ckpt_io.read_manifest(ckpt)
    meta = read_meta(ckpt, info)
    saved = len(meta["param_groups"])
    if saved != len(engine.optimizer.param_groups):
        raise store.NotThisModelError(
            f"checkpoint {ckpt} has {saved} optimizer param group(s) but this optimizer has "
            f"{len(engine.optimizer.param_groups)}; build the optimizer with the groups it was trained with")
    try:
        load_whole_state(model_slots(engine.module), engine.optimizer, engine.plan,
                         lambda request: ckpt_io.read_tensors(ckpt, request, info), ckpt_io.saved_tensors(ckpt, info),
                         os.fspath(ckpt), engine.zero)
    except StateMismatchError as exc:
        raise store.NotThisModelError(str(exc)) from None
    return info, meta


def load(path: str, engine) -> Restored:
    """Restore ``engine``'s parameters, optimizer state, RNG from the newest checkpoint under ``path`` that
    verifies (or ``path`` itself when it is a step directory), whatever plan saved it: a damaged newer one is
    skipped, said once on rank 0 (:func:`whale.runtime.ckpt_runs.load_first_intact`; the ranks agree on the
    one to load, a collective when there are several). Every rank reads what it needs and checks what it reads
    against its writer's SHA-256 (:mod:`whale.runtime.ckpt_io`), so a tensor found corrupted by any rank moves
    every rank to the previous checkpoint (each load overwrites the whole state, so a partial read is harmless).

    Raises:
        CheckpointError: no checkpoint verifies (each one's reason); a missing, truncated or corrupted file of a
            single step directory (named); a checkpoint of another model (missing tensors or other shapes) or an
            optimizer with another number of param groups (:class:`~whale.runtime.ckpt_store.NotThisModelError`, on
            every rank).
    """
    ckpt, (info, meta) = ckpt_runs.load_first_intact(path, lambda d: _read_checked(d, engine), engine.rank)
    for group, hyper in zip(engine.optimizer.param_groups, meta["param_groups"], strict=True):
        group.update(hyper)
    torch.set_rng_state(meta["rng"]["torch"])
    if "cuda" in meta["rng"] and engine.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(meta["rng"]["cuda"], engine.ctx.device)
    saved = Plan.from_json(info["plan"])
    same = _layout(saved) == _layout(engine.plan)
    plan = saved if same else engine.plan
    return Restored(int(meta["step"]), meta["extra"], plan.lane_weights, plan.stage_lane_weights,
                    meta.get("loss_scale"), os.fspath(ckpt), info.get("run", ckpt_runs.LEGACY))


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
