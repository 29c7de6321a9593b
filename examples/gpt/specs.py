"""Command-line values of the GPT example turned into ``whale.Config`` fields."""

from __future__ import annotations


def checkpoint_spec(value: str | None):
    """``--activation-checkpoint`` as ``Config.activation_checkpoint``: None, ``"all"``, or a tuple of names
    and TaskGraph indices (digits) from a comma list."""
    if value is None or value == "all":
        return value
    return tuple(int(v) if v.strip().isdigit() else v.strip() for v in value.split(",") if v.strip())


def forbid_spec(value: str) -> tuple[str, ...]:
    """``--forbid`` as ``Config.forbid``: a tuple of names; ``all`` forbids every technique."""
    from whale.plan.memory import FORBIDDEN

    return FORBIDDEN if value.strip() == "all" else tuple(v.strip() for v in value.split(",") if v.strip())
