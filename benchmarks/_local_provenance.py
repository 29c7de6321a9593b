"""Provenance of a benchmark run: commit, command, date, host load, wall time. A local stand-in for the shared
``benchmarks/_provenance.py`` of the figures branch (replace the imports of this module with it on merge)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys


def provenance(seconds: float | None) -> dict:
    """``{"commit", "command", "date" (UTC, ISO), "host_load_1_5_15", "cpu_count", "wall_s"}`` of this run."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"commit": commit, "command": " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host_load_1_5_15": list(os.getloadavg()), "cpu_count": os.cpu_count(), "wall_s": seconds}
