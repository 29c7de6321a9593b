"""Stop at a step boundary on SIGTERM: finish the current step, checkpoint, exit, so that a worker group restarted
by torchrun (a node joined an elastic job, or the agent is being stopped) loses no steps.

torchrun's agent stops a worker group by sending SIGTERM to every worker and SIGKILL to those still alive 30 s later
(``LocalElasticAgent._shutdown(death_sig=SIGTERM, timeout=30)`` in torch/distributed/elastic/agent/server/
local_elastic_agent.py; not configurable from the command line). Inside :func:`on_sigterm` the signal only sets a
flag; the training loop asks :meth:`GracefulStop.requested` after each step, a collective (an all-reduce MAX of
the flag over the world group, one int) so that every rank stops after the same step even when the agents'
signals arrive at different times, and then saves a checkpoint and exits. A watchdog ends the process with
status 143 (128 + SIGTERM) ``grace_s`` seconds after the signal if the step boundary never comes (a peer died
mid-collective), before torchrun's SIGKILL. Leaving the ``with`` block by an exception restores the previous
handler and, if SIGTERM came, delivers it again: a failing rank still dies at once, as without this module.

Collective: :meth:`GracefulStop.requested` (every rank calls it after every step).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["GRACE_S", "TORCHRUN_GRACE_S", "GracefulStop", "on_sigterm"]

TORCHRUN_GRACE_S = 30.0
"""Seconds torchrun waits after SIGTERM before SIGKILL when it stops a worker group."""

GRACE_S = 25.0
"""Default seconds from SIGTERM to the watchdog's exit when no step boundary came (below torchrun's 30 s)."""

EXIT_CODE = 128 + int(signal.SIGTERM)
"""Exit status of a worker that stopped on SIGTERM (after its checkpoint, or by the watchdog)."""


class GracefulStop:
    """The SIGTERM flag of one worker (see the module docstring); ``enabled=False``: never stops, no collective."""

    def __init__(self, enabled: bool, grace_s: float = GRACE_S):
        self.enabled, self.grace_s = enabled, grace_s
        self.signalled = False
        self._timer: threading.Timer | None = None

    def _on_signal(self, signum, frame) -> None:
        if not self.signalled:
            self.signalled = True
            self._timer = threading.Timer(self.grace_s, os._exit, args=(EXIT_CODE,))
            self._timer.daemon = True
            self._timer.start()

    def requested(self) -> bool:
        """Whether any rank got SIGTERM (collective over the world group when enabled and distributed)."""
        if not self.enabled:
            return False
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def cancel(self) -> None:
        """Stop the watchdog (the caller finished its checkpoint and exits by itself)."""
        if self._timer is not None:
            self._timer.cancel()

    def exit(self, note: str | None = None) -> None:
        """Cancel the watchdog, print ``note`` (when given) and raise ``SystemExit(143)``."""
        self.cancel()
        if note:
            print(note, flush=True)
        raise SystemExit(EXIT_CODE)


@contextlib.contextmanager
def on_sigterm(enabled: bool, grace_s: float = GRACE_S):
    """Within the block SIGTERM sets the flag of the :class:`GracefulStop` yielded (when ``enabled`` and on the main
    thread; otherwise nothing changes). On leaving, the previous handler comes back; when the block ends by an
    exception after a SIGTERM, the signal is delivered again."""
    stop = GracefulStop(enabled, grace_s)
    main = threading.current_thread() is threading.main_thread()
    if not (enabled and main):  # off, or not the main thread: no handler (still in the collective when enabled)
        yield stop
        return
    old = signal.signal(signal.SIGTERM, stop._on_signal)
    failed = False
    try:
        yield stop
    except SystemExit:
        raise
    except BaseException:
        failed = True
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
        if failed and stop.signalled:
            stop.cancel()
            os.kill(os.getpid(), signal.SIGTERM)
