"""Command-line values of the GPT example turned into ``whale.Config`` fields."""

from __future__ import annotations

import argparse


def checkpoint_spec(value: str | None):
    """``--activation-checkpoint`` as ``Config.activation_checkpoint``: None, ``"all"``, or a tuple of names
    and TaskGraph indices (digits) from a comma list."""
    if value is None or value == "all":
        return value
    return tuple(int(v) if v.strip().isdigit() else v.strip() for v in value.split(",") if v.strip())


def forbid_spec(value: str) -> tuple[str, ...]:
    """``--forbid`` as ``Config.forbid``: a tuple of names; ``all`` forbids every technique."""
    from whale.config import FORBIDDEN

    return FORBIDDEN if value.strip() == "all" else tuple(v.strip() for v in value.split(",") if v.strip())


def at_least(low: int):
    """An argparse ``type``: an int >= ``low``, else the flag's error naming the value, the limit and the fix
    (``--eval-batches 0`` would divide by zero; ``--log-every 0`` too)."""
    def check(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value
    check.__name__ = "int"  # argparse names the type in its own messages
    return check
