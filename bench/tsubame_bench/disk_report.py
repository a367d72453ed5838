"""The warm disk cache's table and plots (bench/disk_warm.py)."""

import os

def table(results):
    rows = ["| VMs | config | before MB/s | after MB/s | after ÷ before (min over VMs) | switch gap ms | total s |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        vms = r["per_vm"]
        mean = lambda key: sum(v[key] or 0 for v in vms) / max(1, len(vms))  # noqa: E731
        worst = min((v["ratio"] for v in vms if v["ratio"] is not None), default=None)
        rows.append(f"| {r['vms']} | {r['config']} | {mean('before_mbs'):.1f} | {mean('after_mbs'):.1f} | "
                    f"{'%.2f' % worst if worst is not None else 'n/a'} "
                    f"({', '.join('%.2f' % v['ratio'] if v['ratio'] is not None else 'n/a' for v in vms)}) | "
                    f"{mean('gap_ms'):.0f} | {mean('total_time_s'):.1f} |")
    return "\n".join(rows)


def plot(results, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for n in sorted({r["vms"] for r in results}):
        rs = [r for r in results if r["vms"] == n]
        fig, axes = plt.subplots(len(rs), 1, figsize=(10, 2.4 * len(rs)), sharex=True, squeeze=False)
        for ax, r in zip(axes[:, 0], rs):
            for i, vm in enumerate(r["per_vm"]):
                xs = [t for t, v in vm["timeline"] if v is not None]
                ys = [v for t, v in vm["timeline"] if v is not None]
                ax.plot(xs, ys, linewidth=0.9, label=f"VM {i}" if n > 1 else None)
            ax.axvline(0, color="black", linewidth=0.6, linestyle="--")
            ax.set_title(f"{r['config']}: guest read MB/s per 100 ms (0 = switch-over)", fontsize=9)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        axes[-1, 0].set_xlabel("seconds from the switch-over")
        fig.tight_layout()
        path = os.path.join(out_dir, f"disk-warm-{n}vm.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
