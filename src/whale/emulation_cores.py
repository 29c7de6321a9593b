"""The CPU core count emulated ranks plan for (``WHALE_EMULATION_CORES``); re-exported by :mod:`whale.cluster`.

Imports nothing of Whale, so the cluster spec can re-export it without an import circle.
"""

from __future__ import annotations

import os

__all__ = ["emulation_cores"]


def emulation_cores(cores: float | None = None) -> float:
    """The core count emulation plans for: ``cores`` if given, else ``WHALE_EMULATION_CORES`` (a finite number
    >= 0.1, fractions allowed), else the machine's CPU count.

    Raises:
        ValueError: ``WHALE_EMULATION_CORES`` (or ``cores``) is not a finite number >= 0.1 (fewer cores would
            slow every rank more than 10x per core given up: a hang in all but name).
    """
    if cores is None:
        raw = os.environ.get("WHALE_EMULATION_CORES", "").strip()
        if not raw:
            return float(os.cpu_count() or 1)
        try:
            cores = float(raw)
        except ValueError:
            raise ValueError(f"WHALE_EMULATION_CORES={raw!r} is not a number; set it to the CPU cores the "
                             f"emulated ranks may use (e.g. 2), or unset it to use all {os.cpu_count()}") from None
    if not 0.1 <= cores < float("inf"):
        raise ValueError(f"emulation cores must be a finite number >= 0.1, got {cores}; set "
                         f"WHALE_EMULATION_CORES to the CPU cores the emulated ranks may use (e.g. 2) or unset it")
    return float(cores)
