#!/usr/bin/env python3
"""Two tsubame binaries, the same demo, alternating runs: medians and B/A ratios.

For "did this change help": build the old commit elsewhere (a git worktree),
then e.g.
  python3 bench/ab.py /tmp/old/tsubame target/release/tsubame --runs 3 -- \
      demo --memory 2G --workload kv
Each run adds `--json`; the table shows total time, downtime, iterations,
bytes, both ends' migration CPU (the source's migration and stage
threads, not the guest's vCPU) and the guest's ops/s at the destination
as a share of its ops/s before. Where runs end differently (post-copy in
some, pre-copy in others), it also compares each ending's runs alone.
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
    ended = "post-copy" if stats.get("postcopy") else "pre-copy"
    return ended, {
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
                ended, r = run(binary, args, os.path.join(tmp, f"{side}{i}.json"))
                results[side].append((ended, r))
                figures = ", ".join(f"{k} {v:.1f}" for k, v in r.items())
                print(f"{side} #{i + 1} ({ended}): {figures}", file=sys.stderr)
    print(f"`{' '.join(args)}`, {opts.runs} alternating runs each; A = `{opts.a}`, B = `{opts.b}`\n")
    table(results)
    # A case on the edge of the policy ends in post-copy in some runs and
    # pre-copy in others, on both sides: medians over the mix compare the
    # mix. Each ending's runs, compared alone, say what the change did.
    endings = sorted({ended for side in results.values() for ended, _ in side})
    if len(endings) > 1:
        for ending in endings:
            alone = {side: [(e, r) for e, r in runs if e == ending] for side, runs in results.items()}
            if all(alone.values()):
                print(f"\nRuns that ended in {ending} only (A {len(alone['a'])}, B {len(alone['b'])}):\n")
                table(alone)


def table(results):
    """Medians of each figure over each side's runs, and B ÷ A."""
    print("| figure | A (median) | B (median) | B / A |")
    print("|---|---|---|---|")
    for key in results["a"][0][1]:
        a = statistics.median(r[key] for _, r in results["a"])
        b = statistics.median(r[key] for _, r in results["b"])
        print(f"| {key} | {a:.2f} | {b:.2f} | {b / a if a else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
