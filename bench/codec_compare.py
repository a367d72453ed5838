#!/usr/bin/env python3
"""Codecs against raw pages on a capped link (issue 5's measurements), and
kv with XBZRLE against 128-byte sub-pages (issue 7's).

Each row is one `tsubame demo` (destination process on this machine).
Usage: python3 bench/codec_compare.py [--out results/codec] [--only codec|subpage]
"""
import argparse
import os
import sys

from tsubame_bench.demo import run_demo

CODEC_CASES = [
    # workload, args, codec lists; 1 GiB VM, 1 Gbit/s
    ("fill-zero", [], ["none", "zero", "zero,xbzrle,dedup,zstd"]),
    ("fill-random", [], ["none", "zero", "zero,xbzrle,dedup,zstd", "zero,rle,lz4"]),
    ("kv", [], ["none", "zero", "zero,xbzrle", "zero,xbzrle,dedup,zstd"]),
]
SUBPAGE_CASES = [
    # 2 GiB kv at 1 Gbit/s: XBZRLE (512 MiB cache) at 4096 against 128-byte sub-pages
    ("kv", [], [("zero", []), ("zero,xbzrle", []), ("zero", ["--granularity", "128", "--subpage-detect", "hash"]),
                ("zero", ["--granularity", "128", "--subpage-detect", "shadow"])]),
]


def demo(binary, memory, workload, wargs, codec, extra, path):
    args = ["--memory", memory, "--workload", workload, "--max-bandwidth", "1Gbit", "--codec", codec] + extra
    for a in wargs:
        args += ["--workload-arg", a]
    stats, proc = run_demo(binary, args, path, check=False)
    if stats is None:
        sys.exit(f"no statistics from {binary} demo {' '.join(args)}:\n{proc.stderr}")
    return stats


def row(label, s, base):
    sub = s.get("subpage") or {}
    mem = sub.get("memory_resident_bytes")
    return (f"| {label} | {s['status']} | {'yes' if s['converged'] else 'no'} / {s['stop_reason']} | {s['iterations']} "
            f"| {s['bytes_on_wire'] / 2**20:.1f} | {s['bytes_on_wire'] / base['bytes_on_wire']:.3f} "
            f"| {s['total_time_ms'] / 1e3:.2f} | {s['total_time_ms'] / base['total_time_ms']:.2f} | {s['downtime_ms']:.0f} "
            f"| {s['cpu_seconds']['source_migration_thread']:.2f} | {'' if mem is None else f'{mem / 2**20:.1f}'} |")


HEAD = ("| run | status | converged / stop | iterations | MiB on wire | bytes vs first row | total (s) | time vs first row "
        "| downtime (ms) | CPU-s migration thread | detector resident MiB |\n|---|---|---|---|---|---|---|---|---|---|---|")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tsubame", default="target/release/tsubame")
    p.add_argument("--out", default="results/codec")
    p.add_argument("--only", choices=["codec", "subpage"])
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.only != "subpage":
        print("### 1 GiB VM, --max-bandwidth 1Gbit\n")
        print(HEAD)
        for workload, wargs, codecs in CODEC_CASES:
            base = None
            for codec in codecs:
                s = demo(args.tsubame, "1G", workload, wargs, codec, [], os.path.join(args.out, f"{workload}-{codec}.json"))
                base = base or s
                print(row(f"{workload} --codec {codec}", s, base), flush=True)
    if args.only != "codec":
        print("\n### 2 GiB VM, kv, --max-bandwidth 1Gbit\n")
        print(HEAD)
        for workload, wargs, configs in SUBPAGE_CASES:
            base = None
            for codec, extra in configs:
                name = f"{workload}-{codec}-{'-'.join(extra) or '4096'}"
                s = demo(args.tsubame, "2G", workload, wargs, codec, extra, os.path.join(args.out, f"{name}.json"))
                base = base or s
                print(row(f"{workload} --codec {codec} {' '.join(extra)}", s, base), flush=True)


if __name__ == "__main__":
    main()
