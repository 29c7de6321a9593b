"""Readable units for messages: the one home of byte formatting (error messages of the planner and others)."""

from __future__ import annotations

import math

_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``n`` bytes as text in binary units (1 KiB = 1024 bytes), for people reading an error.

    Whole bytes below 1 KiB (``"512 B"``), else one decimal in the largest unit that keeps the number at or
    above 1: ``"3.5 KiB"``, ``"175.1 MiB"``, ``"1.8 GiB"``, up to PiB. Negative numbers keep their sign;
    ``inf`` and ``nan`` print as Python prints them, with ``" B"``.

    Raises:
        TypeError: ``n`` is not a real number (a bool counts as not).
    """
    if isinstance(n, bool) or not isinstance(n, int | float):
        try:
            n = float(n)  # numpy scalars and 0-dim tensors
        except (TypeError, ValueError):
            raise TypeError(f"format_bytes needs a number of bytes, got {n!r}") from None
    if not math.isfinite(n):
        return f"{n} B"
    sign, size = ("-" if n < 0 else ""), abs(float(n))
    if size < 1024:
        return f"{sign}{size:.0f} B"
    unit = "B"
    for unit in _BYTE_UNITS:
        size /= 1024
        if size < 1024 or unit == _BYTE_UNITS[-1]:
            break
    if f"{size:.1f}" == "1024.0" and unit != _BYTE_UNITS[-1]:  # 1023.96 MiB reads as 1.0 GiB
        size, unit = 1.0, _BYTE_UNITS[_BYTE_UNITS.index(unit) + 1]
    return f"{sign}{size:.1f} {unit}"
