"""Plots: per case, bars of the figures and the guest's timeline."""
import os

from tsubame_bench import HarnessError

VMM_COLORS = {"qemu": ["#4c72b0", "#64b5cd", "#8172b3", "#937860", "#8c8c8c"],
              "tsubame": ["#dd8452", "#c44e52", "#da8bc3", "#ccb974"]}
from tsubame_bench.tables import fmt, group_runs, qemu_label, summarize


def config_colors(configs_with_vmm):
    """{config: color}: blues for QEMU configs, oranges/reds for tsubame ones."""
    used = {"qemu": 0, "tsubame": 0}
    colors = {}
    for name, vmm in configs_with_vmm:
        palette = VMM_COLORS[vmm]
        colors[name] = palette[used[vmm] % len(palette)]
        used[vmm] += 1
    return colors


def timeline_rates(points, span=4):
    """[(t, ops)] -> [(t, ops/s)] with each rate over `span` consecutive line gaps (smooths the 50 ms cadence)."""
    rates = []
    for i in range(span, len(points)):
        t0, o0 = points[i - span]
        t1, o1 = points[i]
        if t1 > t0:
            rates.append(((t0 + t1) / 2, (o1 - o0) / (t1 - t0)))
    return rates


def plot_case(case, runs, out_dir):
    """Writes <case>-bars.png and <case>-timeline.png; returns their paths."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HarnessError("matplotlib missing: pip install -r bench/requirements.txt (or pass --no-plots)") from None

    configs = group_runs(runs)[case]
    colors = config_colors([(name, rs[0]["vmm"]) for name, rs in configs.items()])
    names = list(configs)
    summaries = {n: summarize(rs) for n, rs in configs.items()}

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        (axes[0][0], "total time (s)", [("total_time_s", 1, "")]),
        (axes[0][1], "downtime (ms)", [("vmm_downtime_ms", 1, "VMM"), ("guest_downtime_ms", 1, "guest")]),
        (axes[1][0], "MiB on the wire", [("bytes_on_wire", 1 / 2**20, "")]),
        (axes[1][1], "CPU-seconds", [("cpu_source_s", 1, "src"), ("cpu_source_migration_s", 1, "src w/o vCPU"),
                                     ("cpu_destination_s", 1, "dst")]),
    ]
    for ax, title, series in panels:
        width = 0.8 / len(series)
        for j, (key, scale, label) in enumerate(series):
            for i, name in enumerate(names):
                value = summaries[name][key]
                x = i + (j - (len(series) - 1) / 2) * width
                if value is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
                    continue
                ax.bar(x, value * scale, width * 0.95, color=colors[name], alpha=1.0 - 0.3 * j,
                       edgecolor="black", linewidth=0.5, hatch=["", "//", ".."][j])
                ax.text(x, value * scale, f"{value * scale:.3g}" + (f"\n{label}" if label else ""),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        # "qemu-multifd-zstd" -> "qemu\nmultifd-zstd": six names side by side fit.
        ax.set_xticklabels([f"{n.replace('-', chr(10), 1)}\n({summaries[n]['completed']}/{summaries[n]['runs']} done)"
                            for n in names], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.25)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{case}: medians over completed runs (tsubame vs {qemu_label(runs)})", fontsize=11)
    fig.tight_layout()
    bars_path = os.path.join(out_dir, f"{case}-bars.png")
    fig.savefig(bars_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.4 * len(names) + 0.8), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        run = configs[name][0]  # first repetition
        src = timeline_rates(run["timeline"].get("source", []))
        dst = timeline_rates(run["timeline"].get("destination", []))
        if src:
            ax.plot([t for t, _ in src], [r / 1e6 for _, r in src], color=colors[name], label="source")
        if dst:
            ax.plot([t for t, _ in dst], [r / 1e6 for _, r in dst], color="black", label="destination")
        ax.axvline(0, color="gray", linestyle="--", linewidth=1)
        if run.get("migration_end_s") is not None:
            ax.axvline(run["migration_end_s"], color="gray", linestyle=":", linewidth=1)
        gd = run.get("guest_downtime_ms")
        ax.set_title(f"{name} (run {run['repetition']}): {run['status']}, total {fmt(run.get('total_time_s'))} s, "
                     f"guest downtime {fmt(gd, 1, '{:.0f}')} ms", fontsize=9)
        ax.set_ylabel("Mops/s", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[-1, 0].set_xlabel("seconds from migration start (dashed: start, dotted: end)")
    fig.suptitle(f"{case}: guest throughput across the migration", fontsize=11)
    fig.tight_layout()
    timeline_path = os.path.join(out_dir, f"{case}-timeline.png")
    fig.savefig(timeline_path, dpi=110)
    plt.close(fig)
    paths = [bars_path, timeline_path]

    # Bytes sent per iteration (the SPP paper's Figures 4-7): tsubame
    # reports them; QEMU's query-migrate does not.
    iterating = [(n, configs[n][0]) for n in names if (configs[n][0].get("vmm_stats") or {}).get("per_iteration")]
    if iterating:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for name, run in iterating:
            per = run["vmm_stats"]["per_iteration"]
            ax.plot([i["index"] for i in per], [max(i["bytes_on_wire"], 1) / 2**20 for i in per], marker="o",
                    color=colors[name], label=f"{name} ({run['vmm_stats'].get('stop_reason', '?')})")
        ax.set_yscale("log")
        ax.set_xlabel("iteration (the last one is stop-and-copy)")
        ax.set_ylabel("MiB sent in the iteration")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax.set_title(f"{case}: bytes per iteration (first repetition)", fontsize=11)
        fig.tight_layout()
        iterations_path = os.path.join(out_dir, f"{case}-iterations.png")
        fig.savefig(iterations_path, dpi=110)
        plt.close(fig)
        paths.append(iterations_path)
    return paths
