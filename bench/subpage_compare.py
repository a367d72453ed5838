#!/usr/bin/env python3
"""Sub-page granularity against whole pages (issue 7's measurements).

For each workload, runs `tsubame demo` at --granularity 4096 and at 128
(shadow and hash detectors) on a 2 GiB VM at --max-bandwidth 1Gbit,
downtime limit 300 ms, at most 30 iterations, and prints bytes, time,
iterations and the ratios the issue asks about.

Usage: python3 bench/subpage_compare.py [--memory 2G] [--out results/subpage]
"""
import argparse
import os
import sys

from tsubame_bench.demo import run_demo

CASES = [
    # workload, workload args
    ("sparse", ["wss=1G", "rate=2"]),
    ("kv", []),  # the default working set, 512 MiB
    ("stream", ["wss=256M", "rate=50"]),
]
CONFIGS = [
    ("4096", ["--granularity", "4096"]),
    ("128-shadow", ["--granularity", "128", "--subpage-detect", "shadow"]),
    ("128-hash", ["--granularity", "128", "--subpage-detect", "hash"]),
]


def demo(binary, memory, workload, wargs, margs, path):
    args = ["--memory", memory, "--workload", workload, "--max-bandwidth", "1Gbit", "--downtime-limit", "300",
            "--max-iterations", "30"]
    for a in wargs:
        args += ["--workload-arg", a]
    stats, _ = run_demo(binary, args + margs, path, check=False)
    if stats is None:
        sys.exit(f"no statistics from: {binary} demo {' '.join(args + margs)}")
    return stats


def bytes_over(stats, n):
    return sum(i["bytes_on_wire"] for i in stats["per_iteration"][:n])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", default="2G")
    p.add_argument("--tsubame", default="target/release/tsubame")
    p.add_argument("--out", default="results/subpage")
    p.add_argument("--workloads", default=",".join(c[0] for c in CASES), help="comma-separated subset")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print("| workload | granularity | status | converged / stop | iterations | MiB on wire | total (s) | downtime (ms) "
          "| detector memory (MiB) | bytes vs 4096 (same iterations) | time vs 4096 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for workload, wargs in [c for c in CASES if c[0] in args.workloads.split(",")]:
        runs = {}
        for name, margs in CONFIGS:
            runs[name] = demo(args.tsubame, args.memory, workload, wargs, margs,
                              os.path.join(args.out, f"{workload}-{name}.json"))
        base = runs["4096"]
        for name, s in runs.items():
            n = min(len(s["per_iteration"]), len(base["per_iteration"]))
            ratio = bytes_over(s, n) / max(1, bytes_over(base, n))
            sub = s.get("subpage") or {}
            print(f"| {workload} {' '.join(wargs)} | {name} | {s['status']} | "
                  f"{'yes' if s['converged'] else 'no'} / {s['stop_reason']} | {s['iterations']} "
                  f"| {s['bytes_on_wire'] / 2**20:.1f} | {s['total_time_ms'] / 1e3:.1f} | {s['downtime_ms']:.0f} "
                  f"| {sub.get('memory_bytes', 0) / 2**20:.0f} | {ratio:.3f} (first {n}) "
                  f"| {s['total_time_ms'] / base['total_time_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
