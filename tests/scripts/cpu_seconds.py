"""CPU seconds per test: the suite's CPU floor on this host (``make test-cpu``).

A pytest plugin (``-p tests.scripts.cpu_seconds``) that records, for every test, its wall seconds and the CPU
seconds (user + system) of the test process's whole tree: the xdist worker, its forkserver and the gloo ranks
forked from it, and the ``whale launch`` / torchrun jobs a test starts (their exited children count once reaped,
through ``cutime``/``cstime``). One JSON line per test goes to ``$WHALE_CPU_LOG`` (default ``.cpu_seconds.jsonl``).

``python tests/scripts/cpu_seconds.py LOG`` prints the sum and the floor it implies: a suite needing C CPU seconds
cannot finish in less than C / cores seconds of wall time on this host, however the tests are scheduled. Why not
``time make test``: the forkserver's ranks are not children that pytest waits for, so ``time`` misses them.

Reading ``/proc`` for every process costs a few milliseconds per test; the timings of a run with the plugin are
not the suite's own (``make test`` runs without it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds of the process and its reaped children)`` from ``/proc/PID/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, ..., utime is field 11
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of process ``root`` and every live descendant (each with its reaped children)."""
    children: dict[int, list[tuple[int, float]]] = {}
    own = 0.0
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (got := _stat(pid)) is not None:
            children.setdefault(got[0], []).append((int(pid), got[1]))
            if int(pid) == root:
                own = got[1]
    total, stack = own, [root]
    while stack:
        for pid, cpu in children.get(stack.pop(), []):
            total += cpu
            stack.append(pid)
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Wall and CPU seconds of one test (setup, call and teardown)."""
    cpu, wall = tree_cpu_seconds(os.getpid()), time.monotonic()
    yield
    record = {"id": item.nodeid, "wall_s": round(time.monotonic() - wall, 3),
              "cpu_s": round(tree_cpu_seconds(os.getpid()) - cpu, 3)}
    with open(os.environ.get("WHALE_CPU_LOG", ".cpu_seconds.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def summary(log: str, cores: int | None = None, top: int = 15) -> str:
    """The sum of CPU and wall seconds in ``log``, the wall-time floor on ``cores`` cores, the largest tests."""
    rows = [json.loads(line) for line in open(log)]
    cores = cores or os.cpu_count() or 1
    cpu, wall = sum(r["cpu_s"] for r in rows), sum(r["wall_s"] for r in rows)
    lines = [f"{len(rows)} tests: {cpu:.0f} CPU seconds, {wall:.0f} test-seconds of wall time; on {cores} cores the "
             f"suite cannot take less than {cpu / cores:.0f} s of wall time",
             f"the {top} largest (CPU s, wall s):"]
    largest = sorted(rows, key=lambda r: -r["cpu_s"])[:top]
    lines += [f"  {r['cpu_s']:7.1f} {r['wall_s']:7.1f}  {r['id']}" for r in largest]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1] if len(sys.argv) > 1 else ".cpu_seconds.jsonl"))
