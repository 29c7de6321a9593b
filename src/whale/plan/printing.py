"""Readable printout of a :class:`~whale.plan.plan.Plan` (its ``__str__``).

Everything printed is read off the plan's fields or derived by the contract's own rules (the layout, and the
whole units of :func:`whale.plan.shares.whole_shares`); nothing here plans. The plan module imports this one, so
this one imports nothing of it, not even for type checkers: a plan is annotated ``_Plan`` (``Any``).
"""

from __future__ import annotations

import textwrap
from typing import Any

from whale.plan.shares import whole_shares
from whale.units import format_bytes

_Plan = Any  # a whale.plan.plan.Plan (plan.py imports this module for Plan.__str__; no import back)
_TaskGraph = Any  # one of its TaskGraphs


def _layout(plan: _Plan) -> str:
    """What runs where, in the field's words, e.g. ``2 pipeline stages x 2-way data parallel``."""
    k = plan.num_replicas
    kinds = {tg.kind for tg in plan.task_graphs}
    if plan.world_size == 1:
        return "1 device"
    if not plan.uniform_width:
        widths = "+".join(map(str, plan.stage_widths))
        text = f"{plan.num_stages} pipeline stages of different widths ({widths} devices, batch bridges between them)"
        return text + (f" x {k} replicas (nested data parallel)" if k > 1 else "")
    n = plan.stage_width
    if plan.colocated:
        what = " + ".join(dict.fromkeys(tg.kind for tg in plan.task_graphs))
        parts = [f"{what} on the same {n} device(s)"]
    elif plan.is_pipeline:
        parts = [f"{plan.num_stages} pipeline stages of {n} device(s)"]
    elif kinds == {"split"}:
        parts = [f"split over {n} device(s) (sharded operators)"]
    else:
        parts = [f"{n}-way data parallel"]
    if k > 1 and (plan.is_pipeline or plan.colocated or kinds == {"split"}):
        parts.append(f"x {k} replicas (nested data parallel)")
    elif k > 1:
        parts[0] = f"{n * k}-way data parallel"
    if n > 1 and any(tg.has_split for tg in plan.task_graphs) and not plan.colocated and kinds != {"split"}:
        parts.append("with split operators")
    return " ".join(parts)


def _header(plan: _Plan) -> str:
    mb = plan.num_micro_batch
    if plan.is_pipeline:
        steps = f"{mb} micro-batch(es), schedule {plan.schedule}" + \
            (f" with {plan.virtual_stages} chunks per stage (TaskGraph c on stage c % {plan.num_stages})"
             if plan.virtual_stages > 1 and not plan.chunk_positions else
             f" with {'+'.join(str(len(plan.chunks_of(s))) for s in range(plan.num_stages))} chunks per stage "
             f"(TaskGraph c on stage chunk_positions[c] = {list(plan.chunk_positions)})" if plan.virtual_stages > 1
             else "")
    else:
        steps = f"{mb} micro-batches (gradient accumulation)" if mb > 1 else "1 micro-batch"
    dtype = "" if plan.precision == "fp32" else \
        f"; {plan.precision} autocast" + " + dynamic loss scaling" * (plan.precision == "fp16")
    host = "" if plan.offload == "none" else f"; offload {plan.offload} to host memory (optimizer step on the host)"
    seq = "; sequence parallel in split regions" if plan.sequence_parallel else ""
    return f"Whale plan: {plan.world_size} rank(s) = {_layout(plan)}; {steps}{dtype}{host}{seq}"


def _wrapped(prefix: str, names, width: int = 110) -> list[str]:
    """``prefix`` then the names, wrapped under the prefix (or, after a long prefix, indented 4 spaces)."""
    indent = len(prefix) if len(prefix) <= width // 2 else 4
    text = ", ".join(names) if names else "-"
    lines = textwrap.wrap(prefix + text, width=width, subsequent_indent=" " * indent, break_on_hyphens=False)
    return lines or [prefix + "-"]


def _task_graph_rows(plan: _Plan, tg: _TaskGraph) -> list[str]:
    stage = 0 if plan.colocated else plan.position_of(tg.index)  # interleaved: chunk c on its stage
    ranks = ",".join(map(str, plan.stage_ranks(stage)))
    lead = f"{tg.index:>3} {tg.kind:<10} {tg.device_count:>3}  {ranks:<16} {tg.num_params:>12,}  "
    rows = _wrapped(lead, tg.modules)
    for nest in tg.nested:
        rows += _wrapped(f"{'':>4}  nested {nest.kind}({nest.device_count or tg.device_count}): ", nest.modules)
    return rows


def format_plan(plan: _Plan) -> str:
    """A table of TaskGraphs (kind, devices per replica, ranks, parameters, modules), then the lanes' shares,
    the stage cut, the devices and what is shared or noted."""
    lines = [_header(plan),
             f"{'TG':>3} {'kind':<10} {'dev':>3}  {'ranks':<16} {'params':>12}  modules holding its tensors"]
    for tg in plan.task_graphs:
        lines += _task_graph_rows(plan, tg)
    if any(cut.units for cut in plan.stage_cuts):
        lines.append("(the hardware-aware planner re-cut the stages by device speed and memory; the annotations "
                     "fixed the stage count)")
    lines.extend(_shard_rows(plan))
    lines.extend(_expert_rows(plan))
    lines.extend(_lane_rows(plan))
    lines.extend(_zero_rows(plan))
    if plan.stage_cuts:
        how = "torch.export (non-strict), from the sample batch's shapes" if plan.capture == "export" else \
            "torch.fx.symbolic_trace"
        lines.append(f"graph captured with {how}")
    for s, cut in enumerate(plan.stage_cuts):
        sizes = f"{len(cut.nodes)} graph nodes, {len(cut.params)} parameters, {len(cut.buffers)} buffers"
        what = f"chunk {s} (stage {plan.position_of(s)})" if plan.virtual_stages > 1 else f"stage {s}"
        if cut.units:
            lines += _wrapped(f"{what} ({sizes}), cut hardware-aware by speed and memory: ", cut.units)
        else:
            lines.append(f"{what} ({sizes}), cut as annotated")
    if plan.virtual_stages > 1:
        lines.extend(_stage_chunk_rows(plan))
    if plan.activation_checkpoint:
        lines += _wrapped("activation checkpointing (recomputed in backward): ", plan.activation_checkpoint)
    if plan.devices:
        lines.extend(_device_rows(plan))
    for sp in plan.shared_params:
        lines.append(f"tied across stages {', '.join(map(str, sp.stages))} (gradients summed): "
                     + " = ".join(sp.names))
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def _chunks_of(plan: _Plan, stage: int) -> str:
    """An interleaved stage's chunks and their unit counts (``0 (4 units), 2 (2 units)``), or its chunk
    indices when the cut is as annotated."""
    cuts = plan.stage_cuts
    return ", ".join(f"{c} ({len(cuts[c].units)} units)" if c < len(cuts) and cuts[c].units else str(c)
                     for c in plan.chunks_of(stage))


def _stage_chunk_rows(plan: _Plan) -> list[str]:
    """Per stage of an interleaved plan, its device types and chunks with their units, e.g. ``stage 0
    (V100-32GB): 3 chunks: 0 (units emb..blocks.1), 2 (units blocks.4..blocks.5), 4 (units blocks.7)``."""
    rows = []
    for s in range(plan.num_stages):
        kinds = " + ".join(dict.fromkeys(plan.devices[r] for r in plan.stage_ranks(s))) if plan.devices else ""
        parts = []
        for c in plan.chunks_of(s):
            units = plan.stage_cuts[c].units if c < len(plan.stage_cuts) else ()
            span = units[0] if len(units) == 1 else f"{units[0]}..{units[-1]}" if units else ""
            parts.append(f"{c} (units {span})" if units else str(c))
        many = f"{len(parts)} chunk" + "s" * (len(parts) != 1)
        rows += _wrapped(f"stage {s}{f' ({kinds})' if kinds else ''}: {many}: ", parts)
    return rows


def _device_rows(plan: _Plan) -> list[str]:
    """Per rank: device type, stage, lane, batch share, predicted busy share (and memory), and under an
    interleaved plan its chunks with their units."""
    mem, chunks = bool(plan.predicted_memory), plan.virtual_stages > 1
    rows = [f"{'rank':>4} {'device':<16} {'stage':>5} {'lane':>4} {'share':>7} {'busy*':>6}"
            + (f" {'memory**':>10}" if mem else "") + ("  chunks (units)" if chunks else "")]
    for r in range(plan.world_size):
        stage, lane = plan.coords(r)
        util = f"{plan.predicted_utilization[r]:.0%}" if plan.predicted_utilization else "-"
        weights = plan.weights_of(stage)
        rows.append(f"{r:>4} {plan.devices[r]:<16} {stage:>5} {lane:>4} {weights[lane] / sum(weights):>7.1%} "
                    f"{util:>6}" + (f" {format_bytes(plan.predicted_memory[r]):>10}" if mem else "")
                    + (f"  {_chunks_of(plan, stage)}" if chunks else ""))
    rows.append("* busy: predicted share of the step this rank computes (its compute time over the slowest "
                "rank's; 100% = the bottleneck)")
    if mem:
        rows.append("** memory: the planner's predicted peak (parameters, gradients, optimizer state, activations "
                    "in flight) at the sample batch's size")
    return rows


def _lane_rows(plan: _Plan) -> list[str]:
    """Each lane's share of every micro-batch: one list for stages of one width, per stage otherwise."""
    if plan.uniform_width:
        if plan.num_lanes == 1:
            return []
        wsum = sum(plan.lane_weights)
        return ["batch share per data-parallel lane: "
                + "  ".join(f"lane {i}: {w / wsum:.1%}" for i, w in enumerate(plan.lane_weights))]
    shares = []
    for s in range(plan.num_stages):
        weights = plan.weights_of(s)
        shares += [f"stage {s} lane {i}: {w / sum(weights):.1%}" for i, w in enumerate(weights)]
    rows = _wrapped("batch share per data-parallel lane, per stage (rows re-split between stages): ", shares)
    for s in range(plan.num_stages - 1):
        n, m = plan.lanes_of(s), plan.lanes_of(s + 1)
        how = "gathered" if m < n else "scattered" if m > n else "re-split"
        rows.append(f"batch bridge stage {s} -> {s + 1}: {n} lane(s) -> {m} lane(s), rows {how} (each lane sends "
                    "each lane of the next stage the rows they share; gradients come back the same way)")
    return rows


def _shard_rows(plan: _Plan) -> list[str]:
    """Relative shard weights of each split over several devices (each sharded dim is cut into whole
    elements by :func:`whale.plan.shares.whole_shares` of these weights)."""
    rows = []
    for tg in plan.task_graphs:
        for what, weights in [(f"TG {tg.index} split", tg.shard_weights)] + [
                (f"TG {tg.index} nested split", n.shard_weights) for n in tg.nested]:
            if len(weights) > 1:
                tot = sum(weights)
                rows.append(f"{what} shard shares: " + "  ".join(f"{w / tot:.1%}" for w in weights))
    return rows


def _expert_rows(plan: _Plan) -> list[str]:
    """Per MoE layer under split: experts per device of its split group: whole units of its shard weights, at
    least one each (:func:`whale.plan.shares.whole_shares`, as the runtime cuts the stacked expert tensors and
    :func:`whale.planner.experts.expert_counts` places them)."""
    rows = []
    for layer in plan.moe_layers:
        weights = next((w for s in range(plan.num_stages) for name, w in plan.split_targets(s)
                        if name == layer.module), ())
        stage = next(s for s in range(plan.num_stages) if layer.module in dict(plan.split_targets(s)))
        n = plan.stage_width if plan.uniform_width else 1
        counts = whole_shares(layer.num_experts, list(weights) or [1.0] * n, min_share=1)
        how = "hardware-aware" if len(set(weights)) > 1 else "equal"
        ranks = [plan.rank_of(stage, j) for j in range(n)]
        where = [f"{c} (rank {r}{' ' + plan.devices[r] if plan.devices else ''})" for c, r in zip(counts, ranks,
                                                                                                  strict=True)]
        rows += _wrapped(f"MoE {layer.module!r}: {layer.num_experts} experts, top-{layer.top_k}, expert parallel over "
                         f"{n} device(s) per split group; experts per device ({how}): ", where)
    return rows


def _zero_rows(plan: _Plan) -> list[str]:
    """The ZeRO stage and, per stage with several lanes, each lane's share of the sharded state."""
    if not plan.zero:
        return []
    what = ("optimizer state", "optimizer state and gradients",
            "optimizer state, gradients and parameters")[plan.zero - 1]
    shares = []
    for s in range(plan.num_stages):
        w = plan.zero_weights[s] if plan.zero_weights else (1.0,) * plan.lanes_of(s)
        if len(w) > 1:
            shares += [f"stage {s} lane {i}: {x / sum(w):.1%}" for i, x in enumerate(w)]
    how = "by device free memory" if plan.zero_weights else "equal"
    return _wrapped(f"ZeRO-{plan.zero}: {what} sharded over each stage's lanes ({how}): ", shares)
