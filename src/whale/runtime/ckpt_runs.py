"""Which checkpoints in a directory belong to which run: run identity, claiming a directory, pruning by publish
order, falling back to the newest checkpoint that verifies, and one-line disk errors (issue 24).

Every manifest (``step-N/whale.json``, :mod:`whale.runtime.ckpt_store`) carries ``run`` (the run's id, made once
by rank 0 at the run's first save or claim and broadcast; a resumed run adopts the id of the checkpoint it
loaded), ``job`` (:func:`job_key`: the same on every rank and across torchrun's restarts of one job, so a
restarted job can tell its own checkpoints from another job's) and ``published`` (a counter, one more than the
run's newest checkpoint: the publish order, independent of step numbers and clocks). Checkpoints written
before run ids existed count as one run, ``legacy``, older than any counted one.

Rules: a save refuses a directory holding another run's checkpoints (a fresh run never prunes, loads or resumes
them; :func:`claim_checkpoint_dir` with ``overwrite=True`` removes them first); pruning keeps the ``keep``
newest of the saving run by publish order and never the one just written or the one ``latest`` names; loading
a checkpoint directory tries the newest checkpoint of the newest run first and falls back to older ones of the
same run that verify, saying once on rank 0 which it skipped and why.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from whale.runtime import ckpt_store as store
from whale.runtime.ckpt_store import MARKER, CheckpointError, NotThisModelError

LEGACY = "legacy"
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NO_WRITE = {errno.EROFS: "the file system is read-only (EROFS)", errno.EACCES: "permission denied (EACCES)",
             errno.EPERM: "operation not permitted (EPERM)"}


def job_key() -> str | None:
    """This job's identity across torchrun restarts: ``WHALE_JOB_ID`` when set, else torchrun's
    ``TORCHELASTIC_RUN_ID`` (a fresh UUID per ``--standalone`` launch, the ``--rdzv-id`` otherwise; ``none``, the
    static rendezvous' default, identifies nothing); ``None`` outside torchrun."""
    key = os.environ.get("WHALE_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    return key if key and key != "none" else None


def restarted() -> bool:
    """Whether torchrun restarted this job after a failure (``TORCHELASTIC_RESTART_COUNT`` > 0)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


@dataclass(frozen=True)
class Entry:
    """One ``step-N`` directory: its manifest ``info`` (without verification) or, when that is missing or
    unreadable, ``None`` and the ``problem``."""

    step: int
    path: Path
    info: dict | None
    problem: str = ""

    @property
    def run(self) -> str:
        """The run this checkpoint is of (``LEGACY`` for one saved before run identities)."""
        return (self.info or {}).get("run", LEGACY)

    @property
    def order(self) -> tuple[int, int]:
        """Sort key of publish order: (publish counter, step); unpublished or legacy ones first."""
        return (self.info or {}).get("published", -1), self.step


def scan(root: str | os.PathLike) -> list[Entry]:
    """Every ``step-N`` directory under ``root``, newest first: by publish order; one without a readable manifest
    goes where its modification time puts it, first when ``latest`` names it."""
    root = Path(root)
    if not root.is_dir():
        return []
    good, bad = [], []
    for d in root.iterdir():
        m = store._STEP.match(d.name)
        if not m or not d.is_dir():
            continue
        try:
            good.append(Entry(int(m.group(1)), d, store.read_manifest(d, verify=False)))
        except CheckpointError:
            why = f"no manifest ({MARKER}): an incomplete or damaged save" if not (d / MARKER).exists() else \
                f"its manifest ({MARKER}) is unreadable"
            bad.append(Entry(int(m.group(1)), d, None, why))
    out = sorted(good, key=lambda e: e.order, reverse=True)
    pointer = _pointer(root)
    for b in sorted(bad, key=_mtime):
        at = 0 if b.path.name == pointer else next((i for i, e in enumerate(out) if _mtime(e) < _mtime(b)), len(out))
        out.insert(at, b)
    return out


def _mtime(e: Entry) -> float:
    try:
        return e.path.stat().st_mtime
    except OSError:
        return 0.0


def _pointer(root: Path) -> str:
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return ""


def newest(root: str | os.PathLike) -> Entry | None:
    """The newest ``step-N`` of ``root`` with a readable manifest (its ``info`` has ``run``, ``job``, ``step``), or
    ``None``: e.g. ``newest(d).info.get("job") == job_key()`` tells a restarted job that ``d`` holds its own run."""
    return next((e for e in scan(root) if e.info is not None), None)


def refuse_step_dir(path: str | os.PathLike) -> None:
    """Refuse to save into one checkpoint (a ``step-N`` directory or one with a manifest): new checkpoints would
    be nested inside it.

    Raises:
        CheckpointError: naming the parent directory to pass instead.
    """
    p = Path(path)
    if store._STEP.match(p.name) or (p / MARKER).is_file():
        raise CheckpointError(f"checkpoint directory {os.fspath(path)!r} is one checkpoint (a step-N directory): "
                              f"saving there would nest new checkpoints inside it; pass its parent "
                              f"{os.fspath(p.parent)!r}, which holds the run's checkpoints and 'latest'")


def _others(root: Path, run: str | None) -> list[Entry]:
    return [e for e in scan(root) if e.info is not None and e.run != run]


def _steps(entries: list[Entry]) -> str:
    steps = sorted(e.step for e in entries)
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def decide_run(path: str, run: str | None, overwrite: bool) -> tuple[str | None, dict, str]:
    """Rank 0: ``(error, run info, note)`` for a save or claim into ``path`` by ``run`` (``None``: a fresh run):
    the error line when ``path`` holds another run's checkpoints (unless ``overwrite``, which removes them, said
    in the note); the info ``{"run", "job", "published", "time"}`` for the manifest."""
    root = Path(path)
    others = _others(root, run)
    note = ""
    if others and not overwrite:
        names = sorted({e.run for e in others})
        return (f"checkpoint directory {path!r} holds the checkpoints of another run ({', '.join(names)}: "
                f"{_steps(others)}); a new run never prunes or continues them: resume that run (load_checkpoint; "
                "--resume in the example jobs), start afresh with overwrite=True (--overwrite), which removes "
                "them, or pass another directory"), {}, ""
    if others:
        for e in others:
            shutil.rmtree(e.path, ignore_errors=True)
        note = (f"{path}: removed {len(others)} checkpoint(s) of run(s) {', '.join(sorted({e.run for e in others}))}"
                f" ({_steps(others)}) to start afresh")
        if not (root / _pointer(root) / MARKER).is_file():
            (root / "latest").unlink(missing_ok=True)
    run = run or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    mine = [e.order[0] for e in scan(root) if e.info is not None and e.run == run]
    info = {"run": run, "job": job_key(), "published": max(mine, default=-1) + 1, "time": time.time()}
    return None, info, note


def on_rank0(fn, rank: int, many: bool, what: str = ""):
    """Run ``fn()`` on rank 0 and give its result to every rank (broadcast), so that an error there (a refused
    directory, a full disk) stops every rank with the same line instead of leaving the others waiting.

    Raises:
        CheckpointError: on every rank, with rank 0's message (its own rank re-raises the original exception
            when it is not a ``CheckpointError``).
    """
    out, original = [None, None], None
    if rank == 0:
        try:
            out[0] = fn()
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            original = exc
            out[1] = str(exc) if isinstance(exc, CheckpointError) else \
                f"{what} failed on rank 0 ({type(exc).__name__}: {str(exc)[:300]})"
    if many:
        dist.broadcast_object_list(out, src=0)
    if original is not None and not isinstance(original, CheckpointError):
        raise original
    if out[1] is not None:
        raise CheckpointError(out[1])
    return out[0]


def claim_checkpoint_dir(engine, path: str | os.PathLike, overwrite: bool = False) -> str:
    """Make checkpoint directory ``path`` this engine's run's before training (collective: every rank calls it):
    a fresh engine gets a new run id; a directory holding another run's checkpoints is refused, or with
    ``overwrite`` those are removed. Returns a note for rank 0 to print (``""`` when there is nothing to say).

    Raises:
        CheckpointError: on every rank: ``path`` is a file or one checkpoint (``step-N``), or holds another
            run's checkpoints (without ``overwrite``).
    """
    store.check_root(path)
    refuse_step_dir(path)
    many = dist.is_initialized() and dist.get_world_size() > 1
    info, note = on_rank0(lambda: _claim(os.fspath(path), engine.run_id, overwrite), engine.rank, many,
                          "claiming the checkpoint directory")
    engine.run_id = info["run"]
    return note


def _claim(path: str, run: str | None, overwrite: bool) -> tuple[dict, str]:
    error, info, note = decide_run(path, run, overwrite)
    if error:
        raise CheckpointError(error)
    return info, note


def prune(root: str | os.PathLike, run: str, keep: int, just: Path) -> None:
    """Remove the checkpoints of ``run`` beyond the ``keep`` newest by publish order (rank 0, after publishing
    ``just``); never ``just``, the one ``latest`` names, or another run's; stale temporary copies go too."""
    root = Path(root)
    spare = {just.name, _pointer(root)}
    mine = [e for e in scan(root) if e.info is not None and e.run == run]
    for e in mine[keep:] if keep > 0 else []:
        if e.path.name not in spare:
            shutil.rmtree(e.path, ignore_errors=True)
    clean_stale(root)


def clean_stale(root: str | os.PathLike, keep: str = "") -> None:
    """Remove the temporary copies a killed or failed save left (``.tmp-step-N``, ``.tmp-old-step-N``), except
    the directory named ``keep``."""
    for stale in [*Path(root).glob(".tmp-step-*"), *Path(root).glob(".tmp-old-step-*")]:
        if stale.name != keep:
            shutil.rmtree(stale, ignore_errors=True)


def load_candidates(path: str | os.PathLike) -> tuple[list[Entry], str]:
    """What loading ``path`` tries, newest first, and the run they belong to: ``path`` alone when it is one
    checkpoint; else the newest run's checkpoints, with the unreadable ones (reported, never loaded).

    Raises:
        CheckpointError: ``path`` is a file, or holds no checkpoint at all (:func:`ckpt_store.resolve`'s line).
    """
    root = Path(path)
    store.check_root(root)
    if (root / MARKER).is_file():
        return [Entry(-1, root, store.read_manifest(root, verify=False))], ""
    entries = scan(root)
    first = next((e for e in entries if e.info is not None), None)
    if first is None and not entries:
        store.resolve(root)  # raises the line naming what is there
    run = first.run if first is not None else ""
    return [e for e in entries if e.info is None or e.run == run], run


def load_first_intact(path: str | os.PathLike, verify, rank: int):
    """``(directory, verify(directory))`` of the newest checkpoint under ``path`` that verifies on every rank
    (``verify`` raises :class:`CheckpointError` for a damaged one; collective when several ranks). Rank 0 prints
    once which newer ones it skipped and why.

    Raises:
        NotThisModelError: on every rank, when ``verify`` raised it on any (the checkpoint fits another model).
        CheckpointError: on every rank, when none verifies (each one's reason), or for a single step directory
            that does not.
    """
    many = dist.is_initialized() and dist.get_world_size() > 1
    candidates, run = load_candidates(path)
    skipped: list[tuple[str, str]] = []
    for e in candidates:
        if e.info is None:
            skipped.append((e.path.name, e.problem))
            continue
        result, err = None, None
        try:
            result = verify(e.path)
        except CheckpointError as exc:
            err = (str(exc), isinstance(exc, NotThisModelError))
        errs = [err]
        if many:
            errs = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
        wrong = next((x[0] for x in errs if x and x[1]), None)
        if wrong is not None:  # not damage: an older checkpoint of the same run would not fit either
            raise NotThisModelError(wrong)
        bad = next(((r, x[0]) for r, x in enumerate(errs) if x), None)
        if bad is None:
            if skipped and rank == 0:
                print(f"checkpoint: skipped {_reasons(skipped)}; loading {e.path.name}, the newest intact "
                      f"checkpoint of run {run} in {os.fspath(path)}", file=sys.stderr, flush=True)
            return e.path, result
        skipped.append((e.path.name, bad[1] + (f" (rank {bad[0]})" if many else "")))
    if len(candidates) == 1 and candidates[0].step == -1:
        raise CheckpointError(f"{skipped[0][1]}; pass the directory above it ({os.fspath(Path(path).parent)!r}) to "
                              "load the newest intact checkpoint there")
    raise CheckpointError(f"no checkpoint in {os.fspath(path)!r} verifies: {_reasons(skipped)}; restore the "
                          "damaged files or start afresh")


def _reasons(skipped: list[tuple[str, str]]) -> str:
    return "; ".join(f"{name} ({why})" for name, why in skipped)


def state_bytes(state: dict) -> dict[str, int]:
    """Bytes of each tensor of a (flat) state dict: ``{key: bytes}``, this rank's part of a checkpoint."""
    return {k: v.numel() * v.element_size() for k, v in state.items() if hasattr(v, "element_size")}


def total_bytes(mine: dict[str, int], many: bool) -> int:
    """Bytes of the data files of one checkpoint: every key of every rank's ``mine`` counted once (replicas hold
    the same keys; each is written by one of them, :mod:`whale.runtime.ckpt_io`). Collective when several ranks."""
    if not many:
        return sum(mine.values())
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return sum({k: v for part in out for k, v in part.items()}.values())


def _free(root: Path) -> int:
    where = next((q for q in (root, *root.parents) if q.exists()), Path("."))
    return shutil.disk_usage(where).free


def check_space(root: str | os.PathLike, step: int, need: int) -> None:
    """Refuse a save that cannot fit: ``need`` bytes against the free bytes of ``root``'s file system
    (``shutil.disk_usage``; checked when every rank runs on this machine, so that they share it).

    Raises:
        CheckpointError: the line :func:`disk_error` gives for a full disk.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) == world and _free(Path(root)) < need:
        raise CheckpointError(_space_line(Path(root), step, need))


def _space_line(root: Path, step: int, need: int) -> str:
    free = _free(root)
    return (f"cannot write checkpoint {store.step_name(step)} to {os.fspath(root)!r}: no space left on the device "
            f"(the checkpoint needs {need:,} bytes ({need / 2**30:.2f} GiB) and its file system has {free:,} bytes "
            f"({free / 2**30:.2f} GiB) free); free space there or save to another directory")


def _errnos(exc: BaseException | None, seen=None) -> set[int]:
    """The ``errno`` of every ``OSError`` in ``exc``'s chain and, for DCP's ``CheckpointException``, its ranks'."""
    seen = seen if seen is not None else set()
    if exc is None or id(exc) in seen:
        return set()
    seen.add(id(exc))
    out = {exc.errno} if isinstance(exc, OSError) and exc.errno else set()
    for wrapped in (getattr(exc, "failures", None) or {}).values():
        out |= _errnos(wrapped[0] if isinstance(wrapped, tuple) else wrapped, seen)
    return out | _errnos(exc.__cause__, seen) | _errnos(exc.__context__, seen)


def disk_error(exc: BaseException, root: str | os.PathLike, step: int, need: int) -> str | None:
    """One line for a save that failed because the disk is full (an ``ENOSPC``/``EDQUOT`` anywhere in ``exc``,
    or fewer free bytes than ``need`` now: torch.save's writer reports a full disk without an errno) or not
    writable (``EROFS``/``EACCES``/``EPERM``); ``None`` for any other failure."""
    root = Path(root)
    codes = _errnos(exc)
    if codes & _NO_SPACE or _free(root) < need:
        return _space_line(root, step, need)
    why = next((text for code, text in _NO_WRITE.items() if code in codes), None)
    if why:
        return (f"cannot write checkpoint {store.step_name(step)} to {os.fspath(root)!r}: {why}; pass a "
                "writable checkpoint directory")
    return None


class disk_errors:
    """Context for a save's writing phase: a full or read-only disk becomes one :class:`CheckpointError` line
    (:func:`disk_error`), on every rank that sees it, and rank 0 removes the unfinished ``.tmp-step-N``."""

    def __init__(self, root, step: int, need: int, rank: int) -> None:
        self.root, self.step, self.need, self.rank = root, step, need, rank

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
            return False
        line = disk_error(exc, self.root, self.step, self.need)
        if line is None:
            return False
        if self.rank == 0:
            shutil.rmtree(store.tmp_dir(self.root, self.step), ignore_errors=True)
        raise CheckpointError(line) from None
