"""A worker's lifetime is bounded by its launcher's: when ``whale launch`` (or torchrun's agent) dies, even by
``kill -9``, its workers die too instead of training on, orphaned, into the checkpoint directory.

torchrun starts each worker as a child of its agent, which under ``whale launch`` runs in the launcher's own
process (``WHALE_LAUNCHER_PID``, set by :func:`whale.runtime.launch.launch`), from the main thread. A worker
asks the kernel for ``SIGKILL`` when that parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``); SIGKILL, not SIGTERM,
so that no handler of the user's can keep it alive (a save cut short is never loaded: checkpoints are published
atomically). Where ``prctl`` is unavailable a daemon thread polls the parent process id once a second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

LAUNCHER_PID_ENV = "WHALE_LAUNCHER_PID"
"""Environment variable with the process id of the worker's launcher (its parent)."""

_PR_SET_PDEATHSIG = 1
_ARMED: list[int] = []


def _prctl_deathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where it is unavailable or failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int) -> None:
    """Poll: kill this process once its parent is no longer ``parent``."""
    while os.getppid() == parent:
        threading.Event().wait(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_with_parent() -> int | None:
    """Make this process die when its launcher does (module docstring); returns the launcher's pid, or ``None``
    when not started by ``whale launch`` or torchrun (nothing to do). Idempotent. If the launcher is already gone
    (it died before this call), the process is killed at once."""
    if _ARMED:
        return _ARMED[0]
    if os.environ.get(LAUNCHER_PID_ENV):
        parent = int(os.environ[LAUNCHER_PID_ENV])
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        parent = os.getppid()  # torchrun's agent
    else:
        return None
    if os.getppid() != parent:
        if not _alive(parent):  # the launcher died before this call: this worker is an orphan already
            os.kill(os.getpid(), signal.SIGKILL)
        return None  # started through something else (a wrapper, a subprocess of a worker): not its child
    if not _prctl_deathsig(signal.SIGKILL):
        threading.Thread(target=_watch, args=(parent,), name="whale-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # died between the check and prctl: the signal will not come
        os.kill(os.getpid(), signal.SIGKILL)
    _ARMED.append(parent)
    return parent
