#!/usr/bin/env python3
"""Far memory against swapping (issue 19, the remote-swap paper): the same
guest with a working set 4x the local memory, its ops/s when the rest lives
on a memory host, in kernel swap on a local disk, or in zram.

Configurations (`--configs`):
  local        all of guest memory resident: the upper bound;
  far          tsubame --local-memory L --far-memory on `nbdkit memory`
               over a unix socket (loopback: the memory host is this
               machine);
  far-10g      the same over TCP to nbdkit in another network namespace,
               the veth between them shaped at --far-link (10 Gbit/s);
  swap-disk    tsubame without far memory in a memory cgroup (v1) limited
               to L plus --overhead (the VMM's own memory and the kernel's
               for KVM, charged to the cgroup), swapping to
               a swap file on the local disk;
  swap-zram    the same cgroup, swapping to /dev/zram0 (compressed RAM);
  qemu-swap-disk, qemu-swap-zram
               QEMU (KVM, the same guest ELF via -kernel, its progress on
               a debugcon socket) in the same cgroup and swap: the
               swapping baseline of another VMM.

Each runs `tsubame run` for --warmup seconds (kv loads its keys), then
reads the guest's ops over the next --seconds from the control socket and, for `far`, fault latency. Run as root (swap,
cgroups, namespaces).

Migration (`--migrate`): the same guest, after --warmup, migrated over a
unix socket paced at --link to `tsubame receive`, fully local
(`migrate-local`) and with --local-memory and the rest on a memory host
(`migrate-far`: only the resident pages and the far-page map move). It
reports the migration's total time, downtime and bytes, that the digest
verified, and the guest's ops at the destination over 3 s.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from tsubame_bench.console import TSC_KHZ_RE, LineLog, progress_points
from tsubame_bench.control import control_request
from tsubame_bench.link import Link, remove_stale_namespaces
from tsubame_bench.units import parse_rate, parse_size

CONFIGS = ["local", "far", "far-10g", "swap-disk", "swap-zram", "qemu-swap-disk", "qemu-swap-zram"]
MIGRATE_CONFIGS = ["migrate-local", "migrate-far"]
NBD_PORT = 10809
CGROUP_ROOT = "/sys/fs/cgroup/memory"


class HarnessError(Exception):
    pass


def sh(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def swap_off_all():
    subprocess.run(["swapoff", "-a"], stderr=subprocess.DEVNULL)
    with open("/proc/swaps") as f:
        for line in f.readlines()[1:]:
            subprocess.run(["swapoff", line.split()[0]], stderr=subprocess.DEVNULL)


class Swap:
    """A swap file on the local disk, or zram; the only swap while it lives."""

    def __init__(self, kind, size_bytes, work):
        swap_off_all()
        self.kind = kind
        if kind == "disk":
            self.path = os.path.join(work, "swapfile")
            sh("fallocate", "-l", str(size_bytes), self.path)
            os.chmod(self.path, 0o600)
        else:
            self.path = "/dev/zram0"
            subprocess.run(["swapoff", self.path], stderr=subprocess.DEVNULL)
            with open("/sys/block/zram0/reset", "w") as f:
                f.write("1")
            with open("/sys/block/zram0/disksize", "w") as f:
                f.write(str(size_bytes))
        sh("mkswap", self.path)
        sh("swapon", self.path)

    def stop(self):
        subprocess.run(["swapoff", self.path], stderr=subprocess.DEVNULL)
        if self.kind == "disk":
            os.unlink(self.path)
        else:
            with open("/sys/block/zram0/reset", "w") as f:
                f.write("1")


class Cgroup:
    """A memory cgroup (v1) with a limit; processes join it by pid."""

    def __init__(self, limit_bytes):
        if not os.path.isdir(CGROUP_ROOT):
            raise HarnessError(f"{CGROUP_ROOT} is missing: a v1 memory cgroup is needed")
        self.path = os.path.join(CGROUP_ROOT, f"tsb-far-{os.getpid()}")
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
        # Stall in reclaim rather than kill: at these limits the kernel's
        # OOM killer takes the VM when swapping does not keep up with it.
        with open(os.path.join(self.path, "memory.oom_control"), "w") as f:
            f.write("1")

    def command(self, cmd):
        # The shell joins the cgroup, then becomes the command.
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"] + cmd

    def stop(self):
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


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


def run_one(args, config, workload, work):
    """Runs the guest for --warmup + --seconds; its ops/s over the last --seconds."""
    sock = os.path.join(work, "vm.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    cmd = [args.tsubame, "run", "--quiet", "--no-hugepages", "--memory", args.memory, "--workload", workload,
           "--workload-arg", f"wss={args.wss}", "--control", sock]
    host, swap, cgroup, proc, link, qemu = None, None, None, None, None, None
    r = {"config": config, "workload": workload}
    try:
        if config.startswith("qemu-swap-"):
            swap = Swap(config[len("qemu-swap-"):], parse_size(args.memory), work)
            cgroup = Cgroup(parse_size(args.local) + parse_size(args.overhead))
            qemu = QemuGuest(args, workload, work, cgroup.command)
            time.sleep(args.warmup)
            t0, ops0 = time.monotonic(), qemu.ops()
            time.sleep(args.seconds)
            t1, ops1 = time.monotonic(), qemu.ops()
            if qemu.proc.poll() is not None:
                r["failed"] = f"qemu exit {qemu.proc.returncode}: {qemu.proc.stderr.read().strip()[-300:]}"
            elif ops0 is None or ops1 is None:
                r["failed"] = "no progress line from the guest"
            else:
                r["ops_per_sec"] = int((ops1 - ops0) / (t1 - t0))
            return r
        if config == "far":
            host = MemoryHost(args.memory, work)
            cmd += ["--local-memory", args.local, "--far-memory", host.uri()]
        elif config == "far-10g":
            link = Link(parse_rate(args.far_link))
            link.setup()
            host = MemoryHost(args.memory, work, link)
            cmd = link.netns_exec(link.src_ns) + cmd + ["--local-memory", args.local, "--far-memory", host.uri()]
        elif config.startswith("swap-"):
            swap = Swap(config[len("swap-"):], parse_size(args.memory), work)
            cgroup = Cgroup(parse_size(args.local) + parse_size(args.overhead))
            cmd = cgroup.command(cmd)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(args.warmup)
        t0, ops0 = time.monotonic(), guest_ops(sock)
        time.sleep(args.seconds)
        t1, ops1 = time.monotonic(), guest_ops(sock)
        if ops0 is None or ops1 is None:
            r["failed"] = "no answer on the control socket"
        else:
            r["ops_per_sec"] = int((ops1 - ops0) / (t1 - t0))
        try:
            control_request(sock, {"cmd": "quit"})
        except OSError:
            pass
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            r["failed"] = f"exit {proc.returncode}: {err.strip()[-300:]}"
        f = FAR.search(err)
        if f:
            r["fault_p50_us"], r["fault_p99_us"] = int(f.group(1)), int(f.group(2))
            r["far_summary"] = [line for line in err.splitlines() if "far memory:" in line][0]
        return r
    finally:
        if proc and proc.poll() is None:
            proc.kill()
            proc.wait()
        for thing in (qemu, host, cgroup, swap):
            if thing:
                thing.stop()
        if link:
            link.teardown()


def migrate_one(args, config, workload, work):
    """Boots, warms up, migrates at --link; the migration's figures."""
    sock, dest_sock, incoming = (os.path.join(work, n) for n in ("vm.sock", "dest.sock", "in.sock"))
    for path in (sock, dest_sock, incoming):
        if os.path.exists(path):
            os.unlink(path)
    cmd = [args.tsubame, "run", "--quiet", "--no-hugepages", "--memory", args.memory, "--workload", workload,
           "--workload-arg", f"wss={args.wss}", "--control", sock]
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
                              "--max-bandwidth", args.link, "--json", json_path, "--postcopy", args.postcopy],
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


def table(results):
    rows = ["| workload | config | ops/s | ÷ swap-disk | ÷ swap-zram | ÷ qemu-swap-disk | ÷ local | "
            "fault p50 / p99 µs |",
            "|---|---|---|---|---|---|---|---|"]
    by = {(r["workload"], r["config"]): r.get("ops_per_sec") for r in results}
    for r in results:
        w = r["workload"]
        if "ops_per_sec" not in r:
            rows.append(f"| {w} | {r['config']} | failed: {r.get('failed', '?')} | | | | | |")
            continue

        def ratio(base):
            b = by.get((w, base))
            return f"{r['ops_per_sec'] / b:.2f}" if b else ("∞" if b == 0 else "n/a")
        lat = f"{r['fault_p50_us']} / {r['fault_p99_us']}" if "fault_p50_us" in r else ""
        rows.append(f"| {w} | {r['config']} | {r['ops_per_sec']} | {ratio('swap-disk')} | {ratio('swap-zram')} | "
                    f"{ratio('qemu-swap-disk')} | {ratio('local')} | {lat} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory", default="640M", help="guest memory")
    p.add_argument("--wss", default="512M", help="the workload's working set")
    p.add_argument("--local", default="128M", help="local memory (1/4 of the working set)")
    p.add_argument("--overhead", default="64M",
                   help="added to the swap configurations' cgroup limit: the VMM's own memory (~7 MiB) and the "
                        "kernel memory a cgroup v1 charges for KVM's page tables, which far memory does not limit")
    p.add_argument("--workloads", default="kv,bwmem")
    p.add_argument("--far-link", default="10Gbit", help="the shaped link to the memory host of far-10g")
    p.add_argument("--configs", default=None, help=f"default: {','.join(CONFIGS)}; with --migrate: "
                                                   f"{','.join(MIGRATE_CONFIGS)}")
    p.add_argument("--migrate", action="store_true", help="measure migrations instead of ops/s")
    p.add_argument("--link", default="1Gbit", help="the migration's rate with --migrate")
    p.add_argument("--rate", help="with --migrate: the guest's write cap in MB/s (workload-arg rate=)")
    p.add_argument("--postcopy", default="off", help="with --migrate: `migrate --postcopy` (off, auto, after=N)")
    p.add_argument("--warmup", type=float, default=30, help="seconds before measuring (kv loads its keys)")
    p.add_argument("--seconds", type=float, default=20, help="seconds measured")
    p.add_argument("--tsubame", default="target/release/tsubame")
    p.add_argument("--qemu", default="qemu-system-x86_64")
    p.add_argument("--out", default="results/far-memory")
    args = p.parse_args(argv)
    known = MIGRATE_CONFIGS if args.migrate else CONFIGS
    args.configs = args.configs or ",".join(known)
    if os.geteuid() != 0:
        raise HarnessError("run as root (swap, cgroups)")
    args.tsubame = os.path.abspath(args.tsubame)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tsb-far-", dir="/var/tmp")
    remove_stale_namespaces()
    results = []
    try:
        for workload in args.workloads.split(","):
            for config in args.configs.split(","):
                if config not in known:
                    raise HarnessError(f"unknown config {config} (known: {', '.join(known)})")
                print(f"far_memory: {workload} {config} ...", file=sys.stderr, flush=True)
                r = (migrate_one if args.migrate else run_one)(args, config, workload, work)
                print(f"far_memory: {workload} {config}: {json.dumps(r)}", file=sys.stderr, flush=True)
                results.append(r)
                with open(os.path.join(args.out, "results.json"), "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        swap_off_all()
        subprocess.run(["rm", "-rf", work])
    text = migrate_table(results) if args.migrate else table(results)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    try:
        main()
    except HarnessError as e:
        print(f"far_memory: error: {e}", file=sys.stderr)
        sys.exit(1)
