"""Hardware-aware interleaved pipelines: the profiled model's units cut into ``p * v`` chunks and every pipeline
position's devices chosen together by speed and memory (:func:`whale.planner.virtual.plan_virtual_stages`,
exact), for :mod:`whale.frontend.planning`. Analysis only: no process group is touched.
"""

from __future__ import annotations

from torch import nn

from whale.cluster import ClusterSpec
from whale.config import Config
from whale.frontend.hwplan import UnitCut, cut_by_counts, device_types, placement_order
from whale.frontend.memplan import unit_backward_temporaries
from whale.frontend.profile import ModelProfile
from whale.plan.plan import Plan
from whale.plan.schedule_chunks import round_robin
from whale.planner.virtual import VirtualCut, VirtualProblem, plan_virtual_stages


def virtual_problem(prof: ModelProfile, layout: Plan, cluster: ClusterSpec, config: Config,
                    global_batch: int, model: nn.Module | None = None) -> VirtualProblem:
    """The planner's costs for ``layout`` (an interleaved plan of uniform width: its ``num_stages`` positions,
    ``virtual_stages`` chunks each): per unit, forward / backward seconds of one micro-batch's rows per device
    (``global_batch / m / lanes``) at each device type's peak FLOP/s, static bytes, activation bytes of those
    rows, the bytes its backward holds beyond them (:func:`whale.frontend.memplan.unit_backward_temporaries`;
    needs ``model``, else none) and its output's bytes (a chunk boundary's point-to-point buffers); the work
    outside every unit (the loss) counts in the last unit."""
    types = device_types(cluster)
    units = list(prof.units)
    rows = global_batch / config.num_micro_batch / layout.lanes_of(0)
    fwd = [u.forward_flops * rows for u in units]
    bwd = [u.backward_flops * rows for u in units]
    act = [u.activation_bytes * rows for u in units]
    fwd[-1] += prof.rest.forward_flops * rows
    bwd[-1] += prof.rest.backward_flops * rows
    act[-1] += prof.rest.activation_bytes * rows
    temp = [b * rows for b in unit_backward_temporaries(prof, model)] if model is not None else []
    tied = _tied_units(prof, model) if model is not None else []
    return VirtualProblem([[f / s for s in types.speeds] for f in fwd], [[b / s for s in types.speeds] for b in bwd],
                          [float(u.static_bytes) for u in units], act, [len(r) for r in types.ranks],
                          list(types.capacity), layout.num_stages, layout.virtual_stages, config.num_micro_batch,
                          layout.lanes_of(0), vary_counts=True, unit_temp=temp,
                          unit_out=[u.output_bytes * rows for u in units], unit_tied=tied)


def _tied_units(prof: ModelProfile, model: nn.Module) -> list[list[tuple[int, float]]]:
    """Per profiled unit, ``(owner unit, static bytes)`` of each parameter it shares with an earlier unit (the
    profile counts a shared tensor in its first unit only); static bytes as the owner's per parameter byte
    (parameter + gradient + optimizer state)."""
    first: dict[int, int] = {}
    out: list[list[tuple[int, float]]] = []
    for k, u in enumerate(prof.units):
        mine = {id(t): t for n, t in model.named_parameters(remove_duplicate=False) if n.startswith(u.name + ".")}
        shared = []
        for key, t in mine.items():
            o = first.setdefault(key, k)
            if o != k:
                owner = prof.units[o]
                per = (owner.param_bytes + owner.grad_bytes + owner.optimizer_state_bytes) / max(1, owner.param_bytes)
                shared.append((o, t.numel() * t.element_size() * per))
        out.append(shared)
    return out


def _note(names: tuple[str, ...], cut: VirtualCut, units: list[list[str]]) -> str:
    pos = "; ".join(f"stage {s}: {' + '.join(f'{k} x {names[t]}' for t, k in enumerate(g) if k)}, chunks "
                    + ", ".join(f"{c} ({len(units[c])} unit(s))" for c, q in enumerate(cut.positions) if q == s)
                    for s, g in enumerate(cut.groups))
    how = "exact" if cut.exact else "search budget reached: the best cut found, not proven optimal"
    return (f"interleaved placement (chunk cut and device types chosen together, {how}): {pos}; predicted step "
            f"{cut.step * 1e3:.3g} ms at peak FLOPS")


def interleaved_cut(model: nn.Module, prof: ModelProfile, layout: Plan, cluster: ClusterSpec, config: Config,
                    global_batch: int) -> UnitCut:
    """Units per chunk, chunks per position and devices per position minimizing the interleaved schedule's
    predicted step within memory; ``layout`` (the plan for identical devices) gives the positions, the chunk
    count (``p * v``), width and replicas.

    Raises:
        InfeasiblePlanError: no cut fits the devices' memory (names the position and the bytes).
    """
    types = device_types(cluster)
    cut = plan_virtual_stages(virtual_problem(prof, layout, cluster, config, global_batch, model))
    stage_of, names = cut_by_counts(model, list(prof.units), cut.counts)
    even = cut.positions == round_robin(layout.num_stages, layout.virtual_stages)
    return UnitCut(stage_of, names, placement_order(layout, types, cut.groups), _note(types.names, cut, names),
                   cut.peak_bytes, () if even else cut.positions)
