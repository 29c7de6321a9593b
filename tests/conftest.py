"""Test order: the longest tests first, so that pytest-xdist's workers never end on one long test.

``make test`` runs ``pytest -n 2 --dist load --maxschedchunk 1``: each worker asks for one test at a time, so
running the collection longest-first is the longest-processing-time-first rule (Graham 1969), whose makespan is
within 4/3 of the best. The lengths come from ``tests/durations.json`` (seconds per test id, measured on a quiet
host by ``make test-durations``); a test not listed there counts as :data:`SLOW_DEFAULT_S` if it is marked
``slow`` and :data:`DEFAULT_S` otherwise. Only the order changes: the same tests run with the same assertions,
and a stale file only makes the order less good.

pytest-xdist has no duration-aware scheduler of its own (pytest-split partitions across CI machines, not
workers), hence this hook.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
SLOW_DEFAULT_S = 5.0
DEFAULT_S = 0.1


def expected_seconds(item: pytest.Item, known: dict[str, float]) -> float:
    """The expected run time of ``item`` in seconds: the recorded one, else the marker's default."""
    if item.nodeid in known:
        return known[item.nodeid]
    return SLOW_DEFAULT_S if item.get_closest_marker("slow") else DEFAULT_S


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    items.sort(key=lambda it: -expected_seconds(it, known))  # stable: equal lengths keep the file order


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread per xdist worker (as every test rank has): two workers on two cores, no oversubscribed
    OpenMP pools spinning against each other. The environment is left alone (launch tests check what workers
    inherit)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch  # noqa: PLC0415 - only when running as an xdist worker

        torch.set_num_threads(1)
