"""Far memory against kernel swap under one memory budget
(bench/far_memory.py): the configurations, the memory host, QEMU's guest,
and one run of each kind (ops/s in a budget, a migration)."""

import functools
import json
import os
import re
import socket
import subprocess
import time

from tsubame_bench import HarnessError
from tsubame_bench.console import TSC_KHZ_RE, LineLog, progress_points
from tsubame_bench.control import control_request
from tsubame_bench.link import Link
from tsubame_bench.memlimit import Cgroup, Swap
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
