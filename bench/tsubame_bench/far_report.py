"""Far memory's tables and plot (bench/far_memory.py)."""

import sys

from tsubame_bench.far import CONFIGS, FAR_ROOM, FULLY_LOCAL

def migrate_table(results):
    rows = ["| workload | config | total s | ÷ migrate-local | downtime ms | MiB sent | digest | dest ops/s |",
            "|---|---|---|---|---|---|---|---|"]
    by = {(r["workload"], r["config"]): r.get("total_time_ms") for r in results}
    for r in results:
        if "total_time_ms" not in r:
            rows.append(f"| {r['workload']} | {r['config']} | failed: {r.get('failed', '?')} | | | | | |")
            continue
        base = by.get((r["workload"], "migrate-local"))
        ratio = f"{r['total_time_ms'] / base:.2f}" if base else "n/a"
        rows.append(f"| {r['workload']} | {r['config']} | {r['total_time_ms'] / 1e3:.1f} | {ratio} | "
                    f"{r['downtime_ms']:.0f} | {r['bytes_on_wire'] / 2**20:.0f} | "
                    f"{'verified' if r['digest_verified'] else 'NOT verified'} | {r['dest_ops_per_sec']} |")
    return "\n".join(rows)


def fraction_label(f):
    return {0.75: "3/4", 0.5: "1/2", 0.25: "1/4"}.get(f, f"{f:g}")


def table(results, fractions, overhead, swappiness, thp):
    """ops/s per configuration and local fraction, far memory's ratios to
    each swap baseline, and a note for every run that gave no figure."""
    notes = []

    def cell(r):
        if r is None:
            return ""
        if "ops_per_sec" not in r or r["ops_per_sec"] == 0:
            notes.append(f"{r['workload']} {r['config']} at {fraction_label(r['fraction'])} local: "
                         f"{r.get('failed') or '0 ops/s'}{'; ' + r['why'] if 'why' in r else ''}")
            return f"{'failed' if 'failed' in r else '0'} [{len(notes)}]"
        text = f"{r['ops_per_sec']:,}"
        return text + (f" (p99 {r['fault_p99_us']} µs)" if "fault_p99_us" in r else "")

    by = {(r["workload"], r["config"], r["fraction"]): r for r in results}
    heads = [f"{fraction_label(f)} local" for f in fractions] + ["fully local"]
    rows = ["VMM overhead added to each budget (measured with an idle guest of the same size): "
            + ", ".join(f"{vmm} {v >> 20} MiB" for vmm, v in sorted(overhead.items()))
            + f"; swappiness {swappiness}; transparent huge pages {thp}; OOM killer on; far memory's "
            f"--local-memory is {FAR_ROOM >> 20} MiB below the local memory (its own buffers).", "",
            "| workload | config | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    configs = [c for c in CONFIGS if any(r["config"] == c for r in results)]
    for w in workloads:
        for c in configs:
            cells = [cell(by.get((w, c, f))) if c not in FULLY_LOCAL else "" for f in fractions]
            cells.append(cell(by.get((w, c, 1.0))) if c in FULLY_LOCAL else "")
            rows.append(f"| {w} | {c} | " + " | ".join(cells) + " |")
        for base in ("swap-disk", "swap-zram", "qemu-swap-disk", "qemu-swap-zram", "local"):
            cells = []
            for f in fractions:
                far, b = by.get((w, "far", f)), by.get((w, base, 1.0 if base == "local" else f))
                fo, bo = (far or {}).get("ops_per_sec"), (b or {}).get("ops_per_sec")
                if fo and bo:
                    cells.append(f"{fo / bo:.2f}×")
                elif fo and b and (bo == 0 or "failed" in b):
                    cells.append("∞ (it " + ("failed)" if "failed" in b else "made 0)"))
                else:
                    cells.append("")
            if any(cells):
                rows.append(f"| {w} | far ÷ {base} | " + " | ".join(cells + [""]) + " |")
    if notes:
        rows += [""] + [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(rows)


def plot(results, fractions, path):
    """ops/s against the local fraction, one panel per workload."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("far_memory: matplotlib missing, no plot (pip install -r bench/requirements.txt)", file=sys.stderr)
        return
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for c in CONFIGS:
            points = sorted((r["fraction"], r.get("ops_per_sec", 0)) for r in results
                            if r["workload"] == w and r["config"] == c)
            if not points:
                continue
            if c in FULLY_LOCAL:
                ax.axhline(max(points[0][1], 1), linestyle=":", color="grey" if c == "local" else "tan", label=c)
            else:
                ax.plot([p[0] for p in points], [max(p[1], 1) for p in points], marker="o", label=c)
        ax.set_yscale("log")
        ax.set_xticks(fractions)
        ax.set_xlabel("local memory ÷ working set")
        ax.set_ylabel("guest ops/s (0 drawn as 1)")
        ax.set_title(w)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
