#!/usr/bin/env python3
"""The large-I/O paper's experiment (issue 20): VMs reading their disk on
network storage are migrated; does the guest's read throughput hold after
the switch-over, or drop to the storage's speed because the destination's
cache is cold?

Storage is one nbdkit process (memory plugin) whose disk is modelled by
its filters: one request at a time over all connections (`noparallel`),
each costing a seek (`delay`, --storage-delay, 1 ms per read) plus its
transfer at --storage-rate (`rate`, 100 MB/s: the paper's SATA disk). The
rate filter's token bucket holds --storage-burst of transfer (50 ms; its
default of 2 s would let storage that was idle while the source's cache
served every read answer at memory speed for the 2 s measured after the
switch-over, which a disk cannot). So a sequential reader with 256 KiB read-ahead gets ~72 MB/s, 16 KiB reads
without a cache ~14 MB/s, and VMs reading at once share that.
Every VM reads the same export (the `disk-seq` workload only reads). The
VMs migrate over the harness's shaped veth link (--link, 1 Gbit/s), all at
once for --vms 6. Storage is reached over a unix socket from both network
namespaces: the link carries memory only, as on a host pair with a
separate storage network.

Configurations (`--configs`):
  tsubame-cold          no host block cache (--block-cache 0): every read
                        goes to storage, before and after;
  tsubame-source-warm   a cache at the source, none sent ahead
                        (--no-warm-cache): the destination starts cold;
  tsubame-list          the block list only (--warm-data none): the
                        destination fills its cache from storage;
  tsubame-warm          the default: the list, and the contents of the
                        blocks the guest likely reads next until they are
                        2 s of its reads ahead of it (--warm-data auto);
  tsubame-warm-all      the list and every cached block's contents
                        (--warm-data all);
  qemu                  QEMU (10, as scripts/setup.sh installs it) on the
                        same export (virtio-blk-pci, disable-modern=on,
                        cache=writeback: the counterpart of a host cache,
                        which for an NBD disk keeps nothing: the host page
                        cache fronts files, QEMU's NBD client has none).

Per VM it reports the guest's read throughput in the 2 s before the
switch-over (its last progress line at the source) and the 2 s after (its
first line at the destination), and plots MB/s per 100 ms across the
migration (the paper's Figs. 5 and 6).

    python3 bench/disk_warm.py --vms 1 --vms 6 --out bench/results/disk-warm
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from tsubame_bench import HarnessError
from tsubame_bench.disk import CONFIGS, Storage, run_qemu, run_tsubame
from tsubame_bench.disk_report import plot, table
from tsubame_bench.link import Link, remove_stale_namespaces
from tsubame_bench.procs import stop_all_processes
from tsubame_bench.units import parse_rate


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vms", type=int, action="append", help="VMs migrated at once (repeatable; default 1 and 6)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--memory", default="256M", help="guest memory of each VM")
    p.add_argument("--disk-size", default="1G", help="the export's size")
    p.add_argument("--region", default="256M", help="the part of the disk disk-seq reads, over and over")
    p.add_argument("--cache", default="512M", help="--block-cache of tsubame's warm configurations")
    p.add_argument("--guest-rate", type=int, default=0,
                   help="MB/s each guest reads at most (default: 160 for one VM, 160/VMs for more)")
    p.add_argument("--storage-rate", action="append",
                   help="the storage's bandwidth, shared (repeatable; default 100MB and 1GB)")
    p.add_argument("--storage-delay", default="1ms", help="latency of each storage read request")
    p.add_argument("--storage-burst", type=float, default=0.05,
                   help="seconds of transfer the storage may burst after idling (nbdkit rate filter's burstiness)")
    p.add_argument("--link", default="1Gbit", help="the migration link (shaped veth)")
    p.add_argument("--warm-passes", type=int, default=2, help="passes over the region before migrating")
    p.add_argument("--warmup-limit-s", type=float, default=180)
    p.add_argument("--time-limit-s", type=float, default=180)
    p.add_argument("--tsubame", default="target/release/tsubame")
    p.add_argument("--qemu", default="qemu-system-x86_64")
    p.add_argument("--out", default="results/disk-warm")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise HarnessError("run as root (network namespaces)")
    for tool in ("nbdkit", args.tsubame):
        if shutil.which(tool) is None and not os.path.exists(tool):
            raise HarnessError(f"{tool} not found (apt-get install nbdkit; cargo build --release)")
    args.tsubame = os.path.abspath(args.tsubame)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tsb-disk-")
    args.guest_elf = os.path.join(work, "guest.elf")
    subprocess.run([args.tsubame, "guest-elf", args.guest_elf], check=True)
    p = subprocess.run([args.tsubame, "run", "--memory", "16M", "--workload", "idle", "--seconds", "0.3"],
                       capture_output=True, text=True, timeout=30)
    args.tsc_khz = int(p.stdout.split("tsc_khz=")[1].split()[0])
    remove_stale_namespaces()
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise HarnessError(f"unknown config {c} (known: {', '.join(CONFIGS)})")
    if "qemu" in configs and shutil.which(args.qemu) is None:
        raise HarnessError(f"{args.qemu} not found (apt-get install qemu-system-x86)")
    results = []
    vm_counts = args.vms or [1, 6]
    base_rate = args.guest_rate
    for storage_rate in args.storage_rate or ["100MB", "1GB"]:
        args.storage_rate = storage_rate
        run_counts(args, configs, vm_counts, base_rate, work, results)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = table(results)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    for path in plot(results, args.out):
        print(f"plot: {path}")
    shutil.rmtree(work, ignore_errors=True)


def run_counts(args, configs, vm_counts, base_rate, work, results):
    """Every VM count and configuration on storage of args.storage_rate."""
    for n in vm_counts:
        args.guest_rate = base_rate or max(1, 160 // n)
        for config in configs:
            link = Link(parse_rate(args.link))
            storage = None
            try:
                link.setup()
                storage = Storage(args, work)
                print(f"disk_warm: {args.storage_rate}/s storage, {n} VM(s), {config} ...", file=sys.stderr,
                      flush=True)
                r = run_qemu(args, n, link, storage, work) if config == "qemu" else \
                    run_tsubame(args, config, n, link, storage, work)
                r["guest_rate_mbs"] = args.guest_rate
                r["storage_rate"] = args.storage_rate
                results.append(r)
                worst = min((v["ratio"] or 0) for v in r["per_vm"])  # a VM without figures counts as 0
                print(f"disk_warm: {n} VM(s), {config}: after/before worst {worst:.2f}; "
                      + "; ".join(f"VM {i}: {v['before_mbs'] or 0:.0f} -> {v['after_mbs'] or 0:.0f} MB/s, "
                                  f"gap {v['gap_ms']:.0f} ms" for i, v in enumerate(r["per_vm"])),
                      file=sys.stderr, flush=True)
                with open(os.path.join(args.out, "results.json"), "w") as f:
                    json.dump(results, f, indent=1)
            finally:
                if storage:
                    storage.stop()
                link.teardown()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        main()
    except HarnessError as e:
        print(f"disk_warm: error: {e}", file=sys.stderr)
        stop_all_processes()
        sys.exit(1)
    except KeyboardInterrupt:
        stop_all_processes()
        sys.exit(130)
