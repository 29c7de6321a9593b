"""Which results were measured on code other than ``HEAD``'s (``benchmarks/report.py --stale``).

A result's measured code is :data:`MEASURED_CODE` plus its own benchmark script (named in its provenance command)
and the benchmark modules that script imports, transitively; git tells whether any of those files changed between
the result's provenance commit and ``HEAD``. File-grained on purpose: a refactor that changes no behaviour still
marks the results that import it stale (safe, at the cost of a rerun).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

MEASURED_CODE = ["src", "examples", "pyproject.toml", "benchmarks/clusters"]
"""The paths (git pathspecs) whose content decides what every benchmark measures: the product, the examples and
the cluster files. Per result, its own script (named in its provenance command) and the benchmark modules that
script imports (:func:`benchmark_modules`) are added; not the results, this renderer, ``run_all.sh``, other
benchmarks' scripts, the docs or the tests."""
SCRIPT = re.compile(r"benchmarks/([a-z]\w*)\.py")


def benchmark_modules(script: str) -> list[str]:
    """``script`` (a path under ``benchmarks/``) and every ``benchmarks`` module it imports, transitively, as
    they are in this checkout (sorted paths)."""
    seen, todo = set(), [script]
    while todo:
        path = todo.pop()
        if path in seen or not (ROOT / path).is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "benchmarks":
                names = [node.module] if node.module != "benchmarks" else [f"benchmarks.{a.name}" for a in node.names]
                todo += [n.replace(".", "/") + ".py" for n in names]
    return sorted(seen)


def changed_since(commit: str, script: str | None = None) -> list[str] | None:
    """Files of :data:`MEASURED_CODE` (plus ``script`` and the benchmark modules it imports; no script: all of
    ``benchmarks/`` but its results) that differ between ``commit`` (a provenance commit, ``+dirty`` allowed)
    and ``HEAD``; ``None`` when git cannot tell (no checkout, unknown commit)."""
    rev = commit.removesuffix("+dirty")
    paths = measured_paths(script)
    try:
        out = subprocess.run(["git", "diff", "--name-only", rev, "HEAD", "--", *paths], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split() if out.returncode == 0 else None


def measured_paths(script: str | None) -> list[str]:
    """The measured code of a result whose command names ``script`` (git pathspecs)."""
    return MEASURED_CODE + (benchmark_modules(script) if script else ["benchmarks", ":(exclude)benchmarks/results"])


def _dirty_measured(part: dict, script: str | None) -> list[str] | None:
    """Of a ``+dirty`` run's uncommitted files (``dirty_files``), those in its measured code; ``None`` when the
    run did not record them (what was uncommitted is unknown)."""
    files = part.get("dirty_files")
    if files is None:
        return None
    prefixes = [p.rstrip("/") for p in measured_paths(script) if not p.startswith(":")]
    return [f for f in files if any(f == p or f.startswith(p + "/") for p in prefixes)]


def stale_results() -> list[str]:
    """One line per results file or part measured on code other than ``HEAD``'s: a measured-code file changed
    since its commit, or uncommitted at the run (``+dirty`` with such ``dirty_files``, or without the list),
    naming its commit and the files."""
    lines = []
    for path in sorted(RESULTS.glob("*.json")):
        prov = json.loads(path.read_text()).get("provenance") or {}
        parts = prov.get("parts") or {"": prov}
        for name, part in parts.items():
            commit = str(part.get("commit", "unknown"))
            found = SCRIPT.search(str(part.get("command", "")))
            script = found.group(0) if found else None
            changed = changed_since(commit, script)
            label = path.name + (f" part {name}" if name else "")
            short = commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")
            dirty = _dirty_measured(part, script) if commit.endswith("+dirty") else []
            if changed is None:
                lines.append(f"{label}: commit {short} unknown to git here")
            elif changed or dirty:
                what = [f"{len(changed)} measured-code files changed since ({', '.join(changed[:3])}"
                        f"{', ...' if len(changed) > 3 else ''})"] if changed else []
                what += [f"uncommitted at the run: {', '.join(dirty[:3])}"] if dirty else []
                lines.append(f"{label}: measured at {short}; " + "; ".join(what))
            elif dirty is None:
                lines.append(f"{label}: measured at {short}, which files were uncommitted is not recorded")
    return lines
