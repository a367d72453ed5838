#!/usr/bin/env python3
"""Far memory against swapping (issues 19 and 51, the remote-swap paper):
the same guest under one memory budget, its ops/s when what does not fit
lives on a memory host, in kernel swap on a local disk, or in zram.

The budget: every configuration but the fully local ones runs its VMM
process in a v1 memory cgroup limited to the local memory (a fraction of
the working set, --fractions) plus that VMM's own overhead, measured
before the runs (an idle guest of the same size; stated in the table).
The kernel's OOM killer stays on; swap is a file on the local disk or
zram, at the stated --swappiness; the host's own swap is taken offline
for the runs and put back afterwards. The memory host (nbdkit) runs
outside the budget, as a remote host would.

Configurations (`--configs`):
  local, qemu-local  all of guest memory resident (no limit): the upper
               bound, per VMM;
  far          tsubame --local-memory L-16M --far-memory on `nbdkit memory`
               over a unix socket (loopback: the memory host is this
               machine); the 16 MiB are far memory's own buffers, so that
               it fits the same budget;
  far-10g      the same over TCP to nbdkit in another network namespace,
               the veth between them shaped at --far-link (10 Gbit/s);
  swap-disk    tsubame without far memory, swapping to a swap file on the
               local disk;
  swap-zram    the same, swapping to /dev/zram0 (compressed RAM);
  qemu-swap-disk, qemu-swap-zram
               QEMU (KVM, the same guest ELF via -kernel, its progress on
               a debugcon socket) in the same budget and swap.

Each runs the guest for --warmup seconds (kv loads its keys), then reads
its ops over the next --seconds and, for `far`, fault latency (kernel swap
has no per-fault figure without tracing). kv runs first, at 1/2 local
first: kernel swap must carry it at a nonzero rate for each VMM there, or
the harness says why and stops. Run as root (swap, cgroups, namespaces).

Migration (`--migrate`): the same guest, after --warmup, migrated over a
unix socket paced at --link to `tsubame receive`, fully local
(`migrate-local`) and with --local memory and the rest on a memory host
(`migrate-far`: only the resident pages and the far-page map move), both
under tsubame's default (post-copy allowed) unless --postcopy says
otherwise. It reports the migration's total time, downtime and bytes,
that the digest verified, and the guest's ops at the destination over 3 s.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

from tsubame_bench import HarnessError
from tsubame_bench.far import (BASELINE_FRACTION, CONFIGS, DEFAULT_CONFIGS, FULLY_LOCAL, MIGRATE_CONFIGS,
                               baseline_broken, measure_overhead, migrate_one, run_one, run_order, vmm_of)
from tsubame_bench.far_report import fraction_label, migrate_table, plot, table
from tsubame_bench.link import remove_stale_namespaces
from tsubame_bench.memlimit import HostSwap, HostThp, MemLimitError


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory", default="640M", help="guest memory")
    p.add_argument("--wss", default="512M", help="the workload's working set")
    p.add_argument("--fractions", default="0.75,0.5,0.25",
                   help="local memory as fractions of the working set (the budget of every limited configuration)")
    p.add_argument("--swappiness", type=int, default=60, help="the budget cgroup's memory.swappiness")
    p.add_argument("--thp", default="never", choices=["never", "madvise", "always"],
                   help="transparent huge pages host-wide during the runs (never: both VMMs on 4 KiB pages; "
                        "QEMU asks for huge pages, tsubame runs here with --no-hugepages)")
    p.add_argument("--local", default="1G", help="with --migrate: local memory of migrate-far")
    p.add_argument("--workloads", default="kv,bwmem,stream", help="stream is the sequential scan")
    p.add_argument("--far-link", default="10Gbit", help="the shaped link to the memory host of far-10g")
    p.add_argument("--configs", default=None, help=f"default: {','.join(DEFAULT_CONFIGS)}; with --migrate: "
                                                   f"{','.join(MIGRATE_CONFIGS)}")
    p.add_argument("--migrate", action="store_true", help="measure migrations instead of ops/s")
    p.add_argument("--link", default="1Gbit", help="the migration's rate with --migrate")
    p.add_argument("--rate", help="with --migrate: the guest's write cap in MB/s (workload-arg rate=)")
    p.add_argument("--postcopy", default=None,
                   help="with --migrate: `migrate --postcopy` (off, auto, after=N); default: tsubame's default")
    p.add_argument("--warmup", type=float, default=30, help="seconds before measuring (kv loads its keys)")
    p.add_argument("--seconds", type=float, default=20, help="seconds measured")
    p.add_argument("--tsubame", default="target/release/tsubame")
    p.add_argument("--qemu", default="qemu-system-x86_64")
    p.add_argument("--out", default="results/far-memory")
    args = p.parse_args(argv)
    known = MIGRATE_CONFIGS if args.migrate else CONFIGS
    configs = (args.configs or ",".join(MIGRATE_CONFIGS if args.migrate else DEFAULT_CONFIGS)).split(",")
    for config in configs:
        if config not in known:
            raise HarnessError(f"unknown config {config} (known: {', '.join(known)})")
    try:
        fractions = sorted({float(f) for f in args.fractions.split(",")}, reverse=True)
    except ValueError:
        raise HarnessError(f"--fractions: a comma-separated list of numbers, not {args.fractions!r}") from None
    if not all(0 < f < 1 for f in fractions):
        raise HarnessError("--fractions: each between 0 and 1 (fully local is its own configuration)")
    if os.geteuid() != 0:
        raise HarnessError("run as root (swap, cgroups)")
    args.tsubame = os.path.abspath(args.tsubame)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tsb-far-", dir="/var/tmp")
    remove_stale_namespaces()
    results, host_swap, host_thp = [], None, None

    def record(r):
        print(f"far_memory: {r['workload']} {r['config']}: {json.dumps(r)}", file=sys.stderr, flush=True)
        results.append(r)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    try:
        if args.migrate:
            for workload in args.workloads.split(","):
                for config in configs:
                    print(f"far_memory: {workload} {config} ...", file=sys.stderr, flush=True)
                    record(migrate_one(args, config, workload, work))
            text = migrate_table(results)
        else:
            host_swap, host_thp = HostSwap(), HostThp(args.thp)
            overhead = {vmm: measure_overhead(args, vmm, work) for vmm in sorted({vmm_of(c) for c in configs})}
            print(f"far_memory: measured VMM overhead: {json.dumps({k: v >> 20 for k, v in overhead.items()})} "
                  "MiB", file=sys.stderr, flush=True)
            done_local = set()
            for workload, fraction in run_order(args.workloads.split(","), fractions):
                for config in configs:
                    if config in FULLY_LOCAL and (workload, config) in done_local:
                        continue
                    done_local.add((workload, config))
                    print(f"far_memory: {workload} {config} at {fraction_label(fraction)} local ...",
                          file=sys.stderr, flush=True)
                    record(run_one(args, config, workload, fraction, overhead, work))
                if workload == "kv" and fraction == BASELINE_FRACTION:
                    broken = baseline_broken(results, configs)
                    if broken:
                        raise HarnessError(broken)
            text = table(results, fractions, overhead, args.swappiness, args.thp)
            plot(results, fractions, os.path.join(args.out, "ops-by-local-fraction.png"))
    except MemLimitError as e:
        raise HarnessError(str(e)) from None
    finally:
        if host_swap:
            host_swap.restore()
        if host_thp:
            host_thp.restore()
        subprocess.run(["rm", "-rf", work])
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def on_sigterm(signum, frame):
    # `finally` puts the host's swap and THP back, as on Ctrl-C.
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        main()
    except HarnessError as e:
        print(f"far_memory: error: {e}", file=sys.stderr)
        sys.exit(1)
