"""A job's errors, each said once: one ``error: [rank R] Type: message`` line per failing rank, one traceback.

When the same mistake raises on every rank, each would print the same traceback (about 30 lines each); when one
rank raises, its peers fail in their next collective ("Connection closed by peer" once the failed rank's sockets
close, or after ``Config(timeout_s)`` when it hangs) with tracebacks that say nothing about the cause. Ctrl-C
stops every rank with a ``KeyboardInterrupt`` traceback. :func:`install` (called by ``wh.init`` on a rank of a
multi-rank job: under ``whale launch`` and ``torchrun`` alike) replaces ``sys.excepthook`` with
:func:`report_error`, which prints:

* the first rank to fail (recorded atomically, see :func:`record`): its full traceback, ending in its
  ``error: [rank R] Type: message`` line;
* every later failing rank: its one ``error:`` line, saying that its traceback is the first rank's (the same
  mistake on every rank) or naming the file that holds it;
* a rank stopped by a peer's failure (:func:`is_peer_failure`): one line saying so, naming the first failing rank
  when known;
* ``KeyboardInterrupt``: one short line for the whole job (the first rank interrupted), nothing on the others.

The exit code stays what Python gives an uncaught exception (1; a signal's for Ctrl-C). Under ``whale launch``
the record is a file in ``WHALE_ERROR_DIR`` (one directory per launch and machine, made by the launcher, which then
reads it to name the rank that failed first: :func:`first_failure`); under a plain ``torchrun`` it is a key in the
job's ``torch.distributed`` store. When neither is reachable every failing rank counts as first (a traceback too
many, never none).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import tempfile
import threading
import traceback as tb_mod
from pathlib import Path

import torch.distributed as dist

PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out",
                "timeout", "Socket Timeout", "connection refused")
"""Fragments of the messages torch.distributed raises when a peer is gone or silent."""

ERROR_DIR_ENV = "WHALE_ERROR_DIR"
"""Environment variable naming the launch's error directory (set by ``whale launch`` for its workers)."""


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a collective failing because another rank failed or stopped responding."""
    backend_error = getattr(dist, "DistBackendError", ())
    text = str(exc)
    return isinstance(exc, backend_error) or (isinstance(exc, RuntimeError) and any(f in text for f in PEER_FAILURE))


def _rank_world() -> tuple[int, int]:
    """This process's global rank and world size: the process group's, else torchrun's environment, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _attempt() -> str:
    """The torchrun attempt (0, or the elastic restart count): records of a failed attempt do not carry over."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _store_key(kind: str) -> str:
    return f"whale/{kind}/{_attempt()}"


def record(kind: str, text: str) -> str | None:
    """Record ``text`` as this job's (and attempt's) first ``kind`` ("failure" or "interrupt") unless one is
    recorded already; return the recorded one (``text`` itself when this rank came first), or ``None`` when no
    record can be kept (this rank then counts as first).

    Under ``whale launch``: the file ``$WHALE_ERROR_DIR/<kind>-<attempt>``, made complete then linked into place
    (atomic, exclusive); otherwise a compare-and-set in the default process group's store.
    """
    folder = os.environ.get(ERROR_DIR_ENV)
    try:
        if not folder:
            store = dist.distributed_c10d._get_default_store()
            return store.compare_set(_store_key(kind), "", text).decode()
        final = os.path.join(folder, f"{kind}-{_attempt()}")
        tmp = os.path.join(folder, f".{kind}-{os.getpid()}")
        Path(tmp).write_text(text)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return Path(final).read_text()
        finally:
            os.unlink(tmp)
        return text
    except Exception:  # noqa: BLE001 - no group, its store gone, an unwritable directory: no record
        return None


def recorded(kind: str) -> str | None:
    """The first ``kind`` recorded by :func:`record` in this job (and attempt), or ``None``."""
    folder = os.environ.get(ERROR_DIR_ENV)
    try:
        if folder:
            return Path(folder, f"{kind}-{_attempt()}").read_text()
        store, key = dist.distributed_c10d._get_default_store(), _store_key(kind)
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - nothing recorded, or nowhere to look
        return None


def _parse(text: str | None) -> tuple[int, str, str] | None:
    """``(rank, error line, traceback)`` of a record made by :func:`report_error`."""
    parts = (text or "").split("\n", 2)
    if len(parts) < 2 or not parts[0].strip().isdigit():
        return None
    return int(parts[0]), parts[1], parts[2] if len(parts) > 2 else ""


def first_failure(folder: str | os.PathLike) -> tuple[int, str] | None:
    """``(rank, error line)`` of the first failing rank recorded in the error directory ``folder`` (the latest
    torchrun attempt there), or ``None`` when no rank recorded a failure."""
    try:
        files = sorted(Path(folder).glob("failure-*"), key=lambda p: int(p.name.split("-")[1]))
        found = _parse(files[-1].read_text()) if files else None
    except (OSError, ValueError):
        return None
    return found[:2] if found else None


def error_line(exc: BaseException, rank: int | None = None) -> str:
    """``error: [rank R] Type: message`` (the message's first line; ``[...]`` marks more; no rank part when
    ``rank`` is ``None``, e.g. a one-process job)."""
    text = str(exc).strip()
    lines = text.splitlines()
    where = f"[rank {rank}] " if rank is not None else ""
    more = " [...]" if len(lines) > 1 else ""
    return f"error: {where}{type(exc).__name__}" + (f": {lines[0]}{more}" if lines else "")


def _peer_line(exc: BaseException, rank: int) -> str:
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())  # gloo's "[file.cc:553] " prefix
    first = text.splitlines()[0].split(". ")[0][:160] if text else type(exc).__name__
    known = _parse(recorded("failure"))
    who = f"rank {known[0]} failed first" if known else "another rank failed or stopped responding"
    return (f"error: [rank {rank}] stopped because {who} ({first}); the first failing rank's error is its own "
            "traceback")


def _traceback_text(exc: BaseException, head: str) -> str:
    """The full traceback (chained exceptions included), its closing ``Type: message`` prefixed by ``head``."""
    te = tb_mod.TracebackException.from_exception(exc)
    chunks, tail = list(te.format()), list(te.format_exception_only())
    if tail and chunks[-len(tail):] == tail:
        chunks = chunks[:-len(tail)]
    return "".join(chunks) + head + "".join(tail)


def _traceback_file(text: str, rank: int) -> str:
    """Write this rank's traceback to a file (the error directory, else the temp directory); return its path."""
    folder = os.environ.get(ERROR_DIR_ENV) or tempfile.gettempdir()
    path = os.path.join(folder, f"traceback-rank{rank}-{_attempt()}-{os.getpid()}.txt")
    try:
        Path(path).write_text(text)
    except OSError:
        return ""
    return path


_REPORTED: list[str] = []


def reported() -> bool:
    """True once this process reported an error or an interrupt (it is exiting on it)."""
    return bool(_REPORTED)


def report_error(exc: BaseException, *, traceback: bool = True, file=None) -> None:
    """Print ``exc`` the way a Whale job reports an error (module docstring), on this rank.

    Args:
        exc: the exception (with its ``__traceback__``).
        traceback: ``False`` for errors whose message is the whole story (bad configuration): the ``error:`` line
            alone on every rank, still recorded as the first failure for the launcher's summary.
        file: where to print (default ``sys.stderr``).
    """
    _REPORTED.append(type(exc).__name__)
    with _sigterm_deferred():
        _report(exc, traceback, file or sys.stderr)


@contextlib.contextmanager
def _sigterm_deferred():
    """Hold off SIGTERM (delivered on leaving) in the main thread: once a rank's error reached the launcher,
    torchrun terminates the others, which must not cut the first rank's traceback short."""
    main = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _report(exc: BaseException, traceback: bool, file) -> None:
    """:func:`report_error`'s work."""
    rank, world = _rank_world()
    if isinstance(exc, KeyboardInterrupt):
        mine = f"{rank}\nKeyboardInterrupt\n"
        if record("interrupt", mine) in (mine, None):
            print(f"interrupted (KeyboardInterrupt, first on rank {rank}): stopping", file=file, flush=True)
        return
    if world > 1 and is_peer_failure(exc):
        print(_peer_line(exc, rank), file=file, flush=True)
        return
    line = error_line(exc, rank if world > 1 else None)
    text = _traceback_text(exc, "") if traceback else ""
    mine = f"{rank}\n{line}\n{text}"
    first = _parse(record("failure", mine) or mine)
    if not traceback:
        print(line, file=file, flush=True)
    elif first[0] == rank:
        print(_traceback_text(exc, f"error: [rank {rank}] " if world > 1 else "error: "), end="", file=file,
              flush=True)
    elif first[2] == text:
        print(f"{line} (the same traceback as rank {first[0]}'s)", file=file, flush=True)
    else:
        path = _traceback_file(text, rank)
        print(line + (f" (traceback in {path})" if path else ""), file=file, flush=True)


def install(rank: int, world_size: int) -> None:
    """Make :func:`report_error` this process's ``sys.excepthook`` on a rank of a multi-rank job (idempotent;
    a one-process job keeps Python's own tracebacks). ``rank`` is unused (read when an error is reported) and
    kept for callers."""
    del rank
    if world_size <= 1 or getattr(sys.excepthook, "_whale", False):
        return

    def hook(kind, exc, tb):
        """Report an uncaught exception once (module docstring)."""
        if exc.__traceback__ is None:
            exc = exc.with_traceback(tb)
        report_error(exc)

    hook._whale = True
    sys.excepthook = hook
