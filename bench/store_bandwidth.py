#!/usr/bin/env python3
"""Ring-3 store bandwidth of the test guest under tsubame and under QEMU.

Both VMMs boot the same guest ELF with the same command line
(`workload=bwmem wss=SIZE tsc_khz=KHZ`); the guest prints `tsb ops=N`
(4 KiB pages written) every ~50 ms of its own TSC time. Bandwidth is
pages x 4096 / guest seconds, computed the same way for both, so the
ratio compares the VMMs and nothing else.

Usage: python3 bench/store_bandwidth.py [--seconds 5] [--wss 64M] [--tsubame PATH]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from tsubame_bench.console import parse_progress
from tsubame_bench.qmp import qemu_version_label, qemu_version_line



def bandwidth(lines, tsc_interval_s=0.05):
    """GB/s from progress lines: pages per line gap over the 50 ms cadence.

    Lines come at least 50 ms of guest time apart; the guest checks the TSC
    every 64 pages, so the gap overshoots by well under 1 %."""
    ops = [p["ops"] for p in map(parse_progress, lines) if p]
    # Skip the first second (page faults of first touch), keep the rest.
    ops = ops[20:]
    if len(ops) < 10:
        raise SystemExit(f"too few progress lines ({len(ops)}) to measure")
    pages = ops[-1] - ops[0]
    seconds = (len(ops) - 1) * tsc_interval_s
    return pages * 4096 / seconds / 1e9


def run_tsubame(binary, args, seconds):
    out = subprocess.run(
        [binary, "run", "--memory", "1G", "--workload", "bwmem", "--workload-arg", f"wss={args.wss}",
         "--seconds", str(seconds)],
        capture_output=True, text=True, check=True)
    first = out.stdout.splitlines()[0]
    khz = int(re.search(r"tsc_khz=(\d+)", first).group(1))
    return bandwidth(out.stdout.splitlines()), khz


def run_qemu(binary, args, seconds, khz):
    with tempfile.TemporaryDirectory() as tmp:
        elf = os.path.join(tmp, "guest.elf")
        log = os.path.join(tmp, "console.log")
        subprocess.run([binary, "guest-elf", elf], check=True)
        qemu = subprocess.Popen(
            ["qemu-system-x86_64", "-enable-kvm", "-cpu", "host,-arch-capabilities", "-m", "1G", "-nodefaults", "-nographic",
             "-kernel", elf, "-append", f"workload=bwmem wss={args.wss} tsc_khz={khz}",
             "-chardev", f"file,id=d,path={log}", "-device", "isa-debugcon,iobase=0xe9,chardev=d"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            # QEMU's firmware boot takes seconds under PVM (4-5 s for QEMU
            # 10 here): the measured seconds start at the guest's first line.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and qemu.poll() is None:
                if os.path.exists(log) and os.path.getsize(log) > 0:
                    break
                time.sleep(0.1)
            time.sleep(seconds + 1)
        finally:
            qemu.kill()
            qemu.wait()
        with open(log) as f:
            return bandwidth(f.readlines())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--wss", default="64M")
    p.add_argument("--tsubame", default="target/release/tsubame")
    args = p.parse_args()
    if not os.path.exists(args.tsubame):
        sys.exit(f"{args.tsubame} not found: run `cargo build --release` first")
    ts, khz = run_tsubame(args.tsubame, args, args.seconds)
    qm = run_qemu(args.tsubame, args, args.seconds, khz)
    print("| VMM | ring-3 store bandwidth (GB/s) |")
    print("|---|---|")
    print(f"| tsubame | {ts:.2f} |")
    print(f"| {qemu_version_label(qemu_version_line('qemu-system-x86_64'))} | {qm:.2f} |")
    print(f"| ratio tsubame/QEMU | {ts / qm:.2f} |")


if __name__ == "__main__":
    main()
