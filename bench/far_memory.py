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
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

from tsubame_bench.console import TSC_KHZ_RE, LineLog, progress_points
from tsubame_bench.control import control_request
from tsubame_bench.link import Link, remove_stale_namespaces
from tsubame_bench.memlimit import Cgroup, HostSwap, HostThp, MemLimitError, Swap
from tsubame_bench.units import parse_rate, parse_size

CONFIGS = ["local", "far", "far-10g", "swap-disk", "swap-zram", "qemu-local", "qemu-swap-disk", "qemu-swap-zram"]
DEFAULT_CONFIGS = [c for c in CONFIGS if c != "far-10g"]
FULLY_LOCAL = ("local", "qemu-local")
MIGRATE_CONFIGS = ["migrate-local", "migrate-far"]
NBD_PORT = 10809
BASELINE_FRACTION = 0.5
# Far memory's own buffers beyond the VMM's base, taken out of its
# --local-memory so that it lives in the same budget as the swapping VMM:
# an eviction batch (8 MiB) and its copy queued for the memory host
# (measured: kv at 1/2 local peaked 20 MiB over --local-memory, 6 of them
# the VMM's base).
FAR_ROOM = 16 << 20


class HarnessError(Exception):
    pass


def sh(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def vmm_of(config):
    return "qemu" if config.startswith("qemu-") else "tsubame"


def swap_kind(config):
    return config.rsplit("-", 1)[1] if "swap-" in config else None


class MemoryHost:
    """`nbdkit memory SIZE`: on a unix socket, or on TCP inside `link`'s
    destination namespace."""

    def __init__(self, size, work, link=None):
        self.sock = os.path.join(work, "mem.sock")
        self.link = link
        if os.path.exists(self.sock):
            os.unlink(self.sock)  # a killed nbdkit leaves its socket behind
        if link:
            cmd = link.netns_exec(link.dst_ns) + ["nbdkit", "-f", "-i", link.dst_ip, "-p", str(NBD_PORT),
                                                   "memory", size]
        else:
            cmd = ["nbdkit", "-f", "-U", self.sock, "memory", size]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            if self.ready():
                return
            time.sleep(0.02)
        raise HarnessError("nbdkit did not start (apt-get install nbdkit)")

    def ready(self):
        if not self.link:
            return os.path.exists(self.sock)
        probe = self.link.netns_exec(self.link.src_ns) + [
            "python3", "-c", f"import socket; socket.create_connection(('{self.link.dst_ip}', {NBD_PORT}), 1)"]
        return subprocess.run(probe, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

    def uri(self):
        if self.link:
            return f"nbd://{self.link.dst_ip}:{NBD_PORT}/"
        return f"nbd+unix:///?socket={self.sock}"

    def stop(self):
        self.proc.kill()
        self.proc.wait()


FAR = re.compile(r"p50 (\d+) µs, p99 (\d+) µs")


class QemuGuest:
    """The guest under QEMU: the same ELF and command line as `tsubame run`; its
    progress lines from a debugcon chardev socket."""

    def __init__(self, args, workload, work, wrap):
        elf = os.path.join(work, "guest.elf")
        if not os.path.exists(elf):
            sh(args.tsubame, "guest-elf", elf)
        cmdline = f"workload={workload} wss={args.wss} tsc_khz={tsc_khz(args.tsubame)}"
        console = os.path.join(work, "qemu-con.sock")
        if os.path.exists(console):
            os.unlink(console)
        cmd = [args.qemu, "-enable-kvm", "-cpu", "host,-arch-capabilities", "-m", args.memory, "-nodefaults",
               "-nographic", "-kernel", elf, "-append", cmdline,
               "-chardev", f"socket,id=d,path={console},server=on,wait=off",
               "-device", "isa-debugcon,iobase=0xe9,chardev=d"]
        self.proc = subprocess.Popen(wrap(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log = LineLog()
        for _ in range(500):
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(console)
                self.log.follow(s.makefile("rb"))
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise HarnessError(f"qemu exited: {self.proc.stderr.read().strip()[-300:]}")
                time.sleep(0.02)
        raise HarnessError("qemu's console socket did not come up")

    def ops(self):
        points = progress_points(self.log.snapshot())
        return points[-1][1] if points else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_TSC = {}


def tsc_khz(tsubame):
    """The host TSC rate as tsubame reads it from KVM (its guest's banner)."""
    if tsubame not in _TSC:
        p = subprocess.run([tsubame, "run", "--memory", "16M", "--workload", "idle", "--seconds", "0.3"],
                           capture_output=True, text=True, timeout=30)
        m = TSC_KHZ_RE.search(p.stdout)
        if not m:
            raise HarnessError(f"cannot read tsc_khz from `tsubame run`: {p.stderr.strip()}")
        _TSC[tsubame] = int(m.group(1))
    return _TSC[tsubame]


def guest_ops(sock):
    try:
        return control_request(sock, {"cmd": "stats"})["guest"]["ops"]
    except (OSError, ValueError, KeyError):
        return None


def tsubame_command(args, workload, sock):
    return [args.tsubame, "run", "--quiet", "--no-hugepages", "--memory", args.memory, "--workload", workload,
            "--workload-arg", f"wss={args.wss}", "--control", sock]


def measure_overhead(args, vmm, work):
    """The most memory the VMM's process uses with an idle guest of the same
    size (its code, threads and buffers, KVM's pages charged to it), in a
    cgroup without a limit; rounded up to MiB."""
    cgroup = Cgroup(f"overhead-{vmm}", None, args.swappiness)
    try:
        if vmm == "qemu":
            guest = QemuGuest(args, "idle", work, cgroup.command)
            time.sleep(3)
            guest.stop()
        else:
            sock = os.path.join(work, "idle.sock")
            cmd = tsubame_command(args, "idle", sock) + ["--seconds", "3"]
            p = subprocess.run(cgroup.command(cmd), capture_output=True, text=True, timeout=60)
            if p.returncode != 0:
                raise HarnessError(f"tsubame run (idle, to measure its overhead) failed: {p.stderr.strip()[-300:]}")
        return -(-cgroup.max_usage() // 2**20) * 2**20
    finally:
        cgroup.stop()


def stopped_by(returncode):
    if returncode is None or returncode >= 0:
        return f"exit {returncode}"
    return {-9: "killed (SIGKILL)", -11: "SIGSEGV"}.get(returncode, f"signal {-returncode}")


def run_one(args, config, workload, fraction, overhead, work):
    """Runs the guest for --warmup + --seconds in its budget; its ops/s over
    the last --seconds, and what the budget saw."""
    sock = os.path.join(work, "vm.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    vmm, kind = vmm_of(config), swap_kind(config)
    local = None if config in FULLY_LOCAL else int(parse_size(args.wss) * fraction) // 2**20 * 2**20
    r = {"config": config, "workload": workload, "vmm": vmm, "fraction": 1.0 if local is None else fraction}
    if local is not None:
        r["local_mib"], r["limit_mib"] = local >> 20, (local + overhead[vmm]) >> 20
    host, swap, proc, link, qemu = None, None, None, None, None
    cgroup = Cgroup(config, None if local is None else local + overhead[vmm], args.swappiness)
    try:
        if kind:
            swap = Swap(kind, parse_size(args.memory), work)
        if vmm == "qemu":
            qemu = QemuGuest(args, workload, work, cgroup.command)
            proc, ops = qemu.proc, qemu.ops
        else:
            cmd = tsubame_command(args, workload, sock)
            if config in ("far", "far-10g"):
                if config == "far-10g":
                    link = Link(parse_rate(args.far_link))
                    link.setup()
                host = MemoryHost(args.memory, work, link)
                r["far_local_mib"] = (local - FAR_ROOM) >> 20
                cmd += ["--local-memory", str(local - FAR_ROOM), "--far-memory", host.uri()]
            cmd = cgroup.command(cmd)
            if link:
                cmd = link.netns_exec(link.src_ns) + cmd
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            ops = functools.partial(guest_ops, sock)
        peak_swap = 0

        def watch(seconds):
            # The swap in use, sampled: an OOM kill frees it at once.
            nonlocal peak_swap
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                peak_swap = max(peak_swap, swap.used_bytes() if swap else 0)
                time.sleep(min(0.5, max(0, end - time.monotonic())))

        watch(args.warmup)
        t0, ops0 = time.monotonic(), ops()
        watch(args.seconds)
        t1, ops1 = time.monotonic(), ops()
        if ops0 is not None and ops1 is not None:
            r["ops_per_sec"] = int((ops1 - ops0) / (t1 - t0))
        # What the budget saw, read before the VMM quits and frees it.
        r["max_usage_mib"] = cgroup.max_usage() >> 20
        r["oom_kills"] = cgroup.oom_kills()
        if swap:
            r["swap_peak_mib"] = peak_swap >> 20
            if not r.get("ops_per_sec"):
                r["why"] = cgroup.why_stalled(peak_swap)
        alive = proc.poll() is None
        if alive and vmm == "tsubame":
            try:
                control_request(sock, {"cmd": "quit"})
            except OSError:
                pass
        elif alive:
            proc.kill()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        err = err or ""
        said = f": {err.strip()[-200:]}" if err.strip() else ""
        if not alive:
            r["failed"] = f"the VMM died during the run, {stopped_by(proc.returncode)}{said}"
        elif vmm == "tsubame" and proc.returncode != 0:
            r["failed"] = f"{stopped_by(proc.returncode)}{said}"
        elif "ops_per_sec" not in r:
            r["failed"] = "no progress reading from the guest"
        if "failed" in r:
            r.pop("ops_per_sec", None)
        f = FAR.search(err)
        if f:
            r["fault_p50_us"], r["fault_p99_us"] = int(f.group(1)), int(f.group(2))
        return r
    finally:
        if proc and proc.poll() is None:
            proc.kill()
            proc.wait()
        for thing in (host, swap):
            if thing:
                thing.stop()
        cgroup.stop()
        if link:
            link.teardown()


def migrate_one(args, config, workload, work):
    """Boots, warms up, migrates at --link; the migration's figures."""
    sock, dest_sock, incoming = (os.path.join(work, n) for n in ("vm.sock", "dest.sock", "in.sock"))
    for path in (sock, dest_sock, incoming):
        if os.path.exists(path):
            os.unlink(path)
    cmd = tsubame_command(args, workload, sock)
    if args.rate:
        cmd += ["--workload-arg", f"rate={args.rate}"]
    host, proc, dest = None, None, None
    r = {"config": config, "workload": workload}
    try:
        if config == "migrate-far":
            host = MemoryHost(args.memory, work)
            cmd += ["--local-memory", args.local, "--far-memory", host.uri()]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        dest = subprocess.Popen([args.tsubame, "receive", "--quiet", "--no-hugepages", "--listen",
                                 f"unix:{incoming}", "--control", dest_sock],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(args.warmup)
        before = control_request(sock, {"cmd": "stats"})
        r["far_pages_before"] = (before.get("far_memory") or {}).get("far_pages", 0)
        json_path = os.path.join(work, "migration.json")
        out = subprocess.run([args.tsubame, "migrate", "--control", sock, "--to", f"unix:{incoming}",
                              "--max-bandwidth", args.link, "--json", json_path]
                             + (["--postcopy", args.postcopy] if args.postcopy else []),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        if out.returncode != 0:
            r["failed"] = out.stdout.strip()[-300:]
            return r
        with open(json_path) as f:
            stats = json.load(f)
        r.update({k: stats.get(k) for k in ("status", "total_time_ms", "downtime_ms", "bytes_on_wire",
                                            "digest_verified", "iterations", "pages_sent", "postcopy")})
        ops0 = guest_ops(dest_sock)
        time.sleep(3)
        ops1 = guest_ops(dest_sock)
        r["dest_ops_per_sec"] = int((ops1 - ops0) / 3) if ops0 is not None and ops1 is not None else None
        after = control_request(dest_sock, {"cmd": "stats"})
        r["dest_far_error"] = (after.get("far_memory") or {}).get("error")
        r["dest_guest_error"] = after["guest"].get("error")
        try:
            control_request(dest_sock, {"cmd": "quit"})
        except OSError:
            pass
        return r
    finally:
        for p in (proc, dest):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        if host:
            host.stop()


def migrate_table(results):
    rows = ["| workload | config | total s | ÷ migrate-local | downtime ms | MiB sent | digest | dest ops/s |",
            "|---|---|---|---|---|---|---|---|"]
    by = {(r["workload"], r["config"]): r.get("total_time_ms") for r in results}
    for r in results:
        if "total_time_ms" not in r:
            rows.append(f"| {r['workload']} | {r['config']} | failed: {r.get('failed', '?')} | | | | | |")
            continue
        base = by.get((r["workload"], "migrate-local"))
        ratio = f"{r['total_time_ms'] / base:.2f}" if base else "n/a"
        rows.append(f"| {r['workload']} | {r['config']} | {r['total_time_ms'] / 1e3:.1f} | {ratio} | "
                    f"{r['downtime_ms']:.0f} | {r['bytes_on_wire'] / 2**20:.0f} | "
                    f"{'verified' if r['digest_verified'] else 'NOT verified'} | {r['dest_ops_per_sec']} |")
    return "\n".join(rows)


def fraction_label(f):
    return {0.75: "3/4", 0.5: "1/2", 0.25: "1/4"}.get(f, f"{f:g}")


def table(results, fractions, overhead, swappiness, thp):
    """ops/s per configuration and local fraction, far memory's ratios to
    each swap baseline, and a note for every run that gave no figure."""
    notes = []

    def cell(r):
        if r is None:
            return ""
        if "ops_per_sec" not in r or r["ops_per_sec"] == 0:
            notes.append(f"{r['workload']} {r['config']} at {fraction_label(r['fraction'])} local: "
                         f"{r.get('failed') or '0 ops/s'}{'; ' + r['why'] if 'why' in r else ''}")
            return f"{'failed' if 'failed' in r else '0'} [{len(notes)}]"
        text = f"{r['ops_per_sec']:,}"
        return text + (f" (p99 {r['fault_p99_us']} µs)" if "fault_p99_us" in r else "")

    by = {(r["workload"], r["config"], r["fraction"]): r for r in results}
    heads = [f"{fraction_label(f)} local" for f in fractions] + ["fully local"]
    rows = ["VMM overhead added to each budget (measured with an idle guest of the same size): "
            + ", ".join(f"{vmm} {v >> 20} MiB" for vmm, v in sorted(overhead.items()))
            + f"; swappiness {swappiness}; transparent huge pages {thp}; OOM killer on; far memory's "
            f"--local-memory is {FAR_ROOM >> 20} MiB below the local memory (its own buffers).", "",
            "| workload | config | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    configs = [c for c in CONFIGS if any(r["config"] == c for r in results)]
    for w in workloads:
        for c in configs:
            cells = [cell(by.get((w, c, f))) if c not in FULLY_LOCAL else "" for f in fractions]
            cells.append(cell(by.get((w, c, 1.0))) if c in FULLY_LOCAL else "")
            rows.append(f"| {w} | {c} | " + " | ".join(cells) + " |")
        for base in ("swap-disk", "swap-zram", "qemu-swap-disk", "qemu-swap-zram", "local"):
            cells = []
            for f in fractions:
                far, b = by.get((w, "far", f)), by.get((w, base, 1.0 if base == "local" else f))
                fo, bo = (far or {}).get("ops_per_sec"), (b or {}).get("ops_per_sec")
                if fo and bo:
                    cells.append(f"{fo / bo:.2f}×")
                elif fo and b and (bo == 0 or "failed" in b):
                    cells.append("∞ (it " + ("failed)" if "failed" in b else "made 0)"))
                else:
                    cells.append("")
            if any(cells):
                rows.append(f"| {w} | far ÷ {base} | " + " | ".join(cells + [""]) + " |")
    if notes:
        rows += [""] + [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(rows)


def plot(results, fractions, path):
    """ops/s against the local fraction, one panel per workload."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("far_memory: matplotlib missing, no plot (pip install -r bench/requirements.txt)", file=sys.stderr)
        return
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for c in CONFIGS:
            points = sorted((r["fraction"], r.get("ops_per_sec", 0)) for r in results
                            if r["workload"] == w and r["config"] == c)
            if not points:
                continue
            if c in FULLY_LOCAL:
                ax.axhline(max(points[0][1], 1), linestyle=":", color="grey" if c == "local" else "tan", label=c)
            else:
                ax.plot([p[0] for p in points], [max(p[1], 1) for p in points], marker="o", label=c)
        ax.set_yscale("log")
        ax.set_xticks(fractions)
        ax.set_xlabel("local memory ÷ working set")
        ax.set_ylabel("guest ops/s (0 drawn as 1)")
        ax.set_title(w)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_order(workloads, fractions):
    """kv first, 1/2 local first: the baseline check runs before the rest."""
    ws = sorted(workloads, key=lambda w: w != "kv")
    fs = sorted(fractions, key=lambda f: f != BASELINE_FRACTION)
    return [(w, f) for w in ws for f in fs]


def baseline_broken(results, configs):
    """Why kernel swap failed to carry kv at 1/2 local for a VMM, or None."""
    for config in ("swap-disk", "qemu-swap-disk"):
        if config not in configs:
            continue
        r = next((r for r in results if r["workload"] == "kv" and r["config"] == config
                  and r["fraction"] == BASELINE_FRACTION), None)
        if r and not r.get("ops_per_sec"):
            return (f"the swap baseline does not work: {config} carried kv at 1/2 local at 0 ops/s "
                    f"({r.get('failed') or r.get('why', 'no progress')}); no comparison against it is made")
    return None


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
