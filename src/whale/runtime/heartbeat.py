"""Per-rank heartbeats: the step and phase each rank is in, so that a launcher can name a hung rank.

The engine calls :func:`beat` at each phase of a step ("forward micro-batch 3", "gradient sync", "optimizer",
"checkpoint save", ...; an assignment, no I/O). Under ``whale launch`` (``WHALE_ERROR_DIR`` set) a daemon thread
started by ``wh.init`` (:func:`start`) writes this rank's state about once a second to
``$WHALE_ERROR_DIR/heartbeat-<attempt>-rank<R>.json``::

    {"rank": 1, "step": 12, "phase": "forward micro-batch 3", "since": <unix s of the phase change>,
     "beat": <unix s of this write>, "waiting": false, "where": "model.py:41 forward"}

``waiting`` says whether the main thread was, at that write, blocked in communication (:func:`in_communication`:
inside ``torch.distributed`` or on a ``.wait()`` of its work): a rank that is not waiting while its peers'
collectives time out is the one they were waiting for. ``beat`` stops advancing when the process is gone or holds
the GIL in a native call. :func:`read_all` (the launcher) loads every rank's latest state; :func:`laggard` picks
the rank that stopped making progress.
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import threading
import time
from pathlib import Path

INTERVAL_S = 1.0
"""Seconds between two writes of a rank's heartbeat file."""

_STATE = {"step": 0, "phase": "starting", "since": time.time()}
_THREAD: list[threading.Thread] = []
_STOP = threading.Event()


def beat(phase: str, step: int | None = None) -> None:
    """Record that this rank entered ``phase`` (of step ``step``, counted from 1; ``None``: the current step).
    Cheap (no I/O): the heartbeat thread writes it."""
    if step is not None:
        _STATE["step"] = step
    _STATE["phase"] = phase
    _STATE["since"] = time.time()


def current() -> tuple[int, str]:
    """``(step, phase)`` this rank last recorded with :func:`beat`."""
    return _STATE["step"], _STATE["phase"]


def _where(frame) -> tuple[bool, str]:
    """``(waiting in communication, "file:line function")`` for the innermost frame of a thread."""
    if frame is None:
        return False, ""
    code = frame.f_code
    where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"
    return in_communication(code.co_filename, _segment(frame)), where


def _segment(frame) -> str:
    """The source text of the expression the frame is executing (Python >= 3.11 positions), or ''."""
    try:
        pos = list(frame.f_code.co_positions())[frame.f_lasti // 2]
        line = linecache.getline(frame.f_code.co_filename, pos[0])
        return line[pos[2]:pos[3]] if pos[0] == pos[1] and pos[2] is not None else ""
    except (IndexError, TypeError, ValueError):
        return ""


def in_communication(filename: str, segment: str) -> bool:
    """True when code in ``filename`` executing the expression ``segment`` is communication: a function of
    ``torch.distributed`` (collectives, point-to-point, the store), or a ``.wait()`` (on a collective's work)."""
    path = filename.replace(os.sep, "/")
    return "/torch/distributed/" in path or segment.rstrip().endswith(".wait()")


def _path(folder: str, rank: int) -> Path:
    return Path(folder, f"heartbeat-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-rank{rank}.json")


def _write(path: Path, rank: int, main_ident: int) -> None:
    """Write this rank's heartbeat (complete, then renamed into place)."""
    waiting, where = _where(sys._current_frames().get(main_ident))
    state = dict(_STATE, rank=rank, beat=time.time(), waiting=waiting, where=where)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def start(rank: int) -> None:
    """Start this process's heartbeat thread (once) when ``WHALE_ERROR_DIR`` names a directory; else nothing."""
    folder = os.environ.get("WHALE_ERROR_DIR")
    if not folder or _THREAD:
        return
    path, main = _path(folder, rank), threading.main_thread().ident
    _STOP.clear()

    def run() -> None:
        """Write the heartbeat every :data:`INTERVAL_S` until :func:`stop`."""
        while True:
            try:
                _write(path, rank, main)
            except OSError:
                pass  # the launcher's directory is gone: nobody reads it
            if _STOP.wait(INTERVAL_S):
                return

    thread = threading.Thread(target=run, name="whale-heartbeat", daemon=True)
    thread.start()
    _THREAD.append(thread)


def stop() -> None:
    """Stop the heartbeat thread (``wh.init``'s teardown) and wait for it."""
    _STOP.set()
    for thread in _THREAD:
        thread.join(timeout=2 * INTERVAL_S)
    _THREAD.clear()


def read_all(folder: str | os.PathLike) -> dict[int, dict]:
    """Every rank's latest heartbeat in the error directory ``folder`` (of the latest attempt), by rank."""
    found: dict[tuple[int, int], dict] = {}
    for p in Path(folder).glob("heartbeat-*-rank*.json"):
        try:
            attempt = int(p.name.split("-")[1])
            state = json.loads(p.read_text())
            found[(attempt, int(state["rank"]))] = state
        except (OSError, ValueError, KeyError):
            continue
    latest = max((a for a, _ in found), default=0)
    return {r: s for (a, r), s in found.items() if a == latest}


def laggard(beats: dict[int, dict], among: set[int] | None = None) -> int | None:
    """The rank that stopped making progress: among ``among`` (default: all), those whose beat went stale (gone,
    or stuck in native code), else those not waiting in communication, else all; of them the one at the lowest
    step, then the one in its phase the longest. ``None`` without heartbeats."""
    ranks = [r for r in beats if among is None or r in among] or list(beats)
    if not ranks:
        return None
    newest = max(beats[r]["beat"] for r in beats)
    stale = [r for r in ranks if newest - beats[r]["beat"] > 2.5 * INTERVAL_S]
    busy = [r for r in ranks if not beats[r].get("waiting")]
    pick = stale or busy or ranks
    return min(pick, key=lambda r: (beats[r]["step"], beats[r]["since"]))


def describe(state: dict, now: float | None = None) -> str:
    """``step 12, forward micro-batch 3 (no progress for 9.8 s; at model.py:41 forward)``."""
    idle = (now or time.time()) - state["since"]
    where = f"; at {state['where']}" if state.get("where") else ""
    return f"step {state['step']}, {state['phase']} (no progress for {idle:.1f} s{where})"
