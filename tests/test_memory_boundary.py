"""The bisection of benchmarks/_memory_largest.py finds the exact boundary of a monotone predicate, from a start
below or above it, and reports the first size that failed. Process-free."""

from __future__ import annotations

import pytest

from benchmarks._memory_largest import boundary


@pytest.mark.parametrize("limit", [1, 2, 11, 12, 96, 127])
@pytest.mark.parametrize("start", [1, 8, 40, 200])
def test_boundary_is_exact_from_any_start(limit, start):
    calls = []

    def ok(n):
        calls.append(n)
        return n <= limit

    assert boundary(ok, start) == (limit, limit + 1)
    assert len(calls) <= 2 * (abs(start - limit).bit_length() + 2) + 2  # logarithmic, not a ladder


def test_boundary_when_nothing_fits_and_bad_start():
    assert boundary(lambda n: False, 5, least=2) == (None, 2)
    with pytest.raises(ValueError):
        boundary(lambda n: True, 1, least=2)
