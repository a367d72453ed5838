"""The warm disk cache across a migration against cold starts and QEMU
(bench/disk_warm.py): the storage model, one run per VMM, and the figures
read off the guests' progress lines."""

import json
import os
import time

from tsubame_bench import HarnessError
from tsubame_bench.console import parse_progress
from tsubame_bench.control import control_request
from tsubame_bench.procs import Proc, connect_unix, follow_console_socket, stop_process, wait_for_path
from tsubame_bench.qmp import Qmp
from tsubame_bench.units import parse_rate

PORT = 47310
CONFIGS = ["tsubame-cold", "tsubame-source-warm", "tsubame-list", "tsubame-warm", "tsubame-warm-all", "qemu"]
# What each tsubame configuration adds to `tsubame migrate`.
MIGRATE_FLAGS = {
    "tsubame-cold": [],
    "tsubame-source-warm": ["--no-warm-cache"],
    "tsubame-list": ["--warm-data", "none"],
    "tsubame-warm": [],
    "tsubame-warm-all": ["--warm-data", "all"],
}
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
            cmd += MIGRATE_FLAGS[config]
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
           "-drive", f"file={storage.uri()},format=raw,if=none,id=d0,cache=writeback",
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
        # cache=writeback, the counterpart of tsubame's host cache, keeps
        # nothing of an NBD disk (the host page cache fronts files; QEMU's
        # NBD client has no cache): nothing to fill; its guests only need
        # to be reading for the window before.
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
