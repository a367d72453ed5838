#!/usr/bin/env python3
"""Two tsubame binaries, the same demo, alternating runs: medians and B/A ratios.

For "did this change help": build the old commit elsewhere (a git worktree),
then e.g.
  python3 bench/ab.py /tmp/old/tsubame target/release/tsubame --runs 3 -- \
      demo --memory 2G --workload kv
Each run adds `--json`; the table shows total time, downtime, iterations,
bytes, both ends' migration CPU (the source's migration and stage
threads, not the guest's vCPU) and the guest's ops/s at the destination
as a share of its ops/s before.
"""
import argparse
import os
import statistics
import sys
import tempfile

from tsubame_bench import HarnessError
from tsubame_bench.demo import migration_cpu, run_demo


def run(binary, args, path):
    if args[:1] != ["demo"]:
        sys.exit("ab.py compares `tsubame demo` runs: give `demo ...` after --")
    try:
        stats, _ = run_demo(binary, args[1:], path)
    except HarnessError as e:
        sys.exit(str(e))
    source_cpu, destination_cpu = migration_cpu(stats)
    return {
        "total ms": stats["total_time_ms"],
        "downtime ms": stats["downtime_ms"],
        "iterations": stats["iterations"],
        "MiB on wire": stats["bytes_on_wire"] / 2**20,
        "source CPU-s": source_cpu,
        "destination CPU-s": destination_cpu,
        # The guest's pace after the move, as a share of its pace before.
        "guest ops at destination ÷ before": stats["demo"]["destination_ops_per_sec"]
        / max(1.0, stats["demo"]["source_ops_per_sec"]),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="baseline binary")
    ap.add_argument("b", help="binary under test")
    ap.add_argument("--runs", type=int, default=3)
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("give the tsubame arguments after --")
    cut = argv.index("--")
    opts = ap.parse_args(argv[:cut])
    args = argv[cut + 1:]
    results = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.runs):
            for side in ("a", "b"):
                binary = getattr(opts, side)
                r = run(binary, args, os.path.join(tmp, f"{side}{i}.json"))
                results[side].append(r)
                print(f"{side} #{i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), file=sys.stderr)
    print(f"`{' '.join(args)}`, {opts.runs} alternating runs each; A = `{opts.a}`, B = `{opts.b}`\n")
    print("| figure | A (median) | B (median) | B / A |")
    print("|---|---|---|---|")
    for key in results["a"][0]:
        a = statistics.median(r[key] for r in results["a"])
        b = statistics.median(r[key] for r in results["b"])
        print(f"| {key} | {a:.2f} | {b:.2f} | {b / a if a else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
