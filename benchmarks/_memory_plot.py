"""The memory benchmark's picture: per-rank device memory by category for each configuration, with the
planner's prediction and the capacity marked (matplotlib, Agg)."""

from __future__ import annotations

CATS = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")


def plot_memory(configs: dict[str, list[dict]], path: str) -> None:
    """One panel per configuration: stacked bars of each rank's bytes at its peak (MiB) by category, a black
    tick at the predicted peak, a red tick at the capacity when it is in range, host bytes as a hatched bar.

    Args:
        configs: configuration name -> rows of :func:`benchmarks._memory_runs.rank_rows`.
        path: PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(configs)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 4.2), sharey=True, squeeze=False)
    colors = plt.get_cmap("tab10").colors
    mib = 2.0 ** 20
    for ax, (name, rows) in zip(axes[0], configs.items(), strict=True):
        xs = list(range(len(rows)))
        bottom = [0.0] * len(rows)
        for i, cat in enumerate(CATS):
            vals = [(r["bytes_at_peak"] or {}).get(cat, 0) / mib for r in rows]
            ax.bar(xs, vals, bottom=bottom, color=colors[i], width=0.6, label=cat if ax is axes[0][0] else None)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        host = [(r.get("host_peak_bytes") or 0) / mib for r in rows]
        if any(host):
            ax.bar([x + 0.35 for x in xs], host, width=0.25, color="none", edgecolor="grey", hatch="//",
                   label="host (offload)" if ax is axes[0][0] else None)
        for x, r in zip(xs, rows, strict=True):
            if r.get("predicted_bytes"):
                ax.hlines(r["predicted_bytes"] / mib, x - 0.35, x + 0.35, colors="black", linewidth=2)
        ax.set_title(name.replace("_", " "), fontsize=9)
        ax.set_xticks(xs, [f"r{r['rank']}\n{r['device'].split('-')[0]}" for r in rows], fontsize=8)
    axes[0][0].set_ylabel("MiB at the rank's peak")
    fig.legend(loc="upper center", ncol=7, fontsize=8, frameon=False)
    fig.text(0.5, 0.005, "black line: planner's predicted peak (whale.planner.memory)", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
