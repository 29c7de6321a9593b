"""Hardware-aware analysis: profile the model on fake tensors and cut the pipeline by device speed and memory
(the Whale paper's §3.3); :mod:`whale.frontend.memplan` turns the profile into each stage's memory.

Everything here is analysis before any process group is touched; the arithmetic lives in the pure functions
of :mod:`whale.planner.placement`, :mod:`whale.planner.balance` and :mod:`whale.planner.hardware`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from whale.cluster import ClusterSpec, memory_capacity
from whale.config import Config
from whale.frontend.profile import ModelProfile, profile_model
from whale.plan.plan import Plan, StageCut
from whale.plan.schedule import in_flight_micro_batches
from whale.planner.balance import InfeasiblePlanError
from whale.planner.hardware import device_order
from whale.planner.placement import place_stages, placement_work


@dataclass(frozen=True)
class UnitCut:
    """Pipeline cut and device placement chosen by speed and memory: ``stage_of`` (tensor FQN -> stage), the
    unit names per stage, the plan's ``device_order`` (slot -> rank; empty = identity) and a note for the plan's
    printout."""

    stage_of: dict[str, int]
    units: list[list[str]]
    device_order: tuple[int, ...] = ()
    note: str = ""
    position_bytes: tuple[float, ...] = ()  # interleaved cuts: bytes per pipeline position the planner predicts
    chunk_positions: tuple[int, ...] = ()  # interleaved cuts of different chunk counts: each chunk's position


def sample_rows(sample_batch) -> int:
    """Global batch size of a sample batch ``(inputs, target)`` (the target's rows; inputs may be a dict of
    keyword arguments with non-tensor values)."""
    target = sample_batch[1]
    if isinstance(target, torch.Tensor):
        return int(target.size(0))
    inputs = sample_batch[0]
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, tuple | list) else [inputs]
    return int(next(v for v in values if isinstance(v, torch.Tensor)).size(0))


def profile(model: nn.Module, sample_batch, rows: int = 2, loss_fn=None) -> ModelProfile:
    """Per-unit FLOPs and bytes of one training step on ``rows`` samples of ``sample_batch`` (fake tensors),
    with the training loss ``loss_fn(output, target)`` when given (its saved tensors and backward temporaries,
    e.g. a language model's log-probabilities and logit gradients, count in ``rest``)."""
    inputs, target = sample_batch[0], sample_batch[1]
    b = max(1, min(rows, sample_rows(sample_batch)))

    def make(b: int):
        # clone: a slice keeps the whole batch's storage, which the profiler would count as activations
        """The sample inputs cut to ``b`` rows."""
        cut = lambda t: t[:b].clone() if isinstance(t, torch.Tensor) and t.dim() else t  # noqa: E731
        if isinstance(inputs, dict):
            return {k: cut(v) for k, v in inputs.items()}
        if isinstance(inputs, tuple | list):
            return tuple(cut(t) for t in inputs)
        return cut(inputs)

    loss = None
    if loss_fn is not None and isinstance(target, torch.Tensor):
        loss = lambda out, *_a: loss_fn(out, target[:b].clone())  # noqa: E731
    return profile_model(model, make, batch_size=b, loss_fn=loss)


@dataclass(frozen=True)
class DeviceTypes:
    """The cluster's ranks grouped into interchangeable device types (same name, speed and memory), listed by
    memory, largest first (ties: first rank first), so placement ties keep the paper's memory order.

    Attributes:
        names: device name per type.
        speeds: peak FLOP/s per type (for the plan's dtype).
        capacity: bytes one device of each type may use (times ``memory_scale`` when emulating).
        ranks: global ranks of each type, ascending.
    """

    names: tuple[str, ...]
    speeds: tuple[float, ...]
    capacity: tuple[float, ...]
    ranks: tuple[tuple[int, ...], ...]


def device_types(cluster: ClusterSpec, dtype: str = "fp32") -> DeviceTypes:
    """Group ``cluster``'s ranks by (name, speed, memory) into :class:`DeviceTypes`."""
    groups: dict[tuple, list[int]] = {}
    for r, d in enumerate(cluster.devices()):
        groups.setdefault((d.name, d.flops(dtype), memory_capacity(cluster, r)), []).append(r)
    keys = sorted(groups, key=lambda k: (-k[2], groups[k][0]))
    return DeviceTypes(tuple(k[0] for k in keys), tuple(k[1] for k in keys), tuple(k[2] for k in keys),
                       tuple(tuple(groups[k]) for k in keys))


def unit_seconds(layer_flops: list[float], types: DeviceTypes) -> list[list[float]]:
    """Seconds of each unit on one device of each type, ``[unit][type]``: FLOPs / peak FLOP/s. The one place
    where a calibrated time per FLOP (by layer type and device type) plugs into the placement."""
    return [[f / speed for speed in types.speeds] for f in layer_flops]


def placement_order(layout: Plan, types: DeviceTypes, groups) -> tuple[int, ...]:
    """``device_order`` (slot -> rank) running stage s on ``groups[s][t]`` devices of each type t: ranks of a
    type in ascending order, stage by stage; a stage's ranks (ascending) fill its lanes in order; ``()`` when
    that is the identity."""
    pools = [list(r) for r in types.ranks]
    stage_ranks = [sorted(r for t, k in enumerate(g) for r in (pools[t].pop(0) for _ in range(k))) for g in groups]
    order = [stage_ranks[s][k * n + j] for k in range(layout.num_replicas)
             for s, n in enumerate(layout.stage_widths) for j in range(n)]
    return tuple(order) if order != list(range(layout.world_size)) else ()


PLACEMENT_WORK_LIMIT = 4e7
"""Largest :func:`whale.planner.placement.placement_work` searched exactly (about a second on one core); above it
the stages keep the paper's memory order and only the cut is chosen (the plan's note says so)."""


def memory_order_groups(layout: Plan, types: DeviceTypes, cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Per stage, devices of each type under the paper's memory order (:func:`whale.planner.hardware.device_order`
    on a plan without an order: in each replica, largest memory first)."""
    ordered = dataclasses.replace(layout, device_order=device_order(dataclasses.replace(layout, device_order=()),
                                                                    cluster))
    type_of = {r: t for t, ranks in enumerate(types.ranks) for r in ranks}
    return [tuple(sum(type_of[r] == t for r in ordered.stage_ranks(s)) for t in range(len(types.names)))
            for s in range(layout.num_stages)]


def _placement_note(types: DeviceTypes, placement, units: list[list[str]], exact: bool) -> str:
    stages = "; ".join(
        f"stage {s}: {' + '.join(f'{k} x {types.names[t]}' for t, k in enumerate(g) if k)}, {len(names)} unit(s)"
        for s, (g, names) in enumerate(zip(placement.groups, units, strict=True)))
    how = ("stage cut and device types chosen together, exact" if exact else
           "devices in memory order (the exact search is too large for this cluster), cut chosen for it")
    return (f"pipeline placement ({how}): {stages}; slowest stage {placement.bottleneck * 1e3:.3g} ms per "
            "micro-batch at peak FLOPS")


def hardware_cut(model: nn.Module, prof: ModelProfile, layout: Plan, cluster: ClusterSpec, config: Config,
                 global_batch: int) -> UnitCut:
    """Contiguous unit cut and the devices of every stage, chosen together to minimize the slowest stage within
    memory (:func:`whale.planner.placement.place_stages`, exact); ``layout`` gives the stage widths and
    replicas. Stages of different widths are compared by rows per device (a stage twice as wide takes each
    micro-batch's rows twice as fast); activation bytes are counted at the narrowest stage's rows per device
    on every stage (an upper bound for the wider ones).

    When no placement fits the devices' memory without memory techniques, it minimizes the slowest stage alone
    and :mod:`whale.planner.memory` then adds checkpointing, ZeRO or offload (or says nothing fits).
    """
    types = device_types(cluster)
    units = list(prof.units)
    widths = [layout.lanes_of(s) for s in range(layout.num_stages)]
    mb_rows = global_batch / config.num_micro_batch / min(widths)
    flops = [u.train_flops * mb_rows for u in units]
    flops[-1] += prof.rest.train_flops * mb_rows
    static = [float(u.static_bytes) for u in units]
    act = [u.activation_bytes * mb_rows for u in units]
    s_count, m = layout.num_stages, config.num_micro_batch
    in_flight = [in_flight_micro_batches(s, s_count, m, config.schedule) for s in range(s_count)]
    args = (unit_seconds(flops, types), static, act, [len(r) for r in types.ranks])
    exact = placement_work(widths, args[3], len(units)) <= PLACEMENT_WORK_LIMIT
    rest = (widths, in_flight, [min(widths) / w for w in widths], None if exact else
            memory_order_groups(layout, types, cluster))
    try:
        placed = place_stages(*args, list(types.capacity), *rest)
    except InfeasiblePlanError:  # nothing fits as is: place by speed; the memory planner adds what makes it fit
        placed = place_stages(*args, [sum(static) + max(in_flight) * sum(act) + 1.0] * len(types.names), *rest)
    stage_of, names = cut_by_counts(model, units, placed.counts)
    return UnitCut(stage_of, names, placement_order(layout, types, placed.groups),
                   _placement_note(types, placed, names, exact))


def cut_by_counts(model: nn.Module, units, counts) -> tuple[dict[str, int], list[list[str]]]:
    """``(stage_of, names)``: stage ``s`` takes the next ``counts[s]`` profiled units; every tensor FQN under a
    unit maps to its stage (the first stage holding it, for a tensor two units share)."""
    stage_of: dict[str, int] = {}
    names: list[list[str]] = []
    start = 0
    for s, c in enumerate(counts):
        names.append([u.name for u in units[start:start + c]])
        for u in units[start:start + c]:
            mod = model.get_submodule(u.name)
            for name, _ in [*mod.named_parameters(prefix=u.name, remove_duplicate=False),
                            *mod.named_buffers(prefix=u.name, remove_duplicate=False)]:
                stage_of.setdefault(name, s)
        start += c
    return stage_of, names


def _unit_stages(prof: ModelProfile, stage_params: list[set[str]], cuts: tuple[StageCut, ...] = ()) -> list[int]:
    """Stage of each profiled unit: the stage whose hardware-aware cut lists it (``cuts[s].units``), else the
    first stage holding one of its parameters; a unit without parameters (a dropout) goes with the unit before
    it, as the graph cut places it (stage 0 when it is the first)."""
    named = {name: s for s, cut in enumerate(cuts) for name in cut.units}
    out: list[int] = []
    for u in prof.units:
        prefix = u.name + "."
        held = next((s for s, names in enumerate(stage_params)
                     if any(n == u.name or n.startswith(prefix) for n in names)), None)
        out.append(named.get(u.name, held if held is not None else out[-1] if out else 0))
    return out


def stage_param_names(cuts: tuple[StageCut, ...], model: nn.Module) -> list[set[str]]:
    """Parameter FQNs per stage: from the plan's stage cuts, or every parameter of ``model`` for one stage."""
    if cuts:
        return [set(c.params) for c in cuts]
    return [{n for n, _ in model.named_parameters(remove_duplicate=False)}]


def stage_flops(prof: ModelProfile, stage_params: list[set[str]],
                cuts: tuple[StageCut, ...] = ()) -> tuple[float, ...]:
    """Training FLOPs per sample of each stage (units by :func:`_unit_stages`; the rest last)."""
    out = [0.0] * len(stage_params)
    for u, stage in zip(prof.units, _unit_stages(prof, stage_params, cuts), strict=True):
        out[stage] += u.train_flops
    out[-1] += prof.rest.train_flops
    return tuple(out)
