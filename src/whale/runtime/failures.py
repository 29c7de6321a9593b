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
* a rank stopped by a peer's failure: one line saying so, naming the first failing rank. Whether an exception
  is a peer's doing is decided by what the ranks know, never by its message: it is a communication error
  (:func:`is_communication_error`: raised inside ``torch.distributed`` or by a ``.wait()`` on a collective's work)
  raised while another rank's failure is recorded. A communication error with no record (a peer killed, or hung
  until the collective timed out) prints its one line and says so; ``whale launch`` then names the rank from
  the ranks' exits and heartbeats (:mod:`whale.runtime.heartbeat`);
* ``KeyboardInterrupt``: one short line for the whole job (the first rank interrupted), nothing on the others.

The exit code stays what Python gives an uncaught exception (1; a signal's for Ctrl-C). Under ``whale launch``
the record is a file in ``WHALE_ERROR_DIR`` (one directory per launch and machine, made by the launcher, which then
reads it to name the rank that failed first: :func:`first_failure`); under a plain ``torchrun`` it is a key in the
job's ``torch.distributed`` store. When neither is reachable every failing rank counts as first (a traceback too
many, never none).
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback as tb_mod
from pathlib import Path

import torch.distributed as dist

from whale.runtime import heartbeat

ERROR_DIR_ENV = "WHALE_ERROR_DIR"
"""Environment variable naming the launch's error directory (set by ``whale launch`` for its workers)."""

PEER_WAIT_S = 0.5
"""Seconds a rank whose collective failed waits for a peer's failure record before it reports (the peer that
raised records it before its sockets close, so this only bounds a race)."""


def is_communication_error(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from or during) is a failed communication: a
    ``torch.distributed.DistError`` (backend, network, store errors), or a ``RuntimeError`` whose innermost
    traceback frame is inside ``torch.distributed`` (a collective, a point-to-point call, the store) or on a
    ``.wait()`` of a collective's work (Whale's asynchronous collectives). Decided by types and by where it was
    raised, never by the message: a data loader's "timed out" is no communication error."""
    dist_error = getattr(dist, "DistError", ())
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, dist_error) or (isinstance(exc, RuntimeError) and _raised_communicating(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _raised_communicating(exc: BaseException) -> bool:
    """Whether ``exc``'s innermost traceback entry is communication (:func:`heartbeat.in_communication`)."""
    frames = tb_mod.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not frames:
        return False
    last = frames[-1]
    line, col, end = last.line or "", getattr(last, "colno", None), getattr(last, "end_colno", None)
    same_line = getattr(last, "end_lineno", last.lineno) == last.lineno
    segment = line if col is None or not same_line else _source_line(last)[col:end]
    return heartbeat.in_communication(last.filename, segment)


def _source_line(frame: tb_mod.FrameSummary) -> str:
    """The raw (unstripped) source line of a traceback entry: the columns count from its start."""
    return linecache.getline(frame.filename, frame.lineno or 0).rstrip("\n")


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


def _parse(text: str | None) -> dict | None:
    """The failure record made by :func:`report_error` (``rank``, ``type``, ``message``, ``time``, ``line``,
    ``traceback``), or ``None``."""
    try:
        found = json.loads(text) if text else None
    except ValueError:
        return None
    return found if isinstance(found, dict) and isinstance(found.get("rank"), int) else None


def _latest(folder: str | os.PathLike, pattern: str) -> list[Path]:
    """The files ``<kind>-<attempt>[...]`` of the latest torchrun attempt in ``folder``."""
    files = [(int(p.name.split("-")[1].split(".")[0]), p) for p in Path(folder).glob(pattern)]
    latest = max((a for a, _ in files), default=None)
    return [p for a, p in files if a == latest]


def first_failure(folder: str | os.PathLike) -> tuple[int, str] | None:
    """``(rank, error line)`` of the first failing rank recorded in the error directory ``folder`` (the latest
    torchrun attempt there), or ``None`` when no rank recorded a failure (communication errors are no failure
    of their own: they are not recorded here)."""
    try:
        found = [_parse(p.read_text()) for p in _latest(folder, "failure-*")]
    except (OSError, ValueError):
        return None
    return (found[0]["rank"], found[0]["line"]) if found and found[0] else None


def reports(folder: str | os.PathLike) -> dict[int, dict]:
    """Every rank's own report in ``folder`` (latest attempt): ``{rank: {"kind": "error" | "peer" |
    "interrupt", "type", "message", "time"}}``; a rank that exited without reporting (killed, hung then
    terminated) has none."""
    out = {}
    for p in _latest(folder, "report-*-rank*.json"):
        try:
            rep = json.loads(p.read_text())
            out[int(rep["rank"])] = rep
        except (OSError, ValueError, KeyError):
            continue
    return out


def _report_file(rank: int, kind: str, exc: BaseException) -> None:
    """Write this rank's own report for the launcher (under ``whale launch`` only)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return
    rep = {"rank": rank, "kind": kind, "type": type(exc).__name__, "message": str(exc)[:500], "time": time.time()}
    with contextlib.suppress(OSError):
        Path(folder, f"report-{_attempt()}-rank{rank}.json").write_text(json.dumps(rep))


def error_line(exc: BaseException, rank: int | None = None) -> str:
    """``error: [rank R] Type: message`` (the message's first line; ``[...]`` marks more; no rank part when
    ``rank`` is ``None``, e.g. a one-process job)."""
    text = str(exc).strip()
    lines = text.splitlines()
    where = f"[rank {rank}] " if rank is not None else ""
    more = " [...]" if len(lines) > 1 else ""
    return f"error: {where}{type(exc).__name__}" + (f": {lines[0]}{more}" if lines else "")


def short_message(text: str) -> str:
    """A communication error's message without gloo's ``[file.cc:553]`` prefix: its first sentence, at most
    160 characters."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.strip())
    return text.splitlines()[0].split(". ")[0][:160] if text else ""


def _short(exc: BaseException) -> str:
    return short_message(str(exc)) or type(exc).__name__


def _wait_for_failure(timeout_s: float) -> dict | None:
    """The recorded first failure, polled for up to ``timeout_s`` (a peer that raised records it first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        known = _parse(recorded("failure"))
        if known is not None or time.monotonic() >= deadline:
            return known
        time.sleep(0.05)


def _peer_line(exc: BaseException, rank: int, known: dict | None) -> str:
    """One line for a rank whose collective failed: because of ``known`` (the recorded first failure), or, with
    none, because a peer died or stopped responding (the launcher names it); with this rank's step and phase."""
    step, phase = heartbeat.current()
    at = f" at step {step}, {phase}" if step else ""
    if known is not None:  # a configuration error (report_error(traceback=False)) is its one line, no traceback
        how = "once, as its own traceback" if known.get("traceback") else "by that rank, in one line"
        return (f"error: [rank {rank}] stopped{at} because rank {known['rank']} failed first with "
                f"{known['type']} ({_short(exc)}); its error is printed {how}")
    path = _traceback_file(_traceback_text(exc, ""), rank)
    where = f"; traceback in {path}" if path else ""
    return (f"error: [rank {rank}] {type(exc).__name__}: a collective failed{at} ({_short(exc)}) and no rank "
            f"reported an error: a peer died or stopped responding (the launcher names it){where}")


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
        _report_file(rank, "interrupt", exc)
        mine = json.dumps({"rank": rank, "type": "KeyboardInterrupt", "message": "", "time": time.time()})
        if record("interrupt", mine) in (mine, None):
            print(f"interrupted (KeyboardInterrupt, first on rank {rank}): stopping", file=file, flush=True)
        return
    if world > 1 and is_communication_error(exc):
        _report_file(rank, "peer", exc)
        print(_peer_line(exc, rank, _wait_for_failure(PEER_WAIT_S)), file=file, flush=True)
        return
    _report_file(rank, "error", exc)
    line = error_line(exc, rank if world > 1 else None)
    text = _traceback_text(exc, "") if traceback else ""
    mine = json.dumps({"rank": rank, "type": type(exc).__name__, "message": str(exc)[:500], "time": time.time(),
                       "line": line, "traceback": text})
    first = _parse(record("failure", mine)) or _parse(mine)
    if not traceback:
        print(line, file=file, flush=True)
    elif first["rank"] == rank:
        print(_traceback_text(exc, f"error: [rank {rank}] " if world > 1 else "error: "), end="", file=file,
              flush=True)
    elif first["traceback"] == text:
        print(f"{line} (the same traceback as rank {first['rank']}'s)", file=file, flush=True)
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
