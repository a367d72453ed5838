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
  tsubame-warm          the default: the cache's block list goes ahead and
                        the destination fills its cache from storage;
  qemu                  QEMU (10, as scripts/setup.sh installs it) on the same export (virtio-blk-pci,
                        disable-modern=on, cache=none: QEMU keeps no cache
                        of an NBD disk).

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
import time

from tsubame_bench import HarnessError
from tsubame_bench.console import parse_progress
from tsubame_bench.control import control_request
from tsubame_bench.link import Link, remove_stale_namespaces
from tsubame_bench.procs import Proc, connect_unix, follow_console_socket, stop_all_processes, stop_process, wait_for_path
from tsubame_bench.qmp import Qmp
from tsubame_bench.units import parse_rate

PORT = 47310
CONFIGS = ["tsubame-cold", "tsubame-source-warm", "tsubame-warm", "qemu"]
WINDOW_S = 2.0
BIN_S = 0.1


def read_points(lines):
    """[(t, text)] -> [(t, bytes read)] from the guest's progress lines."""
    out = []
    for t, text in lines:
        f = parse_progress(text)
        if f and isinstance(f.get("rd"), int):
            out.append((t, f["rd"]))
    return out


def value_at(points, t):
    """Bytes read at time t, interpolated between progress lines (None outside them)."""
    if not points or t < points[0][0] or t > points[-1][0]:
        return None
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def rate_mbs(points, t0, t1):
    """Mean MB/s read over [t0, t1], from one side's lines."""
    a, b = value_at(points, t0), value_at(points, t1)
    if a is None or b is None or t1 <= t0:
        return None
    return (b - a) / (t1 - t0) / 1e6


def timeline(src, dst, t_switch, before_s=6.0, after_s=6.0):
    """MB/s per BIN_S from before_s before the switch to after_s after it, both sides' lines joined."""
    points = [p for p in src if p[0] <= t_switch] + [p for p in dst if p[0] > t_switch]
    out = []
    t = t_switch - before_s
    while t < t_switch + after_s:
        r = rate_mbs(points, t, t + BIN_S)
        out.append((round(t - t_switch, 3), r))
        t += BIN_S
    return out


def figures(src_lines, dst_lines):
    """The figures of one VM: before/after throughput and the timeline."""
    src, dst = read_points(src_lines), read_points(dst_lines)
    if not src or not dst:
        raise HarnessError("a guest printed no disk progress (rd=) on one side")
    t_src_last = src[-1][0]
    dst_after = [p for p in dst if p[0] >= t_src_last]
    if not dst_after:
        raise HarnessError("the guest printed nothing at the destination")
    t_dst_first = dst_after[0][0]
    before = rate_mbs(src, t_src_last - WINDOW_S, t_src_last)
    after = rate_mbs(dst_after, t_dst_first, t_dst_first + WINDOW_S)
    return {
        "before_mbs": before,
        "after_mbs": after,
        "ratio": after / before if before and after is not None else None,
        "gap_ms": (t_dst_first - t_src_last) * 1e3,
        "timeline": timeline(src, dst, t_src_last),
    }


class Storage:
    """nbdkit's memory plugin behind its rate and delay filters, on a unix socket."""

    def __init__(self, args, work):
        self.sock = os.path.join(work, "storage.sock")
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        # One request at a time, each a seek (rdelay) plus its transfer at
        # the disk's rate: a disk with one head, which VMs share. A small
        # bucket: an idle disk does not bank seconds of bandwidth.
        cmd = ["nbdkit", "-f", "-U", self.sock, "--filter=noparallel", "--filter=delay", "--filter=rate", "memory",
               args.disk_size, "serialize=all-requests", f"rdelay={args.storage_delay}",
               f"rate={parse_rate(args.storage_rate)}", f"burstiness={args.storage_burst}"]
        self.proc = Proc("nbdkit", cmd, os.path.join(work, "nbdkit.log"))
        connect_unix(self.sock, 10, self.proc).close()

    def uri(self):
        return f"nbd+unix:///?socket={self.sock}"

    def stop(self):
        stop_process(self.proc)


def guest_args(args):
    return {"disk": args.region, "rate": str(args.guest_rate)}


def wait_passes(lines_of, n, what, timeout_s):
    """Waits until every guest finished n passes over its region (the source's cache holds it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = 0
        for lines in lines_of():
            fields = [parse_progress(text) for _, text in lines]
            fields = [f for f in fields if f]
            if fields and fields[-1]["pass"] >= n:
                done += 1
        if done == len(lines_of()):
            return
        time.sleep(0.2)
    raise HarnessError(f"{what}: the guests did not read their region {n} times within {timeout_s:.0f} s")


def run_tsubame(args, config, n, link, storage, work):
    cache = "0" if config == "tsubame-cold" else args.cache
    srcs, dsts, migrates, stats_paths = [], [], [], []
    try:
        for i in range(n):
            to = f"tcp:{link.dst_ip}:{PORT + i}"
            dst_ctl, src_ctl = f"{work}/dst{i}.sock", f"{work}/src{i}.sock"
            for p in (dst_ctl, src_ctl):
                if os.path.exists(p):
                    os.unlink(p)
            dsts.append(Proc(f"dst{i}", link.netns_exec(link.dst_ns) + [
                args.tsubame, "receive", "--listen", to, "--once", "--memory", args.memory, "--control", dst_ctl,
                "--insecure"], f"{work}/{config}-{n}-dst{i}.log", capture_stdout=True))
            cmd = [args.tsubame, "run", "--memory", args.memory, "--workload", "disk-seq", "--disk", storage.uri(),
                   "--block-cache", cache, "--control", src_ctl]
            for k, v in guest_args(args).items():
                cmd += ["--workload-arg", f"{k}={v}"]
            srcs.append(Proc(f"src{i}", link.netns_exec(link.src_ns) + cmd, f"{work}/{config}-{n}-src{i}.log",
                             capture_stdout=True))
        for i in range(n):
            wait_for_path(f"{work}/dst{i}.sock", 10, dsts[i])
            wait_for_path(f"{work}/src{i}.sock", 10, srcs[i])
        if config == "tsubame-cold":
            wait_passes(lambda: [s.out.snapshot() for s in srcs], 0, config, args.warmup_limit_s)
            time.sleep(WINDOW_S + 1)  # no cache to fill
        else:
            wait_passes(lambda: [s.out.snapshot() for s in srcs], args.warm_passes, config, args.warmup_limit_s)
            time.sleep(WINDOW_S + 0.5)
        t_start = time.monotonic()
        for i in range(n):
            stats = f"{work}/{config}-{n}-migrate{i}.json"
            stats_paths.append(stats)
            cmd = [args.tsubame, "migrate", "--control", f"{work}/src{i}.sock", "--to",
                   f"tcp:{link.dst_ip}:{PORT + i}", "--insecure", "--json", stats]
            if config == "tsubame-source-warm":
                cmd.append("--no-warm-cache")
            migrates.append(Proc(f"migrate{i}", link.netns_exec(link.src_ns) + cmd,
                                 f"{work}/{config}-{n}-migrate{i}.log"))
        for m in migrates:
            if not m.wait(args.time_limit_s):
                raise HarnessError(f"{config}: a migration did not end within {args.time_limit_s} s")
        t_end = time.monotonic()
        time.sleep(WINDOW_S + 4)
        vms = []
        for i in range(n):
            with open(stats_paths[i]) as f:
                stats = json.load(f)
            if stats.get("status") != "completed":
                raise HarnessError(f"{config} VM {i}: migration failed: {stats.get('error')}")
            vm = figures(srcs[i].out.snapshot(), dsts[i].out.snapshot())
            vm["total_time_s"] = stats["total_time_ms"] / 1e3
            vm["vmm_downtime_ms"] = stats["downtime_ms"]
            vm["warm_cache"] = stats.get("warm_cache")
            vm["destination_disk"] = control_request(f"{work}/dst{i}.sock", {"cmd": "stats"}).get("disk")
            vms.append(vm)
        return {"config": config, "vms": n, "wall_s": t_end - t_start, "per_vm": vms}
    finally:
        for i, d in enumerate(dsts):
            if d.alive():
                try:
                    control_request(f"{work}/dst{i}.sock", {"cmd": "quit"})
                except (OSError, ValueError):
                    pass
        for p in migrates + srcs + dsts:
            p.wait(3)
            stop_process(p)


def qemu_command(args, storage, tag, work, incoming):
    cmdline = " ".join(["workload=disk-seq"] + [f"{k}={v}" for k, v in guest_args(args).items()]
                       + [f"tsc_khz={args.tsc_khz}"])
    cmd = [args.qemu, "-name", f"tsb-{tag},debug-threads=on", "-enable-kvm", "-cpu", "host,-arch-capabilities",
           "-m", args.memory, "-nodefaults", "-nographic", "-kernel", args.guest_elf, "-append", cmdline,
           "-drive", f"file={storage.uri()},format=raw,if=none,id=d0,cache=none",
           "-device", "virtio-blk-pci,drive=d0,disable-modern=on",
           "-chardev", f"socket,id=d,path={work}/{tag}-con.sock,server=on,wait=off",
           "-device", "isa-debugcon,iobase=0xe9,chardev=d",
           "-qmp", f"unix:{work}/{tag}-qmp.sock,server=on,wait=off"]
    return cmd + (["-incoming", "defer"] if incoming else [])


def run_qemu(args, n, link, storage, work):
    procs, qmps, logs = [], [], []
    try:
        for i in range(n):
            for tag in (f"qdst{i}", f"qsrc{i}"):
                for kind in ("con", "qmp"):
                    if os.path.exists(f"{work}/{tag}-{kind}.sock"):
                        os.unlink(f"{work}/{tag}-{kind}.sock")
            dst = Proc(f"qdst{i}", link.netns_exec(link.dst_ns) + qemu_command(args, storage, f"qdst{i}", work, True),
                       f"{work}/qemu-{n}-dst{i}.log")
            src = Proc(f"qsrc{i}", link.netns_exec(link.src_ns) + qemu_command(args, storage, f"qsrc{i}", work, False),
                       f"{work}/qemu-{n}-src{i}.log")
            procs += [src, dst]
            logs.append((follow_console_socket(f"{work}/qsrc{i}-con.sock", src),
                         follow_console_socket(f"{work}/qdst{i}-con.sock", dst)))
            sq, dq = Qmp(f"{work}/qsrc{i}-qmp.sock", src, f"qemu src{i}"), Qmp(f"{work}/qdst{i}-qmp.sock", dst,
                                                                              f"qemu dst{i}")
            qmps.append((sq, dq))
            for q in (sq, dq):
                q.execute("migrate-set-parameters", **{"max-bandwidth": 10**12})
            dq.execute("migrate-incoming", uri=f"tcp:{link.dst_ip}:{PORT + i}")
        # QEMU keeps no cache of an NBD disk: nothing to fill; its guests
        # only need to be reading for the window before.
        wait_passes(lambda: [s.snapshot() for s, _ in logs], 0, "qemu", args.warmup_limit_s)
        time.sleep(WINDOW_S + 1)
        t_start = time.monotonic()
        for i, (sq, _) in enumerate(qmps):
            sq.execute("migrate", uri=f"tcp:{link.dst_ip}:{PORT + i}")
        replies = [None] * n
        while any(r is None for r in replies):
            time.sleep(0.1)
            for i, (sq, _) in enumerate(qmps):
                if replies[i] is None:
                    reply = sq.execute("query-migrate")
                    if reply.get("status") in ("completed", "failed", "cancelled"):
                        replies[i] = reply
            if time.monotonic() - t_start > args.time_limit_s:
                raise HarnessError(f"qemu: migrations did not end within {args.time_limit_s} s")
        t_end = time.monotonic()
        time.sleep(WINDOW_S + 4)
        vms = []
        for i in range(n):
            if replies[i].get("status") != "completed":
                raise HarnessError(f"qemu VM {i}: {replies[i].get('error-desc')}")
            vm = figures(logs[i][0].snapshot(), logs[i][1].snapshot())
            vm["total_time_s"] = replies[i].get("total-time", 0) / 1e3
            vm["vmm_downtime_ms"] = replies[i].get("downtime")
            vms.append(vm)
        return {"config": "qemu", "vms": n, "wall_s": t_end - t_start, "per_vm": vms}
    finally:
        for sq, dq in qmps:
            for q in (sq, dq):
                try:
                    q.execute("quit")
                except (HarnessError, OSError, ValueError):
                    pass
                q.close()
        for p in procs:
            p.wait(5)
            stop_process(p)


def table(results):
    rows = ["| VMs | config | before MB/s | after MB/s | after ÷ before (min over VMs) | switch gap ms | total s |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        vms = r["per_vm"]
        mean = lambda key: sum(v[key] or 0 for v in vms) / max(1, len(vms))  # noqa: E731
        worst = min((v["ratio"] for v in vms if v["ratio"] is not None), default=None)
        rows.append(f"| {r['vms']} | {r['config']} | {mean('before_mbs'):.1f} | {mean('after_mbs'):.1f} | "
                    f"{'%.2f' % worst if worst is not None else 'n/a'} "
                    f"({', '.join('%.2f' % v['ratio'] if v['ratio'] is not None else 'n/a' for v in vms)}) | "
                    f"{mean('gap_ms'):.0f} | {mean('total_time_s'):.1f} |")
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
    p.add_argument("--storage-rate", default="100MB", help="the storage's bandwidth, shared")
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
    for n in vm_counts:
        args.guest_rate = base_rate or max(1, 160 // n)
        for config in configs:
            link = Link(parse_rate(args.link))
            storage = None
            try:
                link.setup()
                storage = Storage(args, work)
                print(f"disk_warm: {n} VM(s), {config} ...", file=sys.stderr, flush=True)
                r = run_qemu(args, n, link, storage, work) if config == "qemu" else \
                    run_tsubame(args, config, n, link, storage, work)
                r["guest_rate_mbs"] = args.guest_rate
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
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = table(results)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    for path in plot(results, args.out):
        print(f"plot: {path}")
    shutil.rmtree(work, ignore_errors=True)


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
