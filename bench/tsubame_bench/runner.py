"""One run: boot the guest under a VMM at both ends, migrate it across the link, watch the destination (QEMU's runner and tsubame's)."""
import datetime
import json
import os
import time
from dataclasses import dataclass

from tsubame_bench import HarnessError
from tsubame_bench.console import (guest_downtime_ms, guest_errors, guest_stall, max_gap_ms,
                                   ops_continuous, ops_done_rate, ops_rate, parse_progress, progress_points,
                                   switchover)
from tsubame_bench.control import control_request
from tsubame_bench.demo import tsubame_figures
from tsubame_bench.link import Link
from tsubame_bench.procs import (CpuSampler, Proc, follow_console_socket, stop_process,
                                 wait_for_path, wait_until)
from tsubame_bench.qmp import Qmp, qemu_figures, stop_resume_ms
from tsubame_bench.units import tsubame_rate_arg

@dataclass
class Env:
    """What every run needs: binaries, the guest, the TSC rate, where to put sockets and logs."""

    tsubame: str
    qemu: str
    guest_elf: str
    tsc_khz: int
    sock_dir: str
    log_dir: str
from tsubame_bench.cases import guest_cmdline
from tsubame_bench.results import RunResult

MIGRATION_PORT = 47001
POLL_S = 0.1  # query-migrate / CPU sampling period, the same for both VMMs


def wait_for_progress(log, proc, what, timeout_s=30):
    """Waits for the first progress line in log; fails on a guest error or a dead process."""
    def printed_progress():
        lines = log.snapshot()
        errors = guest_errors(lines)
        if errors:
            raise HarnessError(f"{what}: guest error: {errors[0]}")
        return bool(progress_points(lines))
    try:
        wait_until(printed_progress, proc, "the guest printed progress", timeout_s, poll_s=0.05)
    except HarnessError as e:
        raise HarnessError(f"{what}: {e}") from None


def wait_for_passes(log, proc, what, passes, timeout_s=60):
    """Waits until the guest reports `passes` completed sweeps over its working set."""
    if passes <= 0:
        return

    def swept():
        return any((parse_progress(text) or {}).get("pass", 0) >= passes for _, text in log.snapshot())
    try:
        wait_until(swept, proc, f"the guest completed {passes} pass(es)", timeout_s, poll_s=0.05)
    except HarnessError as e:
        raise HarnessError(f"{what}: {e}") from None


def check_banner(log, what, tsc_khz):
    """The guest's first line must show it took tsc_khz from the command line."""
    lines = [text for _, text in log.snapshot() if text.startswith("tsubame-guest:")]
    if not lines:
        raise HarnessError(f"{what}: the guest printed no banner line")
    banner = lines[0]
    if f"tsc_khz={tsc_khz} (cmdline)" not in banner:
        raise HarnessError(f"{what}: the guest did not take tsc_khz={tsc_khz} from its command line: {banner}")
    return banner


def watch_destination(dst_log, src_log, t_end, watch_s, what):
    """Watches the destination for watch_s after the migration; fails unless it keeps printing progress."""
    time.sleep(watch_s)
    errors = guest_errors(dst_log.snapshot()) + guest_errors(src_log.snapshot())
    if errors:
        raise HarnessError(f"{what}: guest error after migration: {errors[0]}")
    after = [t for t, _ in progress_points(dst_log.snapshot()) if t > t_end]
    if len(after) < 2:
        raise HarnessError(f"{what}: the destination printed {len(after)} progress line(s) in the "
                           f"{watch_s:.0f} s after the migration completed")


def wait_for_destination(dst_log, t_start, samplers, timeout_s):
    """After the VMM reported completion: waits until the destination's guest printed progress
    (QEMU's source reports `completed` before its destination has loaded the last state), sampling
    CPU meanwhile, so that the CPU window ends with the guest running at the destination."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(t >= t_start for t, _ in progress_points(dst_log.snapshot())):
            break
        for sampler in samplers:
            sampler.sample()
        time.sleep(0.02)
    for sampler in samplers:
        sampler.sample()


def save_console(log, path, t0):
    """Writes a console's lines as 'seconds-from-t0<TAB>text' (the format of bench/testdata/*-console.txt)."""
    with open(path, "w") as f:
        for t, text in log.snapshot():
            f.write(f"{t - t0:.4f}\t{text}\n")


def read_console(path):
    """Reads a file written by save_console -> [(t, text)]."""
    lines = []
    with open(path) as f:
        for line in f:
            t, _, text = line.rstrip("\n").partition("\t")
            lines.append((float(t), text))
    return lines


def fill_guest_figures(result, src_log, dst_log, t_start, t_end, case, log_prefix):
    """Guest-observed downtime, ops/s and the timeline, from the two timestamped line logs."""
    save_console(src_log, f"{log_prefix}-src-console.txt", t_start)
    save_console(dst_log, f"{log_prefix}-dst-console.txt", t_start)
    src = [p for p in progress_points(src_log.snapshot()) if p[0] <= t_end]  # a timed-out source runs on
    dst = progress_points(dst_log.snapshot())
    t_src_last, t_dst_first, gap = switchover(src, dst, t_start)
    result.switchover_gap_ms = gap
    result.time_to_destination_s = None if t_dst_first is None else t_dst_first - t_start
    result.guest_downtime_ms = guest_downtime_ms(src, dst, t_src_last, t_dst_first)
    fill_stall_figures(result, src_log.snapshot(), dst_log.snapshot(), t_start, t_end,
                       max(t_end, t_dst_first or t_end) + case.watch_s)
    result.max_source_gap_ms = max_gap_ms(src, t_start, t_src_last if t_src_last else t_end)
    result.ops_per_sec_before = ops_rate(src, t_start - case.warmup_s / 2, t_start)  # after first-touch faults
    result.ops_per_sec_during = ops_rate(src, t_start, t_src_last if t_src_last else t_end)
    if t_dst_first is not None:
        result.ops_per_sec_after = ops_rate(dst, t_dst_first, t_dst_first + case.watch_s)
    result.ops_continuous = ops_continuous([p for p in src if p[0] <= (t_src_last or t_end)], dst)
    if result.postcopy_start_s is not None and result.postcopy_duration_s:
        # Over the phase's first 90 %: as its last pages arrive a rate-capped guest catches up in
        # a burst (tens of Mops/s for a few ms), which says nothing about the phase and, landing
        # just inside or outside the window, decided the figure. The phase starts when the guest
        # last ran at the source, for both VMMs: QEMU's is dated when migrate-start-postcopy was
        # asked, and its guest ran on at the source for 0.2 s more. Only the ops printed after
        # the destination's first line count: that line carries what the guest did at the
        # source after its last line there (counted, they added 2-3 k ops/s to QEMU's 4 GiB
        # fill-random phase, 5-23 k to tsubame's sparse).
        begin = t_start + result.postcopy_start_s
        end = begin + result.postcopy_duration_s
        if t_src_last is not None:
            begin = min(max(begin, t_src_last), end)
        result.ops_per_sec_postcopy = ops_done_rate(src, dst, begin, begin + 0.9 * (end - begin),
                                                    counted_from=t_dst_first)
    result.destination_progress_lines = len(dst)
    result.migration_end_s = round(t_end - t_start, 4)
    result.timeline = {
        "source": [[round(t - t_start, 4), ops] for t, ops in src if t >= t_start - case.warmup_s],
        "destination": [[round(t - t_start, 4), ops] for t, ops in dst],
    }


def fill_stall_figures(result, src_lines, dst_lines, t_start, t_end, t_watch_end):
    """The guest's own largest stall (`gap_us`) in the source's lines from migration start to its end and
    the destination's up to the end of the watch; and the VMMs' stop -> resume from the times run_qemu
    or run_tsubame filled in."""
    gap, side, at = guest_stall(src_lines, dst_lines, t_start, t_end, t_watch_end)
    result.guest_stall_ms, result.guest_stall_side = gap, side
    result.guest_stall_at_s = None if at is None else round(at - t_start, 4)
    result.vmm_stop_resume_ms = stop_resume_ms(result.vmm_stopped_at_unix_s, result.vmm_resumed_at_unix_s)


def new_result(case, config, rep, env):
    return RunResult(case=case.name, config=config.name, vmm=config.vmm, repetition=rep,
                     started_at=datetime.datetime.now().isoformat(timespec="seconds"), memory=case.memory,
                     workload=case.workload, link=case.link, max_bandwidth_bits=case.bandwidth_bits(),
                     cmdline=guest_cmdline(case, env.tsc_khz), status="failed")


def qemu_command(env, case, config, tag, incoming):
    accel = ["-accel", config.accel] if config.accel else ["-enable-kvm"]
    cmd = [env.qemu, "-name", f"tsb-{tag},debug-threads=on",  # names the vCPU thread "CPU 0/KVM"
           *accel, "-cpu", "host,-arch-capabilities", "-m", case.memory, "-nodefaults", "-nographic",
           "-kernel", env.guest_elf, "-append", guest_cmdline(case, env.tsc_khz),
           "-chardev", f"socket,id=d,path={env.sock_dir}/{tag}-con.sock,server=on,wait=off",
           "-device", "isa-debugcon,iobase=0xe9,chardev=d",
           "-qmp", f"unix:{env.sock_dir}/{tag}-qmp.sock,server=on,wait=off"]
    return cmd + (["-incoming", "defer"] if incoming else ["-S"])  # the source starts paused: no line is lost


def qemu_migration_settings(case, config):
    """(capabilities list for migrate-set-capabilities, parameters dict for migrate-set-parameters)."""
    names = list(config.capabilities)
    if config.qemu_postcopy() and "postcopy-ram" not in names:
        names.append("postcopy-ram")
    caps = [{"capability": c, "state": True} for c in names]
    bits = case.bandwidth_bits()
    # QEMU's default max-bandwidth is 128 MiB/s (7.2 and 10): always set it; "unlimited" is 1 TB/s.
    params = {"max-bandwidth": int(bits / 8) if bits else 10**12, "downtime-limit": case.downtime_limit_ms}
    params.update(config.parameters)
    return caps, params


def run_qemu(case, config, rep, env, link, run_tag):
    result = new_result(case, config, rep, env)
    what = f"{case.name}/{config.name}#{rep}"
    for tag in ("src", "dst"):
        for kind in ("con", "qmp"):
            if os.path.exists(f"{env.sock_dir}/{tag}-{kind}.sock"):
                os.unlink(f"{env.sock_dir}/{tag}-{kind}.sock")
    caps, params = qemu_migration_settings(case, config)
    uri = f"tcp:{link.dst_ip}:{MIGRATION_PORT}"
    src = dst = src_qmp = dst_qmp = None
    try:
        dst = Proc(f"{what} QEMU destination", link.netns_exec(link.dst_ns) + qemu_command(env, case, config, "dst", True),
                   os.path.join(env.log_dir, f"{run_tag}-dst.log"))
        src = Proc(f"{what} QEMU source", link.netns_exec(link.src_ns) + qemu_command(env, case, config, "src", False),
                   os.path.join(env.log_dir, f"{run_tag}-src.log"))
        dst_log = follow_console_socket(f"{env.sock_dir}/dst-con.sock", dst)
        src_log = follow_console_socket(f"{env.sock_dir}/src-con.sock", src)
        dst_qmp = Qmp(f"{env.sock_dir}/dst-qmp.sock", dst, f"{what} destination")
        src_qmp = Qmp(f"{env.sock_dir}/src-qmp.sock", src, f"{what} source")
        for qmp in (dst_qmp, src_qmp):
            if caps:
                qmp.execute("migrate-set-capabilities", capabilities=caps)
            qmp.execute("migrate-set-parameters", **params)
            check_qemu_settings(qmp, caps, params)
        if config.qemu_postcopy():
            # the vCPUs' time blocked on missing pages, read back from the destination
            dst_qmp.execute("migrate-set-capabilities",
                            capabilities=[{"capability": "postcopy-blocktime", "state": True}])
        dst_qmp.execute("migrate-incoming", uri=uri)
        src_qmp.execute("cont")
        wait_for_progress(src_log, src, f"{what} source")
        result.guest_banner_source = check_banner(src_log, f"{what} source", env.tsc_khz)
        wait_for_passes(src_log, src, f"{what} source", case.warmup_passes)
        time.sleep(case.warmup_s)

        cpu_src, cpu_dst = CpuSampler(src.pid), CpuSampler(dst.pid)
        tx0 = link.tx_bytes()
        cpu_src.sample(), cpu_dst.sample()
        t_start = time.monotonic()
        src_qmp.execute("migrate", uri=uri)
        postcopy_asked = postcopy_seen = None
        while True:
            time.sleep(POLL_S)
            cpu_src.sample(), cpu_dst.sample()
            reply = src_qmp.execute("query-migrate")
            if reply.get("status") in ("completed", "failed", "cancelled"):
                t_done = time.monotonic()
                for _ in range(10):
                    # QEMU 7.2 (seen with multifd) may say completed before it has set total-time and
                    # downtime: a reply with 0 for both is asked again
                    if reply.get("status") != "completed" or reply.get("total-time"):
                        break
                    time.sleep(0.05)
                    reply = src_qmp.execute("query-migrate")
                break
            if config.qemu_postcopy() and postcopy_asked is None and qemu_postcopy_due(config, reply, t_start):
                src_qmp.execute("migrate-start-postcopy")
                postcopy_asked = time.monotonic()
            if postcopy_seen is None and reply.get("status") == "postcopy-active":
                postcopy_seen = time.monotonic()
            if time.monotonic() - t_start > case.time_limit_s:
                src_qmp.execute("migrate_cancel")
                break
        t_end = time.monotonic() if reply.get("status") not in ("completed", "failed", "cancelled") else t_done
        if reply.get("status") == "completed":
            wait_for_destination(dst_log, t_start, [cpu_src, cpu_dst], case.watch_s)
        cpu_src.sample(), cpu_dst.sample()
        result.bytes_on_wire = link.tx_bytes() - tx0
        result.wall_time_s = t_end - t_start
        result.vmm_stats = reply
        figures = qemu_figures(reply)
        for key in ("total_time_s", "vmm_downtime_ms", "setup_time_ms", "iterations", "vmm_bytes"):
            setattr(result, key, figures[key])
        if not result.total_time_s:
            # still 0 after asking again: the harness's own clock, and no downtime figure
            result.total_time_s, result.vmm_downtime_ms = result.wall_time_s, None
        if postcopy_asked is not None and reply.get("status") == "completed":
            # the phase starts when it was asked for (QEMU says postcopy-active within a poll)
            result.postcopy_start_s = postcopy_asked - t_start
            result.postcopy_duration_s = t_end - postcopy_asked
            blocktime = dst_qmp.execute("query-migrate").get("postcopy-blocktime")
            result.postcopy_blocktime_ms = None if blocktime is None else float(blocktime)
        result.cpu_source_s, result.cpu_source_vcpu_s = cpu_src.seconds()
        result.cpu_destination_s, result.cpu_destination_vcpu_s = cpu_dst.seconds()
        if reply.get("status") == "completed":
            result.status, result.converged = "completed", True
        elif reply.get("status") in ("failed",):
            result.error = f"QEMU migration failed: {reply.get('error-desc', 'no error-desc')}"
            raise HarnessError(f"{what}: {result.error}")
        else:
            result.status, result.converged = "timeout", False
            result.total_time_s = result.wall_time_s
            result.error = f"not completed within {case.time_limit_s:.0f} s (QEMU status {reply.get('status')})"
            fill_guest_figures(result, src_log, dst_log, t_start, t_end, case, os.path.join(env.log_dir, run_tag))
            return result
        watch_destination(dst_log, src_log, t_end, case.watch_s, what)
        state = dst_qmp.execute("query-status")
        # the source's STOP of the switch (its last) and the destination's RESUME (its first), read by now
        stops, resumes = src_qmp.event_times("STOP"), dst_qmp.event_times("RESUME")
        result.vmm_stopped_at_unix_s = stops[-1] if stops else None
        result.vmm_resumed_at_unix_s = resumes[0] if resumes else None
        if state.get("status") != "running":
            raise HarnessError(f"{what}: QEMU destination is '{state.get('status')}', not running, after migration")
        fill_guest_figures(result, src_log, dst_log, t_start, t_end, case, os.path.join(env.log_dir, run_tag))
        return result
    finally:
        for qmp in (src_qmp, dst_qmp):
            if qmp is not None:
                try:
                    qmp.execute("quit")
                except (HarnessError, OSError, ValueError):
                    pass
                qmp.close()
        for p in (src, dst):
            if p is not None:
                p.wait(5)
                stop_process(p)


def check_qemu_settings(qmp, caps, params):
    """Reads the capabilities and parameters back (query-migrate-capabilities, query-migrate-parameters):
    a configuration QEMU took other than asked would measure something else."""
    on = {c["capability"] for c in qmp.execute("query-migrate-capabilities") if c["state"]}
    off = [c["capability"] for c in caps if c["capability"] not in on]
    got = qmp.execute("query-migrate-parameters")
    differ = [f"{k}={got.get(k)!r} (asked {v!r})" for k, v in params.items() if got.get(k) != v]
    if off or differ:
        raise HarnessError(f"{qmp.name}: QEMU did not take the configuration: "
                           + "; ".join(([f"capabilities not on: {', '.join(off)}"] if off else []) + differ))


def qemu_postcopy_due(config, reply, t_start):
    """True when a QEMU post-copy config should switch now: after `postcopy_after_passes` completed
    passes over memory (dirty-sync-count counts the pass under way), or `postcopy_after_s`."""
    passes_done = reply.get("ram", {}).get("dirty-sync-count", 1) - 1
    if config.postcopy_after_passes is not None and passes_done >= config.postcopy_after_passes:
        return True
    return config.postcopy_after_s is not None and time.monotonic() - t_start >= config.postcopy_after_s


def run_tsubame(case, config, rep, env, link, run_tag):
    result = new_result(case, config, rep, env)
    what = f"{case.name}/{config.name}#{rep}"
    src_ctl, dst_ctl = f"{env.sock_dir}/src.sock", f"{env.sock_dir}/dst.sock"
    stats_path = os.path.join(env.sock_dir, "migrate.json")
    for path in (src_ctl, dst_ctl, stats_path):
        if os.path.exists(path):
            os.unlink(path)
    to = f"tcp:{link.dst_ip}:{MIGRATION_PORT}"
    run_cmd = [env.tsubame, "run", "--memory", case.memory, "--workload", case.workload, "--control", src_ctl]
    for k, v in case.args.items():
        run_cmd += ["--workload-arg", f"{k}={v}"]
    src = dst = migrate = None
    try:
        dst = Proc(f"{what} tsubame receive",
                   # --insecure: the link is the harness's own pair of namespaces
                   # (QEMU's stream is plain too), not a network.
                   link.netns_exec(link.dst_ns) + [env.tsubame, "receive", "--listen", to, "--once",
                                                   "--memory", case.memory, "--control", dst_ctl, "--insecure"],
                   os.path.join(env.log_dir, f"{run_tag}-dst.log"), capture_stdout=True)
        src = Proc(f"{what} tsubame run", link.netns_exec(link.src_ns) + run_cmd,
                   os.path.join(env.log_dir, f"{run_tag}-src.log"), capture_stdout=True)
        wait_for_path(dst_ctl, 10, dst)
        wait_for_path(src_ctl, 10, src)
        wait_for_progress(src.out, src, f"{what} source")
        result.guest_banner_source = check_banner(src.out, f"{what} source", env.tsc_khz)
        wait_for_passes(src.out, src, f"{what} source", case.warmup_passes)
        time.sleep(case.warmup_s)

        migrate_cmd = [env.tsubame, "migrate", "--control", src_ctl, "--to", to, "--insecure",
                       "--downtime-limit", str(case.downtime_limit_ms), "--json", stats_path]
        bits = case.bandwidth_bits()
        if bits:
            migrate_cmd += ["--max-bandwidth", tsubame_rate_arg(bits)]
        migrate_cmd += case.tsubame_args + config.args
        cpu_src, cpu_dst = CpuSampler(src.pid), CpuSampler(dst.pid)
        tx0 = link.tx_bytes()
        cpu_src.sample(), cpu_dst.sample()
        t_start = time.monotonic()
        migrate = Proc(f"{what} tsubame migrate", link.netns_exec(link.src_ns) + migrate_cmd,
                       os.path.join(env.log_dir, f"{run_tag}-migrate.log"))
        timed_out = False
        while migrate.alive():
            time.sleep(POLL_S)
            cpu_src.sample(), cpu_dst.sample()
            if time.monotonic() - t_start > case.time_limit_s:
                timed_out = True
                break
        t_end = time.monotonic()
        if not timed_out and migrate.popen.returncode == 0:
            wait_for_destination(dst.out, t_start, [cpu_src, cpu_dst], case.watch_s)
        cpu_src.sample(), cpu_dst.sample()
        result.bytes_on_wire = link.tx_bytes() - tx0
        result.wall_time_s = t_end - t_start
        result.cpu_source_s, result.cpu_source_vcpu_s = cpu_src.seconds()
        result.cpu_destination_s, result.cpu_destination_vcpu_s = cpu_dst.seconds()
        if timed_out:
            result.status, result.converged = "timeout", False
            result.total_time_s = result.wall_time_s
            result.error = f"not completed within {case.time_limit_s:.0f} s"
            fill_guest_figures(result, src.out, dst.out, t_start, t_end, case, os.path.join(env.log_dir, run_tag))
            return result
        if not os.path.exists(stats_path):
            raise HarnessError(f"{what}: tsubame migrate exited {migrate.popen.returncode} without statistics: "
                               f"{migrate.stderr_tail()}")
        with open(stats_path) as f:
            stats = json.load(f)
        result.vmm_stats = stats
        figures = tsubame_figures(stats)
        for key in ("total_time_s", "vmm_downtime_ms", "setup_time_ms", "iterations", "vmm_bytes", "converged"):
            setattr(result, key, figures[key])
        postcopy = stats.get("postcopy")
        if postcopy:
            result.postcopy_start_s = postcopy["started_at_ms"] / 1e3
            result.postcopy_duration_s = postcopy["duration_ms"] / 1e3
            result.fault_latency_p50_us = postcopy["fault_latency_p50_us"]
            result.fault_latency_p99_us = postcopy["fault_latency_p99_us"]
        if stats.get("status") != "completed" or migrate.popen.returncode != 0:
            result.error = f"tsubame migration failed: {stats.get('error') or migrate.stderr_tail()}"
            raise HarnessError(f"{what}: {result.error}")
        result.status = "completed"
        watch_destination(dst.out, src.out, t_end, case.watch_s, what)
        result.vmm_stopped_at_unix_s = (stats.get("paused_at_unix_us") or 0) / 1e6 or None
        try:
            vcpu = control_request(dst_ctl, {"cmd": "stats"}).get("vcpu") or {}
        except (OSError, ValueError):
            vcpu = {}  # no figure, not a failed run
        result.vmm_resumed_at_unix_s = (vcpu.get("resumed_at_unix_us") or 0) / 1e6 or None
        fill_guest_figures(result, src.out, dst.out, t_start, t_end, case, os.path.join(env.log_dir, run_tag))
        return result
    finally:
        if dst is not None and dst.alive() and os.path.exists(dst_ctl):
            try:
                control_request(dst_ctl, {"cmd": "quit"})
            except (OSError, ValueError):
                pass
        # after a completed migration the source exits by itself
        if src is not None and src.alive() and not src.wait(5 if result.status == "completed" else 0.1):
            try:
                control_request(src_ctl, {"cmd": "quit"})
            except (OSError, ValueError):
                pass
        for p in (migrate, src, dst):
            if p is not None:
                p.wait(5)
                stop_process(p)


def run_one(case, config, rep, env):
    """Builds the link, runs one migration, tears the link down. Returns a RunResult or raises HarnessError."""
    run_tag = f"{case.name}-{config.name}-{rep}"
    link = Link(case.link_bits())
    try:
        link.setup()
        if config.vmm == "qemu":
            return run_qemu(case, config, rep, env, link, run_tag)
        return run_tsubame(case, config, rep, env, link, run_tag)
    finally:
        link.teardown()
