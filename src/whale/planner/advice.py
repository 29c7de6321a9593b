"""What to tell the user when no allowed combination of memory techniques fits (plain data in, one line out).

The advice follows the actual shortfall: the rank, its device, the bytes it needs and has (device or host
memory), and only the fixes that apply: a device with more memory (or, emulating, a larger ``memory_scale``),
more devices or pipeline stages, smaller micro-batches when activations are part of the bytes, more host
memory or no offload when the host is short, and relaxing ``Config.forbid`` only when it keeps something out
(naming what).
"""

from __future__ import annotations

from dataclasses import dataclass

from whale.units import format_bytes

_FORBID_WHAT = {"activation_checkpoint": "activation checkpointing", "zero": "ZeRO", "zero3": "ZeRO-3",
                "offload": "offload", "offload_params": "offloading the parameters"}


@dataclass(frozen=True)
class Shortfall:
    """The worst rank of the closest combination: its device or host bytes over its capacity.

    Attributes:
        options: the combination's description (e.g. ``"ZeRO-2 + offload optimizer"``).
        rank: global rank; device: its device name (empty when unknown).
        host: the host memory is short (else the device memory).
        need_bytes / has_bytes: what the rank needs and has.
        activation_bytes: of the needed device bytes, those that scale with the rows per micro-batch.
        detail: the placement's own message when the combination could not even be placed.
    """

    options: str
    rank: int
    device: str
    host: bool
    need_bytes: float
    has_bytes: float
    activation_bytes: float = 0.0
    detail: str = ""


def worst_rank(options: str, ranks: list[tuple[float, float, float]], capacity: list[float],
               host_capacity: list[float], names: tuple[str, ...] = ()) -> Shortfall:
    """The rank whose device (or host) bytes take the largest fraction of its capacity; ``ranks``: per rank
    (device bytes, host bytes, device bytes that scale with its rows), ``host_capacity`` empty: unbounded."""
    ratios = [(dev / capacity[r], r, False) for r, (dev, _, _) in enumerate(ranks)] + \
        ([(host / max(host_capacity[r], 1.0), r, True) for r, (_, host, _) in enumerate(ranks)] if host_capacity
         else [])
    _, r, on_host = max(ratios)
    dev, host, act = ranks[r]
    return Shortfall(options, r, names[r] if names else "", on_host, host if on_host else dev,
                     host_capacity[r] if on_host else capacity[r], act)


def infeasible_message(short: Shortfall, forbid: tuple[str, ...], floor_offload: str, micro_batches: int,
                       rows_per_micro_batch: int) -> str:
    """One line: what does not fit (rank, device, bytes needed vs available) and the fixes that apply.

    Args:
        forbid: what ``Config.forbid`` keeps out (named when not empty).
        floor_offload: the offload the user set (``"none"`` unless set; "no offload" is a fix only then).
        micro_batches / rows_per_micro_batch: the plan's (smaller micro-batches are a fix only with > 1 row).
    """
    who = f"rank {short.rank}" + (f" ({short.device})" if short.device else "")
    where = "host" if short.host else "device"
    if short.detail:
        text = f"no allowed combination of memory techniques fits: even with {short.options}, {short.detail}"
    else:
        text = (f"no allowed combination of memory techniques fits: even {short.options} leaves {who} needing "
                f"{format_bytes(short.need_bytes)} of {where} memory, it has {format_bytes(short.has_bytes)} "
                f"(lacks {format_bytes(max(0.0, short.need_bytes - short.has_bytes))})")
    fixes = []
    if short.host:
        fixes.append(f"more host memory for {who} (host_memory_bytes of its node in the cluster spec)")
        if floor_offload != "none":
            fixes.append(f"no offload (Config(offload='none') instead of {floor_offload!r})")
    else:
        fixes.append(f"a device with more memory for {who} (emulating: a larger memory_scale)")
    fixes.append("more devices or pipeline stages")
    if not short.host and short.activation_bytes > 0 and rows_per_micro_batch > 1:
        fixes.append(f"smaller micro-batches (Config(num_micro_batch=...) above {micro_batches}, "
                     f"{rows_per_micro_batch} rows per micro-batch now) or a smaller batch")
    if forbid:
        kept_out = ", ".join(_FORBID_WHAT.get(f, f) for f in forbid)
        fixes.append(f"allow what Config.forbid={forbid} keeps out ({kept_out})")
    return text + ". Fixes: " + "; ".join(fixes)
