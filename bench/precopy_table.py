#!/usr/bin/env python3
"""Runs `tsubame demo` for each workload and prints a markdown table of
total time, downtime, bytes on the wire, iterations and CPU-seconds.

Usage: python3 bench/precopy_table.py [--memory 1G] [--max-bandwidth 1Gbit]
                                      [--workloads kv,idle,...] [--out DIR]
"""
import argparse
import os
import sys

from tsubame_bench.demo import run_demo

WORKLOADS = ["idle", "fill-zero", "fill-random", "kv", "bwmem", "sparse", "zero-clear", "stream"]


def run(binary, workload, args, out_dir):
    path = os.path.join(out_dir, f"{workload}.json")
    demo_args = ["--memory", args.memory, "--workload", workload]
    if args.max_bandwidth:
        demo_args += ["--max-bandwidth", args.max_bandwidth]
    stats, proc = run_demo(binary, demo_args, path, check=False)
    if stats is None:
        sys.exit(f"{workload}: no statistics written:\n{proc.stderr}")
    return stats, proc.returncode


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", default="1G")
    p.add_argument("--max-bandwidth", default=None)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--tsubame", default="target/release/tsubame")
    p.add_argument("--out", default="results/precopy")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print("| workload | status | total (ms) | downtime (ms) | MiB on wire | iterations | converged / stop reason "
          "| CPU-s source (migration thread) | CPU-s destination | guest continued |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        s, rc = run(args.tsubame, workload, args, args.out)
        cpu = s["cpu_seconds"]
        print(f"| {workload} | {s['status']} | {s['total_time_ms']:.0f} | {s['downtime_ms']:.1f} "
              f"| {s['bytes_on_wire'] / 2**20:.1f} | {s['iterations']} "
              f"| {'yes' if s['converged'] else 'no'} / {s['stop_reason']} "
              f"| {cpu['source']:.2f} ({cpu['source_migration_thread']:.2f}) | {cpu['destination']:.2f} "
              f"| {s.get('demo', {}).get('guest_continued', False)} |", flush=True)


if __name__ == "__main__":
    main()
