"""A TCP port for a test's rendezvous store, chosen outside the kernel's ephemeral range.

A port from ``bind(("127.0.0.1", 0))`` is ephemeral: released and handed to torchrun a moment later, it can be
taken in between by another test's gloo ranks, whose pair connections bind ephemeral ports too (seen as
"Gloo connectFullMesh failed ... Connection closed by peer" in a concurrent run). :func:`free_port` draws at random
from below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), which the kernel never hands out for
port 0, and checks that nothing listens there now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(low: int = 20000) -> int:
    """A port in ``[low, ephemeral start)`` that binds on 127.0.0.1 now (random, so concurrent tests rarely meet)."""
    high = max(_ephemeral_start(), low + 1000)
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{low}, {high})")
