"""The first error once: a rank stopped by a peer's failure says so in one line instead of a traceback.

When one rank raises (or dies), its peers fail in their next collective ("Connection closed by peer" as soon as
the dead rank's sockets close, or after ``Config(timeout_s)`` when it hangs). Every one of them would print a
traceback that says nothing about the cause, burying the failing rank's own error. :func:`install` wraps
``sys.excepthook`` so that such secondary errors print one line naming the rank; any other exception (the real
first error) prints its full traceback as usual.
"""

from __future__ import annotations

import re
import sys

import torch.distributed as dist

PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out",
                "timeout", "Socket Timeout", "connection refused")
"""Fragments of the messages torch.distributed raises when a peer is gone or silent."""


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a collective failing because another rank failed or stopped responding."""
    backend_error = getattr(dist, "DistBackendError", ())
    text = str(exc)
    return isinstance(exc, backend_error) or (isinstance(exc, RuntimeError) and any(f in text for f in PEER_FAILURE))


def install(rank: int, world_size: int) -> None:
    """Wrap ``sys.excepthook`` on a rank of a multi-rank job (idempotent)."""
    if world_size <= 1 or getattr(sys.excepthook, "_whale", False):
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        """One line for a peer failure, the usual traceback otherwise."""
        if is_peer_failure(exc):
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())  # gloo's "[file.cc:553] " prefix
            first = text.splitlines()[0].split(". ")[0][:160] if text else kind.__name__
            print(f"[whale] rank {rank}: stopped because another rank failed or stopped responding ({first}); "
                  "the first error is the failing rank's own traceback", file=sys.stderr, flush=True)
        else:
            previous(kind, exc, tb)

    hook._whale = True
    sys.excepthook = hook
