"""From the fake-tensor profile to each stage's memory, and the memory techniques the plan needs to fit.

:func:`stage_memories` turns the profile (:mod:`whale.frontend.profile`) and the plan's stage cut into one
:class:`whale.planner.memory.StageMemory` per pipeline stage: trainable elements from the stage's own parameter
names (a weight tied across stages counts in every stage that holds a copy), activation bytes per sample of
the units the stage runs (the loss in the last stage), the same with every repeated layer checkpointed, and
the backward temporaries of the stage's units counted from the moment its backward starts (what a pipeline
rank holds: the received gradient, the gradients of activations, the loss's gradient of the logits).

:func:`fit_memory` asks :func:`whale.planner.memory.choose_memory_options` for the cheapest allowed techniques
that fit, placing the plan for each candidate with its rows and ZeRO shares chosen together within memory
(:func:`whale.planner.fit.fit_shares`), and records the choice in the plan.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from whale.cluster import ClusterSpec, memory_capacity
from whale.config import Config
from whale.frontend.profile import ModelProfile
from whale.memory.checkpointing import repeated_layers
from whale.memory.host import host_memory_capacity
from whale.plan.plan import Plan
from whale.plan.schedule import pending_weight_passes
from whale.plan.schedule_chunks import schedule_for
from whale.planner.fit import fit_shares
from whale.planner.hardware import apply_hardware
from whale.planner.memory import (
    MemoryChoice,
    MemoryOptions,
    StageMemory,
    choose_memory_options,
)


def _inside(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.startswith(t + ".") for t in targets)


def _stage_units(prof: ModelProfile, stage_params: list[set[str]]) -> list[list]:
    """Profiled units per stage: by the stage holding their parameters; a unit without parameters (dropout,
    an activation) runs where the unit before it runs (the first stage when none)."""
    out: list[list] = [[] for _ in stage_params]
    s = 0
    for u in prof.units:
        prefix = u.name + "."
        s = next((i for i, names in enumerate(stage_params) if any(n == u.name or n.startswith(prefix)
                                                                  for n in names)), s)
        out[s].append(u)
    return out


def _backward_peak(work: list, kept: list[float], last_stage: bool, relief: dict[str, float]) -> float:
    """The most bytes per sample alive while the stage's backward walks ``work`` (its units in forward order,
    the loss last in the last stage): the activations not yet freed (``kept`` per unit; the unit in backward
    holds its whole activations, recomputed when checkpointed) plus that unit's temporaries: the gradient of
    its output (received from the next stage, or made by the next unit) and its own increment over the
    temporaries alive when it started (:mod:`whale.frontend.transient`), less ``relief`` (per unit, bytes per
    sample the profile saw as temporaries that the stage holds as gradients: :func:`_tied_relief`)."""
    peak = 0.0
    for i in range(len(work) - 1, -1, -1):
        u = work[i]
        own = max(0.0, u.transient_bytes - u.entry_bytes - relief.get(u.name, 0.0))
        incoming = 0.0 if (last_stage and i == len(work) - 1) else u.output_bytes
        peak = max(peak, sum(kept[:i]) + u.activation_bytes + own + incoming)
    return peak


def unit_backward_temporaries(prof: ModelProfile, model: nn.Module) -> list[float]:
    """Per profiled unit, bytes per sample its backward holds beyond the activations kept (what
    :func:`_backward_peak` adds to them when the unit runs backward: the gradient of its output and its own
    temporaries, less the gradients of weights tied to another unit); the loss (``prof.rest``) is folded into
    the last unit, whose output's gradient it makes. For planners that cut chunks at any unit
    (:mod:`whale.frontend.hwvirtual`): a chunk's backward holds its worst unit's."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    owners: dict[int, set[str]] = {}
    for u in prof.units:
        for n, t in tensors.items():
            if n.startswith(u.name + "."):
                owners.setdefault(id(t), set()).add(u.name)
    relief = _tied_relief(prof, tensors, {k for k, us in owners.items() if len(us) > 1})
    out = [max(0.0, u.transient_bytes - u.entry_bytes - relief.get(u.name, 0.0)) + u.output_bytes
           for u in prof.units]
    if out:
        rest = prof.rest
        out[-1] = max(out[-1], max(0.0, rest.transient_bytes - rest.entry_bytes))
    return out


def _tied_relief(prof: ModelProfile, tensors: dict, tied: set[int]) -> dict[str, float]:
    """Per unit, bytes per sample of the gradients of cross-stage tied weights (ids ``tied``) that it reads but
    an earlier unit owns (the LM head of a tied embedding). In the one-process profile that gradient waits in
    autograd's buffer as a temporary until the owner's use adds to it; in a pipeline each stage's copy gets its
    gradient directly (counted under ``gradients``), so it is not a temporary of the stage."""
    seen: set[int] = set()
    out: dict[str, float] = {}
    for u in prof.units:
        mine = {id(t): t for n, t in tensors.items() if n.startswith(u.name + ".") and id(t) in tied}
        late = [t for k, t in mine.items() if k in seen]
        if late:
            out[u.name] = sum(t.numel() * t.element_size() for t in late) / prof.batch_size
        seen.update(mine)
    return out


def _p2p(stage_units: list[list], s: int) -> float:
    """Bytes per sample of stage ``s``'s point-to-point buffers: three messages per boundary (see
    :class:`~whale.planner.memory.StageMemory`), a boundary's size the output of the unit before it."""
    ends = [units[-1].output_bytes if units else 0.0 for units in stage_units]
    inward = ends[s - 1] if s > 0 else 0.0
    outward = ends[s] if s < len(stage_units) - 1 else 0.0
    return 3.0 * (inward + outward)


def _gathered(units: list, layers: tuple[str, ...], trainable: int, pipelined: bool, tied: int) -> int:
    """Elements ZeRO-3 holds gathered at once: the whole stage in a pipeline, less its ``tied`` elements (weights
    tied across stages stay whole); else the parameters outside the repeated ``layers`` (gathered from forward
    to backward) plus the largest layer."""
    if pipelined:
        return trainable - tied
    inside = [u.param_bytes // 4 for u in units if _inside(u.name, layers)]
    return trainable - sum(inside) + max(inside, default=0)


def stage_memories(prof: ModelProfile, model: nn.Module, stage_params: list[set[str]],
                   checkpointed: tuple[str, ...] = ()) -> list[StageMemory]:
    """One :class:`StageMemory` per stage (see the module docstring). ``checkpointed``: the module FQNs the
    plan checkpoints; empty: every repeated layer (what the planner would checkpoint)."""
    layers = tuple(repeated_layers(model))
    targets = checkpointed or layers
    tensors = dict(model.named_parameters(remove_duplicate=False))
    last = len(stage_params) - 1
    ties_all = {id(t): sum(any(id(tensors[n]) == id(t) for n in names if n in tensors) for names in stage_params)
                for t in tensors.values()}
    relief = _tied_relief(prof, tensors, {k for k, c in ties_all.items() if c > 1})
    out = []
    stage_units = _stage_units(prof, stage_params)
    for s, units in enumerate(stage_units):
        held = {id(tensors[n]): tensors[n] for n in stage_params[s] if n in tensors}  # a tied pair once per stage
        ties = {k: sum(any(id(tensors[n]) == k for n in names if n in tensors) for names in stage_params)
                for k in held}
        trainable = sum(t.numel() for t in held.values() if t.requires_grad)
        frozen = sum(t.numel() * t.element_size() for t in held.values() if not t.requires_grad)
        work = units + ([prof.rest] if s == last else [])
        frozen += sum(u.buffer_bytes for u in work)
        act = [u.activation_bytes for u in work]
        ckpt = [u.output_bytes if _inside(u.name, targets) else u.activation_bytes for u in work]
        tied = sum(t.numel() for k, t in held.items() if ties[k] > 1 and t.requires_grad)
        pipelined = len(stage_params) > 1
        out.append(StageMemory(
            trainable_elements=trainable, frozen_bytes=float(frozen), tied_elements=tied,
            tie_stages=max(ties.values(), default=1), activation_bytes=sum(act),
            checkpointed_bytes=sum(ckpt), backward_bytes=_backward_peak(work, act, s == last, relief),
            checkpointed_backward_bytes=_backward_peak(work, ckpt, s == last, relief),
            gather_elements=_gathered(units, layers, trainable, pipelined, tied),
            reduce_elements=0 if pipelined else max((u.param_bytes // 4 for u in units if _inside(u.name, layers)),
                                                    default=0),
            pipelined=pipelined, p2p_bytes=_p2p(stage_units, s), frontier_bytes=sum(u.frontier_bytes for u in work),
            recompute_flops=sum(u.forward_flops for u in units if _inside(u.name, targets)),
            train_flops=sum(u.train_flops for u in work)))
    return out


def with_weight_passes(plan: Plan, stages: list[StageMemory]) -> list[StageMemory]:
    """``stages`` with the gradients a zero-bubble schedule keeps for its waiting W passes in their backward peak
    (:func:`whale.plan.schedule.pending_weight_passes` of each stage's actions): with ``during`` W passes waiting
    while a B runs and ``after`` right after one, the peak is the larger of the B's own (``backward_bytes``)
    plus ``during`` frontiers, and the kept activations plus ``after`` frontiers. Stage 0 keeps none: its inputs
    need no gradient, so its B is empty and its W is the whole backward (:mod:`whale.parallel.pipeline`).
    Unchanged for schedules without W passes."""
    if plan.schedule != "ZB-H1":
        return stages
    actions = schedule_for(plan.schedule, plan.num_stages, plan.num_micro_batch, plan.virtual_stages,
                           plan.chunk_positions)
    out = []
    for s, st in enumerate(stages):
        during, after = pending_weight_passes(actions[s]) if s > 0 else (0, 0)
        f = st.frontier_bytes
        out.append(dataclasses.replace(
            st, backward_bytes=max(st.backward_bytes + during * f, st.activation_bytes + after * f),
            checkpointed_backward_bytes=max(st.checkpointed_backward_bytes + during * f,
                                            st.checkpointed_bytes + after * f)))
    return out


def fit_memory(plan: Plan, cluster: ClusterSpec, stages: list[StageMemory], global_batch: int, config: Config,
               floor: MemoryOptions, supported) -> MemoryChoice:
    """The plan balanced for ``cluster`` with the cheapest allowed memory techniques that fit.

    ``floor``: what the user set (kept); ``config.forbid``: what must not be added; ``supported(options)``:
    whether the runtime runs a combination. Each candidate's rows and ZeRO shares are chosen together within
    every rank's device and host memory (:func:`whale.planner.fit.fit_shares`).

    Raises:
        InfeasiblePlanError: no allowed combination fits (names the closest one, the rank, its device, the bytes
            and the fixes that apply).
    """
    stages = with_weight_passes(plan, stages)
    capacity = [memory_capacity(cluster, r) for r in range(plan.world_size)]
    host = [host_memory_capacity(cluster, r) for r in range(plan.world_size)]
    keep = config.load_shares is not None
    speeds = [d.flops("fp32" if plan.precision == "fp32" else "bf16") for d in cluster.devices()]
    ordered = apply_hardware(plan, cluster, None, keep_lane_weights=keep)  # device order, split shard sizes

    def place(opt: MemoryOptions) -> Plan:
        """The plan with ``opt`` recorded and its rows and ZeRO shares fitted within memory."""
        return fit_shares(ordered, stages, global_batch, opt, capacity, host, speeds, cluster.inter_node_bandwidth,
                          keep_lane_weights=keep)

    allowed = tuple(config.forbid) + tuple(f for f in ("zero3", "offload", "offload_params") if not supported(f))
    return choose_memory_options(place, stages, global_batch, floor, tuple(dict.fromkeys(allowed)), capacity, host,
                                 speeds, cluster.inter_node_bandwidth, tuple(d.name for d in cluster.devices()),
                                 plan.num_micro_batch)
