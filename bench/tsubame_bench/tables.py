"""Tables: medians, ratios against QEMU, the best QEMU per figure, the downtime limit."""
import re
import statistics

from tsubame_bench.qmp import qemu_version_label
from tsubame_bench.units import parse_size

def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


# (column title, RunResult field, scale, format)
METRICS = [
    ("total (s)", "total_time_s", 1, "{:.2f}"),
    ("until guest runs at dst (s)", "time_to_destination_s", 1, "{:.2f}"),
    ("guest stall (ms)", "guest_stall_ms", 1, "{:.1f}"),
    ("VMM stop→resume (ms)", "vmm_stop_resume_ms", 1, "{:.1f}"),
    ("VMM downtime (ms)", "vmm_downtime_ms", 1, "{:.0f}"),
    ("guest downtime (ms)", "guest_downtime_ms", 1, "{:.0f}"),
    ("MiB on wire", "bytes_on_wire", 1 / 2**20, "{:.0f}"),
    ("CPU-s src", "cpu_source_s", 1, "{:.2f}"),
    ("CPU-s src w/o vCPU", "cpu_source_migration_s", 1, "{:.2f}"),
    ("CPU-s dst", "cpu_destination_s", 1, "{:.2f}"),
    ("iterations", "iterations", 1, "{:.0f}"),
    ("Mops/s before", "ops_per_sec_before", 1e-6, "{:.2f}"),
    ("Mops/s during", "ops_per_sec_during", 1e-6, "{:.2f}"),
    ("Mops/s after", "ops_per_sec_after", 1e-6, "{:.2f}"),
    ("kops/s post-copy (first 90 %)", "ops_per_sec_postcopy", 1e-3, "{:.1f}"),
    ("fault p99 (µs)", "fault_latency_p99_us", 1, "{:.0f}"),
    ("blocktime (ms)", "postcopy_blocktime_ms", 1, "{:.0f}"),
]
RATIO_METRICS = ["total_time_s", "time_to_destination_s", "guest_stall_ms", "vmm_stop_resume_ms",
                 "vmm_downtime_ms", "guest_downtime_ms", "bytes_on_wire", "cpu_source_s", "cpu_source_migration_s",
                 "cpu_destination_s", "ops_per_sec_during", "ops_per_sec_postcopy"]


def metric(run, key):
    """A figure of a run (a dict from runs.jsonl); derived ones computed here."""
    if key == "cpu_source_migration_s":
        if run.get("cpu_source_s") is None or run.get("cpu_source_vcpu_s") is None:
            return None
        return run["cpu_source_s"] - run["cpu_source_vcpu_s"]
    return run.get(key)


def group_runs(runs):
    """{case: {config: [runs]}} in first-seen order."""
    groups = {}
    for r in runs:
        groups.setdefault(r["case"], {}).setdefault(r["config"], []).append(r)
    return groups


def summarize(runs):
    """Medians of each metric over a config's completed runs, plus counts.

    Timed-out runs count in `runs` but not in the medians; when none completed, `limit_s`
    holds the time spent until the limit (the table shows it as ">N")."""
    done = [r for r in runs if r["status"] == "completed"]
    summary = {key: median([metric(r, key) for r in done]) for _, key, _, _ in METRICS}
    summary["limit_s"] = None if done else median([r.get("total_time_s") for r in runs])
    summary["runs"] = len(runs)
    summary["completed"] = len(done)
    summary["converged"] = sum(1 for r in runs if r.get("converged"))
    summary["vmm"] = runs[0]["vmm"]
    return summary


def ratio_rows(runs):
    """[(case, tsubame config, QEMU config, {metric: tsubame median / QEMU median or None})] for every pair."""
    rows = []
    for case, configs in group_runs(runs).items():
        summaries = {name: summarize(rs) for name, rs in configs.items()}
        for tname, ts in summaries.items():
            if ts["vmm"] != "tsubame":
                continue
            for qname, qs in summaries.items():
                if qs["vmm"] == "qemu":
                    rows.append((case, tname, qname, {k: ratio(ts[k], qs[k]) for k in RATIO_METRICS}))
    return rows


# Figures where more is better (the guest's throughput); for every other figure less is.
HIGHER_IS_BETTER = {"ops_per_sec_before", "ops_per_sec_during", "ops_per_sec_after", "ops_per_sec_postcopy"}


def best_qemu(summaries, key):
    """(name, median) of the best QEMU configuration for one figure: of the QEMU configurations with a
    completed run and a median for it, the lowest (the highest for ops/s; the first listed on a tie), or
    (None, None) when none has one. Each figure has its own best: the fastest configuration need not
    stop the guest the shortest time."""
    candidates = [(name, s[key]) for name, s in summaries.items()
                  if s["vmm"] == "qemu" and s["completed"] and s[key] is not None]
    if not candidates:
        return None, None
    pick = max if key in HIGHER_IS_BETTER else min
    return pick(candidates, key=lambda c: c[1])


def best_qemu_rows(runs):
    """[(case, figures)] for each case that ran tsubame-auto (no flags): for every figure of RATIO_METRICS
    `best[key]` = {config, qemu, tsubame, ratio}: the best completing QEMU configuration of that figure
    (best_qemu), its median, tsubame-auto's median and tsubame-auto ÷ best QEMU; tsubame-auto's completed
    runs; its total against the better of tsubame-4096 and tsubame-spp128 (whole pages, 128-byte
    sub-pages) run alongside, as issue 21's targets put it (`granularity`); and against the better of
    tsubame-precopy and tsubame-postcopy-now (`mode`), as issue 50's does."""
    rows = []
    for case, configs in group_runs(runs).items():
        summaries = {name: summarize(rs) for name, rs in configs.items()}
        auto = summaries.get("tsubame-auto")
        if auto is None:
            continue
        best = {}
        for key in RATIO_METRICS:
            name, value = best_qemu(summaries, key)
            best[key] = {"config": name, "qemu": value, "tsubame": auto[key], "ratio": ratio(auto[key], value)}
        def better_total(names):
            """The lower median total of two configurations run alongside, None unless both completed."""
            totals = [summaries[n]["total_time_s"] for n in names if n in summaries and summaries[n]["completed"]]
            return min(totals) if len(totals) == 2 else None
        rows.append((case, {
            "completed": f"{auto['completed']}/{auto['runs']}",
            "best": best,
            "granularity": ratio(auto["total_time_s"], better_total(("tsubame-4096", "tsubame-spp128"))),
            # issue 50: the policy's pick against pre-copy alone and post-copy at once
            "mode": ratio(auto["total_time_s"], better_total(("tsubame-precopy", "tsubame-postcopy-now"))),
        }))
    return rows


def qemu_versions(runs):
    """The distinct `qemu_version` lines of the QEMU runs, in first-seen order; None for runs recorded
    without one (runs.jsonl written before the harness recorded it, read back with --table-from)."""
    versions = []
    for r in runs:
        if r["vmm"] == "qemu" and r.get("qemu_version") not in versions:
            versions.append(r.get("qemu_version"))
    return versions


def qemu_label(runs):
    """What the tables call the QEMU they compare with: "QEMU 10.0.2", "QEMU (version unknown)" when a
    run did not record it (never plain "QEMU": the figures of 7.2 and 10 differ twofold), or several
    joined with "and" when the runs mix versions; "QEMU (none ran)" for tsubame's runs alone."""
    labels = []
    for version in qemu_versions(runs):
        if qemu_version_label(version) not in labels:
            labels.append(qemu_version_label(version))
    return " and ".join(labels) or "QEMU (none ran)"


def limit_rows(runs):
    """[(case, tsubame config, figures)] for each that converged in pre-copy at least once: of those runs, how many
    kept the downtime limit they were given (measured VMM downtime ≤ the `downtime_limit_ms` in their statistics;
    issue 54's promise), the limit, the worst overshoot, the range of the measured VMM downtime and of the engine's
    estimate as it stopped ÷ the measured one."""
    rows = []
    for case, configs in group_runs(runs).items():
        for config, rs in configs.items():
            kept = [r for r in rs if r["vmm"] == "tsubame" and r["status"] == "completed" and r.get("converged")
                    and (r.get("vmm_stats") or {}).get("downtime_limit_ms") and r.get("vmm_downtime_ms") is not None]
            if not kept:
                continue
            measured = [r["vmm_downtime_ms"] for r in kept]
            limits = {r["vmm_stats"]["downtime_limit_ms"] for r in kept}
            overshoots = [r["vmm_downtime_ms"] - r["vmm_stats"]["downtime_limit_ms"] for r in kept]
            shares = [ratio(r["vmm_stats"].get("expected_downtime_ms"), r["vmm_downtime_ms"]) for r in kept]
            shares = [x for x in shares if x is not None]
            rows.append((case, config, {
                "converged": len(kept),
                "kept": sum(1 for over in overshoots if over <= 0),
                "limit_ms": max(limits),
                "worst_over_ms": max(overshoots),
                "measured_ms": (min(measured), max(measured)),
                "shares": (min(shares), max(shares)) if shares else None,
            }))
    return rows


def wss_mismatches(runs):
    """One line per case whose guest worked on a different wss under each VMM (from the guests'
    banners): a workload without `wss` takes its largest RAM range, and QEMU splits a 4 GiB guest's
    RAM at the PCI hole (3070 MiB below it, against tsubame's 4094 MiB)."""
    lines = []
    for case, configs in group_runs(runs).items():
        seen = {}
        for rs in configs.values():
            for r in rs:
                m = re.search(r"\bwss=(\S+)", r.get("guest_banner_source") or "")
                if m:
                    seen.setdefault(r["vmm"], set()).add(parse_size(m.group(1)))
        if len({frozenset(s) for s in seen.values()}) > 1:
            told = ", ".join(f"{vmm} {'/'.join(f'{b / 2**20:.0f} MiB' for b in sorted(s))}"
                             for vmm, s in sorted(seen.items()))
            lines.append(f"**{case}: not like for like**: the guest's wss differs between the VMMs ({told}); "
                         "give the case an `args.wss` that fits both.")
    return lines


def fmt(value, scale=1, pattern="{:.2f}"):
    return "–" if value is None else pattern.format(value * scale)


def make_table(runs):
    """Markdown: which QEMU, one row per case and config with medians, then tsubame/QEMU ratios per case,
    then tsubame-auto against the best QEMU configuration of each case and figure."""
    label = qemu_label(runs)
    out = []
    for version in qemu_versions(runs):
        out.append(f"Against {qemu_version_label(version)}: "
                   + (f"`qemu-system-x86_64 --version`: {version}" if version else
                      "these QEMU runs were recorded without `qemu_version` (runs.jsonl from before the harness "
                      "recorded it)"))
    out += wss_mismatches(runs)
    if out:
        out.append("")
    out += ["| case | config | completed | converged | " + " | ".join(t for t, _, _, _ in METRICS) + " |",
           "|---|---|---|---|" + "---|" * len(METRICS)]
    for case, configs in group_runs(runs).items():
        for config, rs in configs.items():
            s = summarize(rs)
            cells = [fmt(s[key], scale, pattern) for _, key, scale, pattern in METRICS]
            if s["limit_s"] is not None:
                cells[0] = f">{s['limit_s']:.0f}"
            out.append(f"| {case} | {config} | {s['completed']}/{s['runs']} | {s['converged']}/{s['runs']} | "
                       + " | ".join(cells) + " |")
    titles = {key: title.replace(" (s)", "").replace(" (ms)", "") for title, key, _, _ in METRICS}
    out += ["", f"Ratios tsubame / {label} of the medians over completed runs (below 1: tsubame lower; "
            "for Mops/s during, above 1: the guest ran faster under tsubame; –: a side has no completed run):", "",
            "| case | tsubame | QEMU | " + " | ".join(titles[k] for k in RATIO_METRICS) + " |",
            "|---|---|---|" + "---|" * len(RATIO_METRICS)]
    for case, tname, qname, ratios in ratio_rows(runs):
        out.append(f"| {case} | {tname} | {qname} | " + " | ".join(fmt(ratios[k]) for k in RATIO_METRICS) + " |")
    best = best_qemu_rows(runs)
    if best:
        units = {key: (title, scale, pattern) for title, key, scale, pattern in METRICS}
        out += ["", f"tsubame-auto (no flags) against the best {label} configuration of each case and figure: of "
                "the QEMU configurations with a completed run, the one with the lowest median (the highest for "
                "Mops/s and kops/s), named; ÷: tsubame-auto's median ÷ that one's (–: a side has no completed run):",
                "", "| case | figure | best QEMU | best QEMU's median | tsubame-auto's median | tsubame-auto ÷ best QEMU |",
                "|---|---|---|---|---|---|"]
        for case, f in best:
            for key, b in f["best"].items():
                if b["qemu"] is None and b["tsubame"] is None:
                    continue  # a figure neither side has here (post-copy figures of a pre-copy case)
                title, scale, pattern = units[key]
                out.append(f"| {case} | {title} | {b['config'] or 'none completed'} | {fmt(b['qemu'], scale, pattern)} "
                           f"| {fmt(b['tsubame'], scale, pattern)} ({f['completed']} completed) | {fmt(b['ratio'])} |")
        granularity = [(case, f) for case, f in best if f["granularity"] is not None]
        if granularity:
            out += ["", "tsubame-auto's median total against the better of tsubame-4096 and tsubame-spp128:", "",
                    "| case | tsubame-auto completed | total ÷ better of 4096/128 |", "|---|---|---|"]
            for case, f in granularity:
                out.append(f"| {case} | {f['completed']} | {fmt(f['granularity'])} |")
        modes = [(case, f) for case, f in best if f["mode"] is not None]
        if modes:
            out += ["", "tsubame-auto's median total against the better of tsubame-precopy (`--postcopy off`) and "
                    "tsubame-postcopy-now (`--postcopy after=0`) (the automatic policy's pick against either mode "
                    "alone; the goal is at most 1.1):", "",
                    "| case | tsubame-auto completed | total ÷ better of pre-copy/post-copy at once |", "|---|---|---|"]
            for case, f in modes:
                out.append(f"| {case} | {f['completed']} | {fmt(f['mode'])} |")
    limits = limit_rows(runs)
    if limits:
        kept = sum(f["kept"] for _, _, f in limits)
        converged = sum(f["converged"] for _, _, f in limits)
        out += ["", f"tsubame's downtime limit, runs that converged in pre-copy: {kept} of {converged} kept it (measured "
                "VMM downtime ≤ the limit); the engine's estimate as it stopped ÷ the measured downtime beside it:", "",
                "| case | config | kept | limit (ms) | measured VMM downtime (ms) | worst over the limit (ms) | "
                "expected ÷ measured |", "|---|---|---|---|---|---|---|"]
        for case, config, f in limits:
            shortest, longest = f["measured_ms"]
            worst = f"{f['worst_over_ms']:.2f}" if f["worst_over_ms"] > 0 else "–"
            shares = "{:.2f}-{:.2f}".format(*f["shares"]) if f["shares"] else "–"
            out.append(f"| {case} | {config} | {f['kept']}/{f['converged']} | {f['limit_ms']:.0f} | "
                       f"{shortest:.2f}-{longest:.2f} | {worst} | {shares} |")
    return "\n".join(out) + "\n"
