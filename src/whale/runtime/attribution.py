"""Which rank ended a failed job, and where: ``whale launch``'s one summary line after torchrun's failure.

Read from what the ranks left in the launch's error directory (``WHALE_ERROR_DIR``) and from torchrun's exit codes,
never from error messages:

1. a genuine error recorded first (:func:`whale.runtime.failures.first_failure`): that rank, its exception type;
   its traceback was printed once, by it;
2. else a rank whose process ended on its own without any report (``kill -9``, a segfault, ``os._exit``): the
   earliest such, with its signal or exit code and its last heartbeat (step and phase);
3. else ranks that made no report while the others' collectives failed (torchrun terminated them after those
   exits: they were not waiting on anyone, so the others were waiting on them): the one that stopped making
   progress (:func:`whale.runtime.heartbeat.laggard`), with its step, phase and for how long it made none;
4. else (every failing rank's collective failed): the earliest of them, and the rank furthest behind.
"""

from __future__ import annotations

import os
import re
import signal
import time

from whale.runtime import failures, heartbeat

__all__ = ["summary", "exit_how"]


def exit_how(code: int | None) -> str:
    """How a process ended, for a launcher's line: ``"exit code 1"``, ``"killed by signal 9: SIGKILL"`` (a
    negative code: the signal), or ``"still running, killed"`` (``None``)."""
    if code is None:
        return "still running, killed"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {-code}: {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _job_code(e, rank: int) -> int:
    """The job's exit code: ``rank``'s, unless torchrun terminated it (SIGTERM) while another rank's code tells
    the failure (that one's)."""
    code = e.failures[rank].exitcode if rank in e.failures else 1
    if code == -signal.SIGTERM:
        others = [f.exitcode for f in e.failures.values() if f.exitcode != -signal.SIGTERM]
        code = others[0] if others else code
    return code


def _last_beat(beats: dict, rank: int) -> str:
    """Where a rank that ended was, from its last heartbeat (written at most a second before it ended)."""
    state = beats.get(rank)
    return f"; its last heartbeat: step {state['step']}, {state['phase']}" if state else ""


def summary(e, folder: str | os.PathLike | None) -> tuple[str, int]:
    """``(line, exit code)`` for torchrun's ``ChildFailedError`` ``e`` (the module docstring's rules); ``folder``
    is the launch's error directory (``None``: torchrun's earliest failure only)."""
    now = time.time()
    first = failures.first_failure(folder) if folder else None
    reps = failures.reports(folder) if folder else {}
    beats = heartbeat.read_all(folder) if folder else {}
    others = len(e.failures) - 1
    tail = f"; {others} other rank(s) failed or were stopped after it" if others else ""
    if first is not None and (first[0] in e.failures or not e.failures):
        kind = re.match(r"error: (?:\[rank \d+\] )?([\w.]+)", first[1])
        what = f" with {kind.group(1)}" if kind else ""
        code = _job_code(e, first[0])
        return (f"{e.name} FAILED: rank {first[0]} failed first ({exit_how(code)}){what}; its error is printed "
                f"above{tail}"), code
    silent = {r: f for r, f in e.failures.items() if r not in reps} if folder else {}
    died = [r for r, f in silent.items() if f.exitcode != -signal.SIGTERM]
    if died:
        rank = min(died, key=lambda r: (e.failures[r].timestamp, beats.get(r, {}).get("beat", now)))
        code = e.failures[rank].exitcode
        return (f"{e.name} FAILED: rank {rank} failed first ({exit_how(code)}) without reporting an error (its process "
                f"ended){_last_beat(beats, rank)}{tail}"), code
    peers = sorted((rep["time"], r, rep) for r, rep in reps.items() if rep.get("kind") == "peer")
    why = f"{peers[0][2]['type']}: {failures.short_message(peers[0][2]['message'])}" if peers else ""
    if silent and beats:
        rank = heartbeat.laggard(beats, set(silent)) if set(silent) & set(beats) else min(silent)
        where = heartbeat.describe(beats[rank], now) if rank in beats else "no heartbeat"
        return (f"{e.name} FAILED: rank {rank} stopped making progress at {where}; the other ranks' collectives "
                f"failed waiting for it ({why}){tail}"), _job_code(e, rank)
    if peers:
        rank = peers[0][1]
        behind = heartbeat.laggard(beats)
        far = f"; furthest behind: rank {behind}, {heartbeat.describe(beats[behind], now)}" if beats else ""
        return (f"{e.name} FAILED: rank {rank}'s collective failed first ({why}) and no rank reported an error of "
                f"its own{far}{tail}"), _job_code(e, rank)
    rank, failure = e.get_first_failure()
    return f"{e.name} FAILED: rank {rank} failed first ({exit_how(failure.exitcode)}){tail}", _job_code(e, rank)
