"""Where a benchmark result came from: the one helper every benchmark uses to write its results JSON.

A :class:`Run` is started when a benchmark starts. A daemon thread samples the host's 1-minute load average
(``os.getloadavg()[0]``) every ``interval_s`` seconds until the result is written, so the JSON says how loaded
the shared host was *during* the run, not only before it. :meth:`Run.write` writes a fresh file (never merges
an old one) with a ``provenance`` block:

- ``commit``: ``git rev-parse HEAD`` at the run's start, with ``+dirty`` when tracked files of the measured
  code (``src``, ``examples``, ``benchmarks`` less its results, ``pyproject.toml``) had uncommitted changes,
  then named in ``dirty_files``;
- ``command``: the exact command (interpreter name and ``sys.argv``);
- ``date`` / ``date_end``: UTC start and end (ISO 8601);
- ``load_1min``: ``min`` / ``median`` / ``max`` / ``samples`` of the sampled load, and ``cores``;
- ``wall_s``: seconds from the start of the run to the write.

A JSON made of parts measured by different runs (``benchmarks/planner.py --merge``) is written by
:class:`PartsFile`: ``provenance.parts`` lists, for each part, its own commit, command, dates, load and wall
time and the keys it wrote; merging is explicit (``merge=True``), and a missing, empty or unreadable old file
is read as "no earlier parts" with one printed line saying so; an old file without ``provenance.parts`` keeps
its keys as part ``unrecorded`` (commit and command unknown), so a merged file always says which keys are whose.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    """Output of ``git args`` in the repository root ('' when git is missing or fails)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


MEASURED = ["src", "examples", "benchmarks", "pyproject.toml", ":(exclude)benchmarks/results"]
"""What a run's ``+dirty`` looks at (git pathspecs): the code that decides what a benchmark measures. Uncommitted
docs or tests do not make a measurement dirty."""


def commit() -> str:
    """``HEAD``'s hash, with ``+dirty`` when tracked files of :data:`MEASURED` differ from it ('unknown' outside
    a git checkout); :func:`dirty_files` names them."""
    head = _git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if dirty_files() else "")


def dirty_files() -> list[str]:
    """Tracked files of :data:`MEASURED` with uncommitted changes (results being rewritten are not among them)."""
    return _git("diff", "--name-only", "HEAD", "--", *MEASURED).split()


def command() -> str:
    """The command that started this process: interpreter name and ``sys.argv``."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class Run:
    """One benchmark run: start time and a load-average sampler thread (daemon; stops at :meth:`stop`).

    Args:
        interval_s: seconds between load samples (one sample is taken at once, one at each record).
    """

    def __init__(self, interval_s: float = 5.0) -> None:
        self.start = time.time()
        self.commit = commit()  # at the start: the code that ran, even if the tree changes during the run
        self.dirty = dirty_files()
        self.samples: list[tuple[float, float]] = [(self.start, os.getloadavg()[0])]
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._sample, name="load-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.samples.append((time.time(), os.getloadavg()[0]))

    def stop(self) -> None:
        """Stop the sampler thread (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval + 1)

    def record(self, since: float | None = None) -> dict:
        """The provenance block for the time from ``since`` (default: the run's start) to now."""
        now = time.time()
        self.samples.append((now, os.getloadavg()[0]))
        t0 = self.start if since is None else since
        loads = [v for t, v in self.samples if t >= t0] or [self.samples[-1][1]]
        return {"commit": self.commit, **({"dirty_files": self.dirty} if self.dirty else {}),
                "command": command(), "date": _utc(t0), "date_end": _utc(now),
                "load_1min": {"min": round(min(loads), 2), "median": round(statistics.median(loads), 2),
                              "max": round(max(loads), 2), "samples": len(loads)},
                "cores": os.cpu_count(), "wall_s": round(now - t0, 1)}

    def write(self, path: str | os.PathLike, result: dict) -> dict:
        """Write ``result`` plus ``provenance`` as a fresh JSON file at ``path`` (parent folders made; written to
        a temporary file then renamed, so a crash never leaves half a file). Returns what was written."""
        out = {**result, "provenance": self.record()}
        _dump(path, out)
        return out


def _dump(path, obj: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class PartsFile:
    """A results JSON assembled from named parts, each with its own provenance.

    Args:
        path: the JSON file.
        run: this process's :class:`Run`.
        merge: keep the parts an earlier run wrote to ``path`` (their keys and provenance) unless rerun now;
            without it the file is written fresh with this run's parts only.
    """

    def __init__(self, path: str | os.PathLike, run: Run, merge: bool = False) -> None:
        self.path, self.run = Path(path), run
        self.data: dict = {}
        self.parts: dict[str, dict] = {}
        if merge:
            self._load_earlier()

    def _load_earlier(self) -> None:
        try:
            old = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            print(f"{self.path}: not readable as JSON ({type(e).__name__}); no earlier parts kept", flush=True)
            return
        if not isinstance(old, dict):
            print(f"{self.path}: not a JSON object; no earlier parts kept", flush=True)
            return
        parts = old.get("provenance", {}).get("parts")
        if not isinstance(parts, dict):  # written before this helper: kept, and labelled as of unknown origin
            keys = sorted(k for k in old if k != "provenance")
            parts = {"unrecorded": {"commit": "unknown: written before benchmarks/_provenance.py",
                                    "command": "unknown", "keys": keys}}
            print(f"{self.path}: no provenance.parts; its {len(keys)} keys kept as part 'unrecorded'", flush=True)
        for name, prov in parts.items():
            self.parts[name] = prov
            self.data.update({k: old[k] for k in prov.get("keys", ()) if k in old})

    def add(self, name: str, keys: dict, since: float) -> None:
        """Record part ``name`` (its result ``keys``, measured from time ``since``) and rewrite the file.
        Keys an earlier version of the part wrote and this one does not are dropped."""
        for k in self.parts.get(name, {}).get("keys", ()):
            self.data.pop(k, None)
        for other in self.parts.values():  # a key belongs to the part that wrote it last
            other["keys"] = [k for k in other.get("keys", ()) if k not in keys]
        self.data.update(keys)
        self.parts[name] = {**self.run.record(since), "keys": sorted(keys)}
        self.write()

    def absorb(self, path: str | os.PathLike) -> None:
        """Take every part (keys and provenance) of another parts file, e.g. one a concurrent run wrote, and
        rewrite this file.

        Raises:
            ValueError: ``path`` has no ``provenance.parts``.
        """
        other = json.loads(Path(path).read_text())
        parts = other.get("provenance", {}).get("parts")
        if not isinstance(parts, dict):
            raise ValueError(f"{path}: no provenance.parts to merge; write it with PartsFile (planner.py --out)")
        for name, prov in parts.items():
            keys = {k: other[k] for k in prov.get("keys", ()) if k in other}
            for mine in self.parts.values():
                mine["keys"] = [k for k in mine.get("keys", ()) if k not in keys]
            self.data.update(keys)
            self.parts[name] = prov
        self.write()

    def write(self) -> None:
        """Write the data so far and ``provenance`` (this run's, plus ``parts``; a part left with no keys, every one
        rewritten by later parts, is dropped)."""
        self.parts = {name: prov for name, prov in self.parts.items() if prov.get("keys")}
        _dump(self.path, {**self.data, "provenance": {**self.run.record(), "parts": self.parts}})
