"""Readable printout of a :class:`~whale.plan.plan.Plan`."""

from __future__ import annotations

from whale.plan.plan import Plan


def _short(names: list[str], width: int = 48) -> str:
    text = ", ".join(names) if names else "-"
    return text if len(text) <= width else text[: width - 3] + "..."


def format_plan(plan: Plan) -> str:
    """A table of TaskGraphs (kind, devices, ranks, modules, params), lanes with their load shares, and the
    schedule line."""
    kind = "pipeline" if plan.is_pipeline else "data parallel"
    lines = [
        f"Whale plan: world {plan.world_size} = {plan.num_replicas} replica(s) x "
        f"{plan.num_stages * plan.stage_width} devices  [{kind}, {plan.num_micro_batch} micro-batch(es), "
        f"schedule {plan.schedule}]",
        f"{'TG':>3} {'kind':<10} {'dev':>3}  {'ranks':<16} {'params':>10}  modules",
    ]
    for tg in plan.task_graphs:
        ranks = ",".join(map(str, plan.stage_ranks(0 if plan.colocated else tg.index)))
        lines.append(f"{tg.index:>3} {tg.kind:<10} {tg.device_count:>3}  {ranks:<16} {tg.num_params:>10,}  "
                     f"{_short(tg.modules)}")
        for nest in tg.nested:
            lines.append(f"{'':>4}  nested {nest['kind']}({nest.get('device_count')}): {_short(nest['modules'])}")
    wsum = sum(plan.lane_weights)
    shares = "  ".join(f"lane {i}: {w / wsum:.1%}" for i, w in enumerate(plan.lane_weights))
    lines.append(f"load shares per data-parallel lane: {shares}")
    for s, names in enumerate(plan.stage_layers):
        lines.append(f"stage {s} cut (hardware-aware): {_short(names, 90)}")
    if plan.devices:
        lines.extend(_device_rows(plan))
    if plan.shared_params:
        lines.append("shared across stages (gradients summed): " + "; ".join("=".join(g) for g in plan.shared_params))
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def _device_rows(plan: Plan) -> list[str]:
    """Per rank: device type, stage, lane, batch share and predicted utilization."""
    wsum = sum(plan.lane_weights)
    rows = [f"{'rank':>4} {'device':<16} {'stage':>5} {'lane':>4} {'share':>7} {'pred. util':>10}"]
    for r in range(plan.world_size):
        stage, lane = plan.coords(r)
        util = f"{plan.predicted_utilization[r]:.0%}" if plan.predicted_utilization else "-"
        rows.append(f"{r:>4} {plan.devices[r]:<16} {stage:>5} {lane:>4} {plan.lane_weights[lane] / wsum:>7.1%} "
                    f"{util:>10}")
    for tg in plan.task_graphs:
        if tg.shard_weights:
            tot = sum(tg.shard_weights)
            rows.append(f"TG {tg.index} shard shares: " + "  ".join(f"{w / tot:.1%}" for w in tg.shard_weights))
    return rows
