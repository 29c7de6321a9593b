"""Printed table and PNG of :mod:`benchmarks.heterogeneous` (every line says EMULATED)."""

from __future__ import annotations

BANNER = ("EMULATED heterogeneous cluster: CPU ranks imitate V100/P100 speed ratios (and scaled memory); "
          "numbers are emulation, not real GPUs")


def report(res: dict) -> str:
    """The printed table (every line block says EMULATED)."""
    lines = ["", "=" * 100, BANNER, "=" * 100, ""] + _dp_lines(res)
    lines += ["", "Pipelines (EMULATED): 1F1B; speedup = uniform step time / hardware-aware step time",
              f"{'case':<5} {'stage devices':<22} {'uniform cut':<14} {'aware cut':<14} {'best cut':<14} "
              f"{'measured':>8} {'ideal':>7} {'fluid':>7} {'1F1B bound':>10} {'meas/ideal':>10} {'meas/bound':>10}"]
    for k, r in res["pp"].items():
        a = r["analysis"]
        devs = ",".join(r["devices"][i].split("-")[0] for i in r["aware"]["stage_ranks"])
        lines.append(f"{k:<5} {devs:<22} {str(r['uniform']['counts']):<14} {str(r['aware']['counts']):<14} "
                     f"{str(a['best_counts']):<14} {a['measured_speedup']:>8.3f} {a['ideal_speedup']:>7.3f} "
                     f"{a['fluid_speedup']:>7.3f} {a['bound_speedup']:>10.3f} {a['fraction_of_ideal']:>10.3f} "
                     f"{a['fraction_of_bound']:>10.3f}")
    m, ma = res["memory"], res["memory"]["analysis"]
    gb = 1e9
    lines += ["", f"Memory-bound data parallel (EMULATED, memory x {m['memory_scale']:.3g}): "
              f"{' + '.join(m['devices'])}, batch {m['batch']}",
              f"  capacity (GB, scaled):        {[round(c / gb, 4) for c in ma['capacity_bytes']]}",
              f"  FLOPS-proportional rows {ma['flops_rows']} need {[round(c / gb, 4) for c in ma['flops_need_bytes']]}"
              f" GB -> {'OVERFLOWS' if ma['flops_overflow'] else 'fits'}"]
    if "error" in m:
        lines.append(f"  hardware-aware plan FAILED: {m['error']}")
    else:
        peak = [round(c / gb, 4) if c is not None else None for c in ma["plan_need_bytes"]]
        lines.append(
            f"  hardware-aware plan rows {ma['plan_rows']}, measured peak {peak} GB (planner predicted "
            f"{[round(c / gb, 4) for c in ma.get('plan_predicted_bytes') or []]}) -> "
            f"{'fits' if ma['plan_fits'] else 'OVERFLOWS: ' + str(ma.get('plan_measured_error'))}; ran at "
            f"{m['aware']['throughput']:.1f} samples/s (FLOPS shares, memory not enforced by emulation: "
            f"{m['flops_shares']['throughput']:.1f})")
    lines += ["", "Summary (EMULATED):"]
    for key in ("dp_ratio_to_ideal", "dp_ratio_to_ideal_equal_rows", "dp_ratio_to_ideal_idle_host",
                "dp_ratio_to_ideal_idle_host_job_rows",
                "dp_speedup_over_equal", "dp_ideal_speedup", "dp_fraction_of_ideal_speedup",
                "pp_speedup_over_uniform", "pp_ideal_speedup", "pp_bound_speedup", "pp_fraction_of_ideal",
                "pp_fraction_of_bound"):
        v = res[key]
        text = ", ".join(f"{k} {x:.3f}" for k, x in v.items()) if isinstance(v, dict) else f"{v:.3f}"
        lines.append(f"  {key:<30} {text}")
    for goal, ok in res["goals"].items():
        lines.append(f"  goal {goal:<62} {'met' if ok else 'NOT MET'}")
    if res.get("quick"):
        lines.append("  --quick is a smoke test (tiny model, per-step overhead dominates): goals are not meaningful")
    lines.append(f"  wall time {res['wall_s']:.0f} s on {res['cores']} cores, emulated as "
                 f"{res['config']['emulation_cores']} core(s)")
    return "\n".join(lines)


def _dp_lines(res: dict) -> list[str]:
    """The data-parallel block of :func:`report`."""
    lines = ["Data parallel (EMULATED): throughput in samples/s; ideal = sum of each device's standalone throughput",
             "  on the rows it trains in the job, all devices at once; (equal rows) on batch/world rows, all at once;",
             "  (idle host) on batch/world rows, one device at a time",
             f"  rows per step over {res['config'].get('dp_micro', 1)} micro-batch(es), one gradient all-reduce "
             "per step",
             f"{'case':<6} {'devices':<20} {'equal':>7} {'aware':>7} {'ideal':>7} {'aware/ideal':>11} "
             f"{'(equal rows)':>12} {'(idle host)':>11} {'speedup':>8} {'ideal sp.':>9} {'sp./ideal':>9}  "
             "rows equal -> aware"]
    for k, r in res["dp"].items():
        devs = ",".join(n.split("-")[0] for n in r["devices"])
        lines.append(f"{k:<6} {devs:<20} {r['equal']['throughput']:>7.1f} {r['aware']['throughput']:>7.1f} "
                     f"{r['ideal_throughput']:>7.1f} {r['ratio_to_ideal']:>11.3f} "
                     f"{r['ratio_to_ideal_equal_rows']:>12.3f} {r['ratio_to_ideal_idle_host']:>11.3f} "
                     f"{r['speedup_over_equal']:>8.3f} {r['ideal_speedup']:>9.3f} "
                     f"{r['fraction_of_ideal_speedup']:>9.3f}  {r['equal']['rows']} -> {r['aware']['rows']}")
    lines.append("emulation check: standalone speed ratio fast/slow device measured "
                 + ", ".join(f"{k} {r['speed_ratio_measured']:.3f}" for k, r in res["dp"].items())
                 + f" vs declared {next(iter(res['dp'].values()))['speed_ratio_declared']:.3f}")
    return lines


def plot(res: dict, path: str) -> None:
    """Bar charts: DP throughput (equal / aware / ideal) and PP speedups (measured / ideal / bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = list(res["dp"])
    w = 0.2
    series = (("equal", "equal shares"), ("aware", "hardware-aware"), ("ideal_throughput", "ideal (job rows)"),
              ("ideal_throughput_idle_host", "ideal (idle host)"))
    for i, (name, label) in enumerate(series):
        vals = [res["dp"][k][name] if name.startswith("ideal") else res["dp"][k][name]["throughput"] for k in keys]
        ax1.bar([j + (i - 1.5) * w for j in range(len(keys))], vals, w, label=label)
    ax1.set_xticks(range(len(keys)), [f"{k}: " + ",".join(n.split("-")[0] for n in res["dp"][k]["devices"])
                                      for k in keys], fontsize=8)
    ax1.set_ylabel("samples/s (EMULATED)")
    ax1.set_title("Data parallel, EMULATED V100/P100")
    ax1.legend(loc="lower center", fontsize=8)
    keys = list(res["pp"])
    for i, (name, label) in enumerate((("measured_speedup", "measured"), ("ideal_speedup", "ideal (best cut)"),
                                       ("bound_speedup", "1F1B bound"))):
        ax2.bar([j + (i - 1) * w for j in range(len(keys))], [res["pp"][k]["analysis"][name] for k in keys], w,
                label=label)
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xticks(range(len(keys)), [f"{k}: {res['pp'][k]['stages']} stages" for k in keys])
    ax2.set_ylabel("speedup over uniform cuts")
    ax2.set_title("Pipeline, EMULATED V100/P100")
    ax2.legend(loc="lower center", fontsize=8)
    fig.suptitle("EMULATED heterogeneous cluster (CPU ranks imitate GPU speed ratios) - not real GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


