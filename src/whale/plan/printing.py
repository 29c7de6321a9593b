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
        ranks = ",".join(map(str, plan.stage_ranks(tg.index)))
        lines.append(f"{tg.index:>3} {tg.kind:<10} {tg.device_count:>3}  {ranks:<16} {tg.num_params:>10,}  "
                     f"{_short(tg.modules)}")
        for nest in tg.nested:
            lines.append(f"{'':>4}  nested {nest['kind']}({nest.get('device_count')}): {_short(nest['modules'])}")
    wsum = sum(plan.lane_weights)
    shares = "  ".join(f"lane {i}: {w / wsum:.1%}" for i, w in enumerate(plan.lane_weights))
    lines.append(f"load shares per data-parallel lane: {shares}")
    if plan.shared_params:
        lines.append("shared across stages (gradients summed): " + "; ".join("=".join(g) for g in plan.shared_params))
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)
