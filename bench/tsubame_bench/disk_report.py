"""The warm disk cache's table and plots (bench/disk_warm.py)."""

import os

def data_mib(vm):
    """MiB of cached contents that went over the link for one VM (0 without a warm list)."""
    warm = vm.get("warm_cache") or {}
    return warm.get("blocks_sent", 0) * 4096 / 2**20


def table(results):
    """One row per storage rate, VM count and configuration, leading with
    what the warm cache costs (migration time) and what it buys (the
    guest's reads in the 2 s after the switch)."""
    rows = ["| storage | VMs | config | migration s (longest VM) | after ÷ before (lowest VM) | before MB/s | "
            "after MB/s | contents sent MiB a VM | switch gap ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        vms = r["per_vm"]
        mean = lambda key: sum(v[key] or 0 for v in vms) / max(1, len(vms))  # noqa: E731
        worst = min((v["ratio"] for v in vms if v["ratio"] is not None), default=None)
        longest = max((v["total_time_s"] for v in vms), default=0)
        sent = sum(data_mib(v) for v in vms) / max(1, len(vms))
        rows.append(f"| {r.get('storage_rate', '?')} | {r['vms']} | {r['config']} | **{longest:.2f}** | "
                    f"**{'%.2f' % worst if worst is not None else 'n/a'}** | {mean('before_mbs'):.1f} | "
                    f"{mean('after_mbs'):.1f} | {sent:.0f} | {mean('gap_ms'):.0f} |")
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
