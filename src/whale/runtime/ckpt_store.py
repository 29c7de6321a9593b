"""A checkpoint directory: atomic publication of DCP saves, a manifest, and finding the latest complete one.

Layout of ``ROOT`` (the path given to ``save_checkpoint``/``load_checkpoint``)::

    ROOT/latest               text: the name of the newest complete step directory (written last, os.replace)
    ROOT/step-00000040/       one complete checkpoint
        __0_0.distcp ...      torch.distributed.checkpoint data files (one per writing rank: every rank)
        .metadata             DCP's index of the tensors
        whale.pt              step, RNG, optimizer hyperparameters, user ``extra`` (rank 0; weights_only)
        whale.json            the completion marker, written after everything else: plan, step, world size,
                              and the byte size and SHA-256 of every other file (per tensor for the data
                              files), each computed by the rank that wrote it while writing
    ROOT/.tmp-step-00000050/  a save in progress (or killed): never read, removed by the next save

A save writes into ``.tmp-step-N``, then renames it to ``step-N`` (atomic on one file system) and then points
``latest`` at it, so a save killed at any moment leaves the previous checkpoint loadable. Loading checks every
file's size, and each rank the SHA-256 of the bytes it reads as it reads them (:mod:`whale.runtime.ckpt_io`;
:func:`read_manifest` verifies everything, for the CLI), so a truncated or corrupted file is reported by name
and DCP's pickled ``.metadata`` is only unpickled when it is the file that was written; tensors are read with
``weights_only=True``. Which run a checkpoint is of, pruning by publish order and the fallback from a damaged
checkpoint are :mod:`whale.runtime.ckpt_runs`'.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

MARKER, META = "whale.json", "whale.pt"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted, or does not fit this model."""


class NotThisModelError(CheckpointError):
    """A checkpoint that is intact but cannot be loaded here: another model or optimizer, or a format this
    version does not read (never a reason to fall back to an older checkpoint:
    :func:`whale.runtime.ckpt_runs.load_first_intact` raises it on every rank)."""


def step_name(step: int) -> str:
    """``step-00000042``: the directory of step ``step`` (sorted names sort by step)."""
    return f"step-{step:08d}"


def _sha256(path: Path, offset: int = 0, length: int | None = None) -> str:
    """SHA-256 (hex) of ``length`` bytes of ``path`` from ``offset`` (``None``: to the end), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = float("inf") if length is None else length
        while left > 0 and (block := f.read(int(min(left, 1 << 20)))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_root(path: str | os.PathLike) -> None:
    """Refuse a checkpoint path that is a file, or lies under one (every rank calls it before a save's first
    collective, so all of them stop with the same message; a load names what it found instead of "no checkpoint").

    Raises:
        CheckpointError: naming the path, the file in the way, what a checkpoint is (a directory) and the fix.
    """
    p = Path(path)
    blocker = next((q for q in (p, *p.parents) if q.exists()), None)
    if blocker is None or blocker.is_dir():
        return
    where = "is a file" if blocker == p else f"is under {os.fspath(blocker)!r}, which is a file"
    parent = os.fspath(p.parent) if p.name in (MARKER, META, "latest") or p.suffix == ".distcp" else ""
    fix = (f"pass its directory {parent!r}" if parent else
           "pass a directory path (a new one, or the directory an earlier save wrote), or move the file away")
    raise CheckpointError(f"checkpoint path {os.fspath(path)!r} {where}: a checkpoint is a directory (it holds "
                          f"step-N/ directories and 'latest', or is one step-N/ directory with {MARKER}); {fix}")


def begin(root: str | os.PathLike, step: int) -> Path:
    """Rank 0, before a save: an empty ``ROOT/.tmp-step-N`` (stale temporary copies removed: ``.tmp-step-*``
    and ``.tmp-old-step-*``)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".tmp-old-step-*")]:  # of a killed or failed save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{step_name(step)}"
    tmp.mkdir()
    return tmp


def tmp_dir(root: str | os.PathLike, step: int) -> Path:
    """The temporary directory :func:`begin` makes for ``step`` (other ranks write into it too)."""
    return Path(root) / f".tmp-{step_name(step)}"


def publish(root: str | os.PathLike, step: int, info: dict) -> Path:
    """Rank 0, after every rank's data is in the temporary directory: write the manifest (``info`` plus file
    sizes and hashes: ``info["files"]`` when the writers computed them, else each file is hashed here), rename
    the directory to ``step-N``, point ``latest`` at it (pruning is the caller's:
    :func:`whale.runtime.ckpt_runs.prune`). Returns the published directory."""
    root, tmp = Path(root), tmp_dir(root, step)
    files = info.get("files") or {  # the writers' digests (whale.runtime.ckpt_io), else hashed here
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    _fsync_write(tmp / MARKER, json.dumps({**info, "step": step, "files": files}, indent=1))
    final, trash = root / step_name(step), root / f".tmp-old-{step_name(step)}"
    if final.exists():  # the same step saved again (a resumed run): the new one replaces it
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)  # removed below; one a kill leaves is removed by the next save (begin)
    os.rename(tmp, final)
    _fsync_write(root / "latest", final.name + "\n")
    shutil.rmtree(trash, ignore_errors=True)
    return final


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (those with a manifest), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir() if (m := _STEP.match(d.name))]
    return sorted(s for s, d in found if (d / MARKER).is_file())


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``root``, or ``root`` itself when it is one; ``None`` when
    there is none. ``latest`` is followed when it names a complete one, else the newest published wins."""
    root = Path(root)
    if (root / MARKER).is_file():
        return root
    pointer = root / "latest"
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP.match(name) and (root / name / MARKER).is_file():
            return root / name
    def order(step: int) -> tuple[int, int]:
        """Publish order (``published`` of :mod:`whale.runtime.ckpt_runs`), then the step."""
        try:
            return json.loads((root / step_name(step) / MARKER).read_text()).get("published", -1), step
        except (OSError, ValueError):
            return -2, step
    steps = complete_steps(root)
    return root / step_name(max(steps, key=order)) if steps else None


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directory under ``root`` as a string, or ``None`` (see :func:`latest`):
    ``if whale.latest_checkpoint(dir): engine.load_checkpoint(dir)``.

    Raises:
        CheckpointError: ``root`` is a file or lies under one (:func:`check_root`).
    """
    check_root(root)
    found = latest(root)
    return os.fspath(found) if found is not None else None


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory to load from ``path`` (see :func:`latest`).

    Raises:
        CheckpointError: ``path`` is a file (:func:`check_root`), or nothing complete is there (naming what was
            found: old per-rank files, an unfinished save).
    """
    check_root(path)
    found = latest(path)
    if found is not None:
        return found
    root = Path(path)
    what = "does not exist" if not root.exists() else "holds no complete checkpoint"
    hint = ""
    if root.is_dir():
        names = sorted(p.name for p in root.iterdir())
        if any(n.startswith("rank") and n.endswith(".pt") for n in names):
            hint = (" (it holds per-rank rankNNNNN.pt files of the older Whale format, which is not read; "
                    "train again, or load them with the Whale version that wrote them)")
        elif any(n.startswith(".tmp-step-") for n in names):
            hint = " (only an unfinished save, .tmp-step-*, which is never loaded)"
    raise CheckpointError(f"checkpoint directory {os.fspath(path)!r} {what}{hint}; save one with "
                          "engine.save_checkpoint first")


def read_manifest(ckpt: Path, verify: bool = True) -> dict:
    """The manifest of checkpoint directory ``ckpt``; with ``verify``, every listed file is checked for its size
    and SHA-256 (:func:`verify_file`: all of it, in this process; a training load checks only what each rank
    reads, :mod:`whale.runtime.ckpt_io`).

    Raises:
        CheckpointError: an unreadable manifest, or a missing, truncated or corrupted file (named).
    """
    try:
        info = json.loads((ckpt / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest {ckpt / MARKER} is unreadable ({exc}): the checkpoint "
                              "is damaged") from None
    if not verify:
        return info
    for name, want in info.get("files", {}).items():
        verify_file(ckpt / name, want)
    return info


def check_size(f: Path, want: dict) -> None:
    """``f`` exists and has the manifest's ``want["bytes"]`` (a stat, no reading).

    Raises:
        CheckpointError: the file is missing, or truncated/altered (both sizes named).
    """
    if not f.is_file():
        raise CheckpointError(f"checkpoint file {f} is missing: the checkpoint is damaged")
    size = f.stat().st_size
    if size != want["bytes"]:
        raise CheckpointError(f"checkpoint file {f} is truncated or altered: {size} bytes, the manifest says "
                              f"{want['bytes']}")


def corrupted(f: Path, chunk: list | None = None, rank: int | None = None) -> CheckpointError:
    """The error for a file (or one ``[offset, length, sha256, key]`` chunk of it, written by ``rank``) whose
    SHA-256 differs from the manifest."""
    if chunk is None:
        return CheckpointError(f"checkpoint file {f} is corrupted (SHA-256 differs from the manifest)")
    off, length, _, key = chunk
    what = f"{key}, " if key else ""
    by = f", written by rank {rank}" if rank is not None else ""
    return CheckpointError(f"checkpoint file {f} is corrupted: bytes {off}-{off + length} ({what}{length} bytes"
                           f"{by}) differ from the manifest's SHA-256")


def verify_file(f: Path, want: dict) -> None:
    """Check one listed file whole: present, of its size, and its SHA-256 (``want["sha256"]``, or per chunk
    ``want["chunks"]`` as its writer hashed them while writing).

    Raises:
        CheckpointError: :func:`check_size`, or :func:`corrupted` naming the file (and the chunk).
    """
    check_size(f, want)
    if "chunks" not in want:
        if _sha256(f) != want["sha256"]:
            raise corrupted(f)
        return
    for chunk in want["chunks"]:
        if _sha256(f, chunk[0], chunk[1]) != chunk[2]:
            raise corrupted(f, chunk, want.get("rank"))


def saved_tensors(ckpt: Path) -> dict[str, tuple[tuple[int, ...], object]]:
    """Every tensor of the DCP checkpoint in ``ckpt``: key -> ``(shape, dtype)`` (read from DCP's metadata;
    verify the directory first with :func:`read_manifest`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(os.fspath(ckpt)).read_metadata()
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def read_tensors(ckpt: Path, request: dict) -> None:
    """Fill ``request`` (key -> preallocated tensor of the saved shape) from the DCP checkpoint in ``ckpt``,
    this process alone (no collective)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(request, storage_reader=dcp.FileSystemReader(os.fspath(ckpt)), no_dist=True)
