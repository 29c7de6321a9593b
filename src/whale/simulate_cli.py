"""``whale simulate``: plan a model (as ``whale plan``) and predict its training step without running it.

Prints the plan (as ``whale plan`` and ``engine.plan`` do), then the predicted step time, per stage the
forward/backward seconds of one micro-batch, per rank the busy and idle seconds, busy share and peak memory,
communication seconds by kind, and a warning when the plan's and the simulation's busy shares differ by more
than :data:`BUSY_WARN`; writes a timeline PNG (one row per rank, labelled with its device, stage and lane:
forward, backward, gradient sync and optimizer boxes; gaps are idle). Takes every ``whale plan`` argument.

The prediction (:func:`whale.calibration.predict.predict_model`) uses this machine's calibration: each layer-unit
type of the model is timed once (cached in ``~/.cache/whale/calibration.json`` or ``$WHALE_CALIBRATION``) and
gloo's local latency and bandwidth are measured once (two processes, a few seconds). On an emulated cluster
(``emulate: true``) compute is stretched to the declared speeds and communication is local gloo, as the run
would be; on a real cluster the declared links and peaks are used (``gpu_efficiency`` of the calibration).
"""

from __future__ import annotations

import argparse
import json
import sys

from whale.frontend.hwplan import sample_rows
from whale.frontend.planning import resolve_cluster
from whale.plan_cli import _make_plan, _value, add_plan, input_error, load_factory
from whale.planner.desc_cli import run_desc

COLORS = {"F": "#4c72b0", "B": "#dd8452", "sync": "#55a868", "optim": "#8172b3"}
BUSY_WARN = 0.10
"""A rank's busy share (compute over the busiest rank's) predicted by the plan and by the simulation may differ
by this much (absolute, 10 points) before ``whale simulate`` warns."""


def add_simulate(sub: argparse._SubParsersAction) -> None:
    """Register ``whale simulate`` (the arguments of ``whale plan``, plus ``--png`` and ``--cores``)."""
    holder = argparse.ArgumentParser(add_help=False).add_subparsers()
    add_plan(holder)
    parent = holder.choices["plan"]
    p = sub.add_parser("simulate", parents=[parent], conflict_handler="resolve", description=__doc__,
                       help="predict a model's step time, idle time and memory per rank (no processes)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--png", default="simulate.png", help="timeline PNG to write ('' for none)")
    p.add_argument("--cores", type=float, default=None,
                   help="emulated clusters: CPU cores the ranks share (default WHALE_EMULATION_CORES or all)")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON instead of the table")
    p.set_defaults(func=run_simulate)


def format_prediction(pred, plan) -> str:
    """The prediction as a table (seconds, MB)."""
    lines = [("EMULATED cluster: compute stretched to the declared speeds, communication = local gloo (calibrated)"
              if pred.emulated else "cluster as declared (links, peaks x calibrated efficiency)"),
             f"predicted step: {pred.step:.4f} s (schedule {pred.schedule:.4f} s; {plan.num_stages} stage(s), "
             f"{plan.num_micro_batch} micro-batch(es), {plan.schedule})",
             " stage  fwd s/mb  bwd s/mb"]
    lines += [f" {s:>5}  {f:>8.4f}  {b:>8.4f}" for s, (f, b) in enumerate(zip(pred.stage_fwd, pred.stage_bwd,
                                                                                strict=True))]
    lines.append(" rank  device           busy s   idle s  idle %  busy*  peak MB")
    shares = busy_shares(pred)
    for r in range(plan.world_size):
        dev = plan.devices[r] if plan.devices else "-"
        peak = f"{pred.peak_bytes[r] / 1e6:8.2f}" if pred.peak_bytes else "       -"
        lines.append(f" {r:>4}  {dev:<15} {pred.rank_busy[r]:>7.4f}  {pred.rank_idle[r]:>7.4f}  "
                     f"{pred.rank_idle[r] / pred.step:>6.1%}  {shares[r]:>5.0%}  {peak}")
    lines.append("* busy: compute seconds over the busiest rank's (the plan's busy* column, simulated)")
    lines.append("communication s: " + ", ".join(f"{k} {v:.4f}" for k, v in pred.comm.items()))
    return "\n".join(lines)


def busy_shares(pred) -> list[float]:
    """Per rank, simulated compute seconds over the busiest rank's, in [0, 1] (the plan's
    ``predicted_utilization`` measured the same way)."""
    top = max(pred.rank_busy) or 1.0
    return [b / top for b in pred.rank_busy]


def busy_disagreement(pred, plan, rows: float, threshold: float = BUSY_WARN) -> str | None:
    """A one-line warning when the simulation's busy share of some rank (:func:`busy_shares`) differs from the
    plan's (``plan.predicted_utilization``) by more than ``threshold``, naming the stages, ranks, devices, both
    numbers and the likely reason; ``None`` when they agree or the plan predicts none. ``rows``: rows per
    micro-batch and lane."""
    if not plan.predicted_utilization:
        return None
    sim = busy_shares(pred)
    groups: dict[tuple, list[int]] = {}
    for r in range(plan.world_size):
        want = plan.predicted_utilization[r]
        if abs(sim[r] - want) > threshold:
            dev = plan.devices[r] if plan.devices else "-"
            groups.setdefault((plan.coords(r)[0], dev, round(want, 2), round(sim[r], 2)), []).append(r)
    if not groups:
        return None
    where = "; ".join(f"stage {s} rank(s) {','.join(map(str, ranks))} ({dev}): plan {want:.0%}, simulation {got:.0%}"
                      for (s, dev, want, got), ranks in sorted(groups.items()))
    why = ("each stage's FLOPs at its devices' peak FLOP/s, linear in the rows" if plan.stage_flops else
           "every stage as equal work (the plan was made without a profile)")
    return (f"warning: the plan and the simulation disagree on the busy share (compute over the busiest rank's) "
            f"by more than {threshold:.0%}: {where}. Likely reason: the plan weighs {why}; the simulation uses "
            f"this machine's calibrated seconds, with fixed costs per layer call and per segment that at "
            f"{rows:.3g} row(s) per micro-batch weigh most on the stages with the most layers; the plan's stage cut "
            f"balances FLOPs, not these seconds")


def row_labels(plan, ranks: int) -> list[str]:
    """The timeline's row labels, e.g. ``rank 2 · P100-16GB · stage 1 lane 0`` (no device without a cluster)."""
    out = []
    for r in range(ranks):
        stage, lane = plan.coords(r)
        dev = f" · {plan.devices[r]}" if plan.devices else ""
        out.append(f"rank {r}{dev} · stage {stage} lane {lane}")
    return out


def plot_timeline(pred, path: str, title: str = "", plan=None) -> list[str]:
    """One row per rank: F/B/sync/optim boxes over the step (matplotlib, Agg); gaps are idle time. Rows are
    labelled with rank, device, stage and lane (:func:`row_labels`; rank only without ``plan``); returns the
    labels."""
    import matplotlib  # lazy: a heavy optional dependency, needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = 1 + max(r for r, *_ in pred.timeline)
    fig, ax = plt.subplots(figsize=(10, 0.6 * ranks + 1.5))
    for r, kind, label, a, e in pred.timeline:
        if e > a:
            ax.broken_barh([(a, e - a)], (r - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white", linewidth=0.5)
            if kind in "FB" and (e - a) > pred.step / 60:
                ax.text((a + e) / 2, r, label[1:], ha="center", va="center", fontsize=6, color="white")
    labels = row_labels(plan, ranks) if plan is not None else [f"rank {r}" for r in range(ranks)]
    ax.set_yticks(range(ranks), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, pred.step)
    ax.set_xlabel("seconds (white = idle)")
    ax.set_title(title or f"predicted step {pred.step:.4f} s" + (" (EMULATED)" if pred.emulated else ""))
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


def run_simulate(ns: argparse.Namespace) -> int:
    """Plan, predict, print, plot; a bad input prints one line and returns 2."""
    # CLI start-up: whale.calibration loads whale.runtime, which `whale plan` (same CLI module tree) must not load
    from whale.calibration.predict import predict_model

    error = input_error(ns)
    if error:
        print(f"whale simulate: error: {error}", file=sys.stderr)
        return 2
    if ns.model_desc:  # a described model: the step-time model alone, no per-unit timing run
        return run_desc(ns, simulate=True)
    try:
        plan = _make_plan(ns)
        pairs = [kv.split("=", 1) for kv in ns.args]
        made = load_factory(ns.model)(**{k: _value(v) for k, v in pairs})
        if not isinstance(made, tuple) or len(made) < 2:
            raise ValueError(f"--model {ns.model} must return (model, sample_batch[, loss_fn]) to simulate: the "
                             "prediction needs a sample batch to profile and time the model")
        model, sample, loss = (tuple(made) + (None,))[:3]
        if not ns.json:  # the plan simulated, before the (first time: minutes of) calibration
            print(f"{plan}\n", flush=True)
        cluster = resolve_cluster(ns.cluster, ns.world) if ns.cluster else None
        pred = predict_model(model, plan, sample, loss, cluster, cores=ns.cores)
    except (ValueError, TypeError) as exc:
        print(f"whale simulate: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(pred.to_dict(), indent=2) if ns.json else format_prediction(pred, plan))
    rows = sample_rows(sample) / plan.num_micro_batch / max(plan.lanes_of(s) for s in range(plan.num_stages))
    warning = busy_disagreement(pred, plan, rows)
    if warning:
        print(warning, file=sys.stderr if ns.json else sys.stdout)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(plan.to_json(indent=2) + "\n")
    if ns.png:
        plot_timeline(pred, ns.png, plan=plan)
        if not ns.json:
            print(f"timeline written to {ns.png}")
    return 0
