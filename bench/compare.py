#!/usr/bin/env python3
"""Side-by-side live-migration benchmark: tsubame against QEMU 10 (its best modes).

For every case of a case file (bench/cases/*.toml) and every configuration
it names, the harness boots the same guest ELF with the same command line
and memory size under the VMM of that configuration, lets the guest's
workload warm up, migrates it live from a source to a destination VMM
across a shaped link, and watches the destination for a few seconds.

The link is two network namespaces joined by a veth pair with a `tbf`
qdisc at the case's rate on both ends (`link = "1gbit"`), or the loopback
device of one namespace (`link = "loopback"`). The harness creates the
namespaces (tsb-<pid>-src/-dst/-lo) and removes them again, and stops
every process it started, also after an error or Ctrl-C.

Figures per run (see bench/README.md): total time, the VMM's own downtime
figure, guest-observed downtime (gap in the guest's progress lines around
the switch-over), bytes on the wire (source-side tx_bytes counter),
CPU-seconds of the source and destination processes (utime+stime from
/proc, migration start to end), iterations, converged or not, guest ops/s
before/during/after the migration.

Output, in --out (default results/<date>): runs.jsonl (one JSON object per
run, appended, each with the QEMU binary and the first line of its
--version), table.md (the QEMU version, medians and tsubame/QEMU ratios of
this invocation, tsubame-auto against the best QEMU configuration of each
case and figure, and tsubame's expected against its measured downtime;
also printed), <case>-bars.png and <case>-timeline.png.

QEMU configurations whose -accel this host's KVM refuses (the dirty ring)
or that need a capability the QEMU lacks are skipped with one line each.

Needs root (ip netns, tc), /dev/kvm, qemu-system-x86_64 (10; 7.2 runs with
--qemu PATH, less what it lacks) and a built
tsubame (cargo build --release). Exit status 0 when every run completed or
timed out as a result; 1 with a one-line error when a run failed (QEMU or
tsubame reported a failed migration, the destination printed no progress
or a guest error, a process died); 130 on Ctrl-C.

Examples:
  python3 bench/compare.py bench/cases/smoke.toml
  python3 bench/compare.py bench/cases/paper.toml --only gmigrate-best --configs qemu-default,tsubame-auto
  python3 bench/compare.py --table-from results/2026-11-22/runs.jsonl
"""
import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field

from tsubame_bench import HarnessError
from tsubame_bench.console import (TSC_KHZ_RE, guest_downtime_ms, guest_errors, guest_stall, max_gap_ms,
                                   ops_continuous, ops_done_rate, ops_rate, parse_progress, progress_points,
                                   switchover)
from tsubame_bench.control import control_request
from tsubame_bench.demo import tsubame_figures
from tsubame_bench.link import ACTIVE_LINKS, Link, remove_stale_namespaces
from tsubame_bench.procs import (CpuSampler, Proc, follow_console_socket, sh, stop_all_processes, stop_process,
                                 wait_for_path, wait_until)
from tsubame_bench.qmp import Qmp, probe_qemu, qemu_figures, qemu_version_label, qemu_version_line, stop_resume_ms
from tsubame_bench.units import parse_rate, parse_size, tsubame_rate_arg

MIGRATION_PORT = 47001
POLL_S = 0.1  # query-migrate / CPU sampling period, the same for both VMMs


# --------------------------------------------------------------------------
# Case files


@dataclass
class VmmConfig:
    """One way to migrate: a VMM plus its options (one line of a case file's [configs])."""

    name: str
    vmm: str  # "qemu" or "tsubame"
    args: list = field(default_factory=list)  # tsubame: extra `tsubame migrate` arguments
    capabilities: list = field(default_factory=list)  # qemu: migrate-set-capabilities names set to true
    parameters: dict = field(default_factory=dict)  # qemu: extra migrate-set-parameters
    # qemu post-copy: migrate-start-postcopy after this many completed pre-copy passes, or
    # seconds, whichever comes first (postcopy-ram is then set on both ends)
    postcopy_after_passes: int | None = None
    postcopy_after_s: float | None = None
    # qemu: the -accel option of both QEMUs instead of -enable-kvm, e.g. "kvm,dirty-ring-size=4096"
    # (the KVM dirty ring, which the dirty-limit capability needs)
    accel: str | None = None

    def qemu_postcopy(self):
        return self.postcopy_after_passes is not None or self.postcopy_after_s is not None


@dataclass
class Case:
    name: str
    workload: str
    args: dict  # workload parameters (wss, rate, seed), in cmdline order
    memory: str
    link: str  # "loopback" or a rate ("1gbit", "10gbit")
    max_bandwidth: str  # "link" (the link's rate; unlimited on loopback), "unlimited", or a rate
    repetitions: int
    time_limit_s: float
    warmup_s: float
    # sweeps over its working set the guest completes before warmup_s starts: a
    # guest that writes all of it (fill-random, fill-zero) is then in the same
    # state under both VMMs (the first sweep's page faults take 3-7 s of 4 GiB,
    # longer under QEMU)
    warmup_passes: int
    watch_s: float
    downtime_limit_ms: int
    configs: list  # config names, in run order
    tsubame_args: list  # extra `tsubame migrate` arguments for every tsubame config of this case

    def link_bits(self):
        """The link's rate in bit/s, or None for loopback."""
        return None if self.link == "loopback" else parse_rate(self.link)

    def bandwidth_bits(self):
        """The migration bandwidth cap in bit/s for both VMMs, or None for unlimited."""
        if self.max_bandwidth == "link":
            return self.link_bits()
        if self.max_bandwidth == "unlimited":
            return None
        return parse_rate(self.max_bandwidth)


CASE_DEFAULTS = {
    "args": {},
    "link": "1gbit",
    "max_bandwidth": "link",
    "repetitions": 1,
    "time_limit_s": 120,
    "warmup_s": 3,
    "warmup_passes": 0,
    "watch_s": 3,
    "downtime_limit_ms": 300,
    "tsubame_args": [],
}


def load_case_file(path):
    """Reads a case file -> (list of Case, dict name -> VmmConfig). Raises HarnessError when malformed."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise HarnessError(f"{path}: {e}") from None
    configs = {}
    for name, spec in doc.get("configs", {}).items():
        keys = {"vmm", "args", "capabilities", "parameters", "postcopy_after_passes", "postcopy_after_s", "accel"}
        unknown = set(spec) - keys
        if unknown or spec.get("vmm") not in ("qemu", "tsubame"):
            raise HarnessError(f"{path}: config {name}: needs vmm = \"qemu\" or \"tsubame\" "
                               f"and only {'/'.join(sorted(keys - {'vmm'}))} (got {sorted(spec)})")
        after_passes, after_s = spec.get("postcopy_after_passes"), spec.get("postcopy_after_s")
        if (after_passes is not None or after_s is not None) and spec["vmm"] != "qemu":
            raise HarnessError(f"{path}: config {name}: postcopy_after_* is for QEMU; tsubame takes "
                               f"args = [\"--postcopy\", \"after=N\"] or [\"--postcopy\", \"auto\"]")
        accel = spec.get("accel")
        if accel is not None and (spec["vmm"] != "qemu" or not str(accel).startswith("kvm")):
            raise HarnessError(f"{path}: config {name}: accel is QEMU's -accel option and must name kvm "
                               f"(e.g. \"kvm,dirty-ring-size=4096\"), got {accel!r} for vmm {spec['vmm']}")
        configs[name] = VmmConfig(name=name, vmm=spec["vmm"], args=[str(a) for a in spec.get("args", [])],
                                  capabilities=list(spec.get("capabilities", [])),
                                  parameters=dict(spec.get("parameters", {})),
                                  postcopy_after_passes=None if after_passes is None else int(after_passes),
                                  postcopy_after_s=None if after_s is None else float(after_s),
                                  accel=None if accel is None else str(accel))
    defaults = dict(CASE_DEFAULTS)
    defaults["configs"] = list(configs)
    defaults.update(doc.get("defaults", {}))
    cases = []
    for raw in doc.get("case", []):
        spec = dict(defaults)
        spec.update(raw)
        for key in ("name", "workload", "memory"):
            if key not in spec:
                raise HarnessError(f"{path}: a [[case]] lacks '{key}'")
        unknown = set(spec) - set(f.name for f in dataclasses.fields(Case))
        if unknown:
            raise HarnessError(f"{path}: case {spec['name']}: unknown keys {sorted(unknown)}")
        for c in spec["configs"]:
            if c not in configs:
                raise HarnessError(f"{path}: case {spec['name']}: config '{c}' is not defined in [configs]")
        case = Case(name=spec["name"], workload=spec["workload"], args={k: str(v) for k, v in spec["args"].items()},
                    memory=str(spec["memory"]), link=str(spec["link"]).lower(),
                    max_bandwidth=str(spec["max_bandwidth"]).lower(), repetitions=int(spec["repetitions"]),
                    time_limit_s=float(spec["time_limit_s"]), warmup_s=float(spec["warmup_s"]),
                    warmup_passes=int(spec["warmup_passes"]),
                    watch_s=float(spec["watch_s"]), downtime_limit_ms=int(spec["downtime_limit_ms"]),
                    configs=list(spec["configs"]), tsubame_args=[str(a) for a in spec["tsubame_args"]])
        case.link_bits()  # validate rates now, not in the middle of a run
        case.bandwidth_bits()
        parse_size(case.memory)
        cases.append(case)
    if not cases:
        raise HarnessError(f"{path}: no [[case]] entries")
    return cases, configs


def guest_cmdline(case, tsc_khz):
    """The guest command line exactly as `tsubame run` builds it: workload=W k=v ... tsc_khz=K."""
    parts = [f"workload={case.workload}"] + [f"{k}={v}" for k, v in case.args.items()]
    return " ".join(parts + [f"tsc_khz={tsc_khz}"])


# --------------------------------------------------------------------------
# Results


@dataclass
class RunResult:
    """One migration of one case under one configuration (one line of runs.jsonl)."""

    case: str
    config: str
    vmm: str
    repetition: int
    started_at: str
    memory: str
    workload: str
    link: str
    max_bandwidth_bits: int | None
    cmdline: str
    status: str  # completed | failed | timeout
    error: str | None = None
    total_time_s: float | None = None  # the VMM's own figure
    wall_time_s: float | None = None  # harness: migrate command -> seen completed
    time_to_destination_s: float | None = None  # harness: migrate command -> first destination progress line
    vmm_downtime_ms: float | None = None
    # downtime measured the same way for both VMMs (bench/README.md): the guest's own largest stall
    # (its `gap_us`), from migration start to the end of the watch; which side's line reported it and
    # when (s from migration start); and source vCPU stop -> destination vCPU resume from the VMMs'
    # own events (QMP STOP/RESUME; tsubame's paused_at/resumed_at_unix_us), Unix seconds of one clock
    guest_stall_ms: float | None = None
    guest_stall_side: str | None = None
    guest_stall_at_s: float | None = None
    vmm_stop_resume_ms: float | None = None
    vmm_stopped_at_unix_s: float | None = None
    vmm_resumed_at_unix_s: float | None = None
    guest_downtime_ms: float | None = None  # largest gap between progress lines around the switch-over
    switchover_gap_ms: float | None = None  # last source progress line -> first destination line
    max_source_gap_ms: float | None = None  # largest gap between source lines during the migration
    setup_time_ms: float | None = None
    bytes_on_wire: int | None = None  # source-side tx_bytes delta
    vmm_bytes: int | None = None  # the VMM's own figure
    cpu_source_s: float | None = None  # utime+stime of the source process, migration start -> end
    cpu_destination_s: float | None = None
    cpu_source_vcpu_s: float | None = None  # of that, the vCPU threads (the guest's own work)
    cpu_destination_vcpu_s: float | None = None
    iterations: int | None = None
    converged: bool | None = None
    ops_per_sec_before: float | None = None
    ops_per_sec_during: float | None = None
    ops_per_sec_after: float | None = None
    ops_continuous: bool | None = None
    destination_progress_lines: int = 0
    guest_banner_source: str | None = None
    # post-copy: when the phase began and how long it lasted (from migration start), the guest's ops/s
    # at the destination meanwhile, and fault figures (tsubame: service latency; QEMU (7.2 and 10) exposes
    # only the vCPUs' total blocked time, postcopy-blocktime)
    postcopy_start_s: float | None = None
    postcopy_duration_s: float | None = None
    ops_per_sec_postcopy: float | None = None
    fault_latency_p50_us: float | None = None
    fault_latency_p99_us: float | None = None
    postcopy_blocktime_ms: float | None = None
    timeline: dict = field(default_factory=dict)  # {"source": [[t, ops]], "destination": [...]}, t from migration start
    migration_end_s: float | None = None  # from migration start, for the plots
    vmm_stats: dict = field(default_factory=dict)  # the VMM's raw final statistics


# --------------------------------------------------------------------------
# One run


@dataclass
class Env:
    """What every run needs: binaries, the guest, the TSC rate, where to put sockets and logs."""

    tsubame: str
    qemu: str
    guest_elf: str
    tsc_khz: int
    sock_dir: str
    log_dir: str


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


# --------------------------------------------------------------------------
# Table


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


# (column title, RunResult field, scale, format)
METRICS = [
    ("total (s)", "total_time_s", 1, "{:.2f}"),
    ("until guest runs at dst (s)", "time_to_destination_s", 1, "{:.2f}"),
    ("guest stall (ms)", "guest_stall_ms", 1, "{:.1f}"),
    ("VMM stop→resume (ms)", "vmm_stop_resume_ms", 1, "{:.1f}"),
    ("VMM downtime (ms)", "vmm_downtime_ms", 1, "{:.0f}"),
    ("guest downtime (ms)", "guest_downtime_ms", 1, "{:.0f}"),
    ("MiB on wire", "bytes_on_wire", 1 / 2**20, "{:.0f}"),
    ("CPU-s src", "cpu_source_s", 1, "{:.2f}"),
    ("CPU-s src w/o vCPU", "cpu_source_migration_s", 1, "{:.2f}"),
    ("CPU-s dst", "cpu_destination_s", 1, "{:.2f}"),
    ("iterations", "iterations", 1, "{:.0f}"),
    ("Mops/s before", "ops_per_sec_before", 1e-6, "{:.2f}"),
    ("Mops/s during", "ops_per_sec_during", 1e-6, "{:.2f}"),
    ("Mops/s after", "ops_per_sec_after", 1e-6, "{:.2f}"),
    ("kops/s post-copy (first 90 %)", "ops_per_sec_postcopy", 1e-3, "{:.1f}"),
    ("fault p99 (µs)", "fault_latency_p99_us", 1, "{:.0f}"),
    ("blocktime (ms)", "postcopy_blocktime_ms", 1, "{:.0f}"),
]
RATIO_METRICS = ["total_time_s", "time_to_destination_s", "guest_stall_ms", "vmm_stop_resume_ms",
                 "vmm_downtime_ms", "guest_downtime_ms", "bytes_on_wire", "cpu_source_s", "cpu_source_migration_s",
                 "cpu_destination_s", "ops_per_sec_during", "ops_per_sec_postcopy"]


def metric(run, key):
    """A figure of a run (a dict from runs.jsonl); derived ones computed here."""
    if key == "cpu_source_migration_s":
        if run.get("cpu_source_s") is None or run.get("cpu_source_vcpu_s") is None:
            return None
        return run["cpu_source_s"] - run["cpu_source_vcpu_s"]
    return run.get(key)


def group_runs(runs):
    """{case: {config: [runs]}} in first-seen order."""
    groups = {}
    for r in runs:
        groups.setdefault(r["case"], {}).setdefault(r["config"], []).append(r)
    return groups


def summarize(runs):
    """Medians of each metric over a config's completed runs, plus counts.

    Timed-out runs count in `runs` but not in the medians; when none completed, `limit_s`
    holds the time spent until the limit (the table shows it as ">N")."""
    done = [r for r in runs if r["status"] == "completed"]
    summary = {key: median([metric(r, key) for r in done]) for _, key, _, _ in METRICS}
    summary["limit_s"] = None if done else median([r.get("total_time_s") for r in runs])
    summary["runs"] = len(runs)
    summary["completed"] = len(done)
    summary["converged"] = sum(1 for r in runs if r.get("converged"))
    summary["vmm"] = runs[0]["vmm"]
    return summary


def ratio_rows(runs):
    """[(case, tsubame config, QEMU config, {metric: tsubame median / QEMU median or None})] for every pair."""
    rows = []
    for case, configs in group_runs(runs).items():
        summaries = {name: summarize(rs) for name, rs in configs.items()}
        for tname, ts in summaries.items():
            if ts["vmm"] != "tsubame":
                continue
            for qname, qs in summaries.items():
                if qs["vmm"] == "qemu":
                    rows.append((case, tname, qname, {k: ratio(ts[k], qs[k]) for k in RATIO_METRICS}))
    return rows


# Figures where more is better (the guest's throughput); for every other figure less is.
HIGHER_IS_BETTER = {"ops_per_sec_before", "ops_per_sec_during", "ops_per_sec_after", "ops_per_sec_postcopy"}


def best_qemu(summaries, key):
    """(name, median) of the best QEMU configuration for one figure: of the QEMU configurations with a
    completed run and a median for it, the lowest (the highest for ops/s; the first listed on a tie), or
    (None, None) when none has one. Each figure has its own best: the fastest configuration need not
    stop the guest the shortest time."""
    candidates = [(name, s[key]) for name, s in summaries.items()
                  if s["vmm"] == "qemu" and s["completed"] and s[key] is not None]
    if not candidates:
        return None, None
    pick = max if key in HIGHER_IS_BETTER else min
    return pick(candidates, key=lambda c: c[1])


def best_qemu_rows(runs):
    """[(case, figures)] for each case that ran tsubame-auto (no flags): for every figure of RATIO_METRICS
    `best[key]` = {config, qemu, tsubame, ratio}: the best completing QEMU configuration of that figure
    (best_qemu), its median, tsubame-auto's median and tsubame-auto ÷ best QEMU; tsubame-auto's completed
    runs; its total against the better of tsubame-4096 and tsubame-spp128 (whole pages, 128-byte
    sub-pages) run alongside, as issue 21's targets put it (`granularity`); and against the better of
    tsubame-precopy and tsubame-postcopy-now (`mode`), as issue 50's does."""
    rows = []
    for case, configs in group_runs(runs).items():
        summaries = {name: summarize(rs) for name, rs in configs.items()}
        auto = summaries.get("tsubame-auto")
        if auto is None:
            continue
        best = {}
        for key in RATIO_METRICS:
            name, value = best_qemu(summaries, key)
            best[key] = {"config": name, "qemu": value, "tsubame": auto[key], "ratio": ratio(auto[key], value)}
        def better_total(names):
            """The lower median total of two configurations run alongside, None unless both completed."""
            totals = [summaries[n]["total_time_s"] for n in names if n in summaries and summaries[n]["completed"]]
            return min(totals) if len(totals) == 2 else None
        rows.append((case, {
            "completed": f"{auto['completed']}/{auto['runs']}",
            "best": best,
            "granularity": ratio(auto["total_time_s"], better_total(("tsubame-4096", "tsubame-spp128"))),
            # issue 50: the policy's pick against pre-copy alone and post-copy at once
            "mode": ratio(auto["total_time_s"], better_total(("tsubame-precopy", "tsubame-postcopy-now"))),
        }))
    return rows


def qemu_versions(runs):
    """The distinct `qemu_version` lines of the QEMU runs, in first-seen order; None for runs recorded
    without one (runs.jsonl written before the harness recorded it, read back with --table-from)."""
    versions = []
    for r in runs:
        if r["vmm"] == "qemu" and r.get("qemu_version") not in versions:
            versions.append(r.get("qemu_version"))
    return versions


def qemu_label(runs):
    """What the tables call the QEMU they compare with: "QEMU 10.0.2", "QEMU (version unknown)" when a
    run did not record it (never plain "QEMU": the figures of 7.2 and 10 differ twofold), or several
    joined with "and" when the runs mix versions; "QEMU (none ran)" for tsubame's runs alone."""
    labels = []
    for version in qemu_versions(runs):
        if qemu_version_label(version) not in labels:
            labels.append(qemu_version_label(version))
    return " and ".join(labels) or "QEMU (none ran)"


def limit_rows(runs):
    """[(case, tsubame config, figures)] for each that converged in pre-copy at least once: of those runs, how many
    kept the downtime limit they were given (measured VMM downtime ≤ the `downtime_limit_ms` in their statistics;
    issue 54's promise), the limit, the worst overshoot, the range of the measured VMM downtime and of the engine's
    estimate as it stopped ÷ the measured one."""
    rows = []
    for case, configs in group_runs(runs).items():
        for config, rs in configs.items():
            kept = [r for r in rs if r["vmm"] == "tsubame" and r["status"] == "completed" and r.get("converged")
                    and (r.get("vmm_stats") or {}).get("downtime_limit_ms") and r.get("vmm_downtime_ms") is not None]
            if not kept:
                continue
            measured = [r["vmm_downtime_ms"] for r in kept]
            limits = {r["vmm_stats"]["downtime_limit_ms"] for r in kept}
            overshoots = [r["vmm_downtime_ms"] - r["vmm_stats"]["downtime_limit_ms"] for r in kept]
            shares = [ratio(r["vmm_stats"].get("expected_downtime_ms"), r["vmm_downtime_ms"]) for r in kept]
            shares = [x for x in shares if x is not None]
            rows.append((case, config, {
                "converged": len(kept),
                "kept": sum(1 for over in overshoots if over <= 0),
                "limit_ms": max(limits),
                "worst_over_ms": max(overshoots),
                "measured_ms": (min(measured), max(measured)),
                "shares": (min(shares), max(shares)) if shares else None,
            }))
    return rows


def fmt(value, scale=1, pattern="{:.2f}"):
    return "–" if value is None else pattern.format(value * scale)


def make_table(runs):
    """Markdown: which QEMU, one row per case and config with medians, then tsubame/QEMU ratios per case,
    then tsubame-auto against the best QEMU configuration of each case and figure."""
    label = qemu_label(runs)
    out = []
    for version in qemu_versions(runs):
        out.append(f"Against {qemu_version_label(version)}: "
                   + (f"`qemu-system-x86_64 --version`: {version}" if version else
                      "these QEMU runs were recorded without `qemu_version` (runs.jsonl from before the harness "
                      "recorded it)"))
    if out:
        out.append("")
    out += ["| case | config | completed | converged | " + " | ".join(t for t, _, _, _ in METRICS) + " |",
           "|---|---|---|---|" + "---|" * len(METRICS)]
    for case, configs in group_runs(runs).items():
        for config, rs in configs.items():
            s = summarize(rs)
            cells = [fmt(s[key], scale, pattern) for _, key, scale, pattern in METRICS]
            if s["limit_s"] is not None:
                cells[0] = f">{s['limit_s']:.0f}"
            out.append(f"| {case} | {config} | {s['completed']}/{s['runs']} | {s['converged']}/{s['runs']} | "
                       + " | ".join(cells) + " |")
    titles = {key: title.replace(" (s)", "").replace(" (ms)", "") for title, key, _, _ in METRICS}
    out += ["", f"Ratios tsubame / {label} of the medians over completed runs (below 1: tsubame lower; "
            "for Mops/s during, above 1: the guest ran faster under tsubame; –: a side has no completed run):", "",
            "| case | tsubame | QEMU | " + " | ".join(titles[k] for k in RATIO_METRICS) + " |",
            "|---|---|---|" + "---|" * len(RATIO_METRICS)]
    for case, tname, qname, ratios in ratio_rows(runs):
        out.append(f"| {case} | {tname} | {qname} | " + " | ".join(fmt(ratios[k]) for k in RATIO_METRICS) + " |")
    best = best_qemu_rows(runs)
    if best:
        units = {key: (title, scale, pattern) for title, key, scale, pattern in METRICS}
        out += ["", f"tsubame-auto (no flags) against the best {label} configuration of each case and figure: of "
                "the QEMU configurations with a completed run, the one with the lowest median (the highest for "
                "Mops/s and kops/s), named; ÷: tsubame-auto's median ÷ that one's (–: a side has no completed run):",
                "", "| case | figure | best QEMU | best QEMU's median | tsubame-auto's median | tsubame-auto ÷ best QEMU |",
                "|---|---|---|---|---|---|"]
        for case, f in best:
            for key, b in f["best"].items():
                if b["qemu"] is None and b["tsubame"] is None:
                    continue  # a figure neither side has here (post-copy figures of a pre-copy case)
                title, scale, pattern = units[key]
                out.append(f"| {case} | {title} | {b['config'] or 'none completed'} | {fmt(b['qemu'], scale, pattern)} "
                           f"| {fmt(b['tsubame'], scale, pattern)} ({f['completed']} completed) | {fmt(b['ratio'])} |")
        granularity = [(case, f) for case, f in best if f["granularity"] is not None]
        if granularity:
            out += ["", "tsubame-auto's median total against the better of tsubame-4096 and tsubame-spp128:", "",
                    "| case | tsubame-auto completed | total ÷ better of 4096/128 |", "|---|---|---|"]
            for case, f in granularity:
                out.append(f"| {case} | {f['completed']} | {fmt(f['granularity'])} |")
        modes = [(case, f) for case, f in best if f["mode"] is not None]
        if modes:
            out += ["", "tsubame-auto's median total against the better of tsubame-precopy (`--postcopy off`) and "
                    "tsubame-postcopy-now (`--postcopy after=0`) (the automatic policy's pick against either mode "
                    "alone; the goal is at most 1.1):", "",
                    "| case | tsubame-auto completed | total ÷ better of pre-copy/post-copy at once |", "|---|---|---|"]
            for case, f in modes:
                out.append(f"| {case} | {f['completed']} | {fmt(f['mode'])} |")
    limits = limit_rows(runs)
    if limits:
        kept = sum(f["kept"] for _, _, f in limits)
        converged = sum(f["converged"] for _, _, f in limits)
        out += ["", f"tsubame's downtime limit, runs that converged in pre-copy: {kept} of {converged} kept it (measured "
                "VMM downtime ≤ the limit); the engine's estimate as it stopped ÷ the measured downtime beside it:", "",
                "| case | config | kept | limit (ms) | measured VMM downtime (ms) | worst over the limit (ms) | "
                "expected ÷ measured |", "|---|---|---|---|---|---|---|"]
        for case, config, f in limits:
            shortest, longest = f["measured_ms"]
            worst = f"{f['worst_over_ms']:.2f}" if f["worst_over_ms"] > 0 else "–"
            shares = "{:.2f}-{:.2f}".format(*f["shares"]) if f["shares"] else "–"
            out.append(f"| {case} | {config} | {f['kept']}/{f['converged']} | {f['limit_ms']:.0f} | "
                       f"{shortest:.2f}-{longest:.2f} | {worst} | {shares} |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------
# Plots


VMM_COLORS = {"qemu": ["#4c72b0", "#64b5cd", "#8172b3", "#937860", "#8c8c8c"],
              "tsubame": ["#dd8452", "#c44e52", "#da8bc3", "#ccb974"]}


def config_colors(configs_with_vmm):
    """{config: color}: blues for QEMU configs, oranges/reds for tsubame ones."""
    used = {"qemu": 0, "tsubame": 0}
    colors = {}
    for name, vmm in configs_with_vmm:
        palette = VMM_COLORS[vmm]
        colors[name] = palette[used[vmm] % len(palette)]
        used[vmm] += 1
    return colors


def timeline_rates(points, span=4):
    """[(t, ops)] -> [(t, ops/s)] with each rate over `span` consecutive line gaps (smooths the 50 ms cadence)."""
    rates = []
    for i in range(span, len(points)):
        t0, o0 = points[i - span]
        t1, o1 = points[i]
        if t1 > t0:
            rates.append(((t0 + t1) / 2, (o1 - o0) / (t1 - t0)))
    return rates


def plot_case(case, runs, out_dir):
    """Writes <case>-bars.png and <case>-timeline.png; returns their paths."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HarnessError("matplotlib missing: pip install -r bench/requirements.txt (or pass --no-plots)") from None

    configs = group_runs(runs)[case]
    colors = config_colors([(name, rs[0]["vmm"]) for name, rs in configs.items()])
    names = list(configs)
    summaries = {n: summarize(rs) for n, rs in configs.items()}

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        (axes[0][0], "total time (s)", [("total_time_s", 1, "")]),
        (axes[0][1], "downtime (ms)", [("vmm_downtime_ms", 1, "VMM"), ("guest_downtime_ms", 1, "guest")]),
        (axes[1][0], "MiB on the wire", [("bytes_on_wire", 1 / 2**20, "")]),
        (axes[1][1], "CPU-seconds", [("cpu_source_s", 1, "src"), ("cpu_source_migration_s", 1, "src w/o vCPU"),
                                     ("cpu_destination_s", 1, "dst")]),
    ]
    for ax, title, series in panels:
        width = 0.8 / len(series)
        for j, (key, scale, label) in enumerate(series):
            for i, name in enumerate(names):
                value = summaries[name][key]
                x = i + (j - (len(series) - 1) / 2) * width
                if value is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
                    continue
                ax.bar(x, value * scale, width * 0.95, color=colors[name], alpha=1.0 - 0.3 * j,
                       edgecolor="black", linewidth=0.5, hatch=["", "//", ".."][j])
                ax.text(x, value * scale, f"{value * scale:.3g}" + (f"\n{label}" if label else ""),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        # "qemu-multifd-zstd" -> "qemu\nmultifd-zstd": six names side by side fit.
        ax.set_xticklabels([f"{n.replace('-', chr(10), 1)}\n({summaries[n]['completed']}/{summaries[n]['runs']} done)"
                            for n in names], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.25)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{case}: medians over completed runs (tsubame vs {qemu_label(runs)})", fontsize=11)
    fig.tight_layout()
    bars_path = os.path.join(out_dir, f"{case}-bars.png")
    fig.savefig(bars_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.4 * len(names) + 0.8), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        run = configs[name][0]  # first repetition
        src = timeline_rates(run["timeline"].get("source", []))
        dst = timeline_rates(run["timeline"].get("destination", []))
        if src:
            ax.plot([t for t, _ in src], [r / 1e6 for _, r in src], color=colors[name], label="source")
        if dst:
            ax.plot([t for t, _ in dst], [r / 1e6 for _, r in dst], color="black", label="destination")
        ax.axvline(0, color="gray", linestyle="--", linewidth=1)
        if run.get("migration_end_s") is not None:
            ax.axvline(run["migration_end_s"], color="gray", linestyle=":", linewidth=1)
        gd = run.get("guest_downtime_ms")
        ax.set_title(f"{name} (run {run['repetition']}): {run['status']}, total {fmt(run.get('total_time_s'))} s, "
                     f"guest downtime {fmt(gd, 1, '{:.0f}')} ms", fontsize=9)
        ax.set_ylabel("Mops/s", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[-1, 0].set_xlabel("seconds from migration start (dashed: start, dotted: end)")
    fig.suptitle(f"{case}: guest throughput across the migration", fontsize=11)
    fig.tight_layout()
    timeline_path = os.path.join(out_dir, f"{case}-timeline.png")
    fig.savefig(timeline_path, dpi=110)
    plt.close(fig)
    paths = [bars_path, timeline_path]

    # Bytes sent per iteration (the SPP paper's Figures 4-7): tsubame
    # reports them; QEMU's query-migrate does not.
    iterating = [(n, configs[n][0]) for n in names if (configs[n][0].get("vmm_stats") or {}).get("per_iteration")]
    if iterating:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for name, run in iterating:
            per = run["vmm_stats"]["per_iteration"]
            ax.plot([i["index"] for i in per], [max(i["bytes_on_wire"], 1) / 2**20 for i in per], marker="o",
                    color=colors[name], label=f"{name} ({run['vmm_stats'].get('stop_reason', '?')})")
        ax.set_yscale("log")
        ax.set_xlabel("iteration (the last one is stop-and-copy)")
        ax.set_ylabel("MiB sent in the iteration")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax.set_title(f"{case}: bytes per iteration (first repetition)", fontsize=11)
        fig.tight_layout()
        iterations_path = os.path.join(out_dir, f"{case}-iterations.png")
        fig.savefig(iterations_path, dpi=110)
        plt.close(fig)
        paths.append(iterations_path)
    return paths


# --------------------------------------------------------------------------
# Setup and main


def read_tsc_khz(tsubame):
    """The host TSC rate as tsubame reads it from KVM (its guest's banner line)."""
    p = subprocess.run([tsubame, "run", "--memory", "16M", "--workload", "idle", "--seconds", "0.3"],
                       capture_output=True, text=True, timeout=30)
    first = p.stdout.splitlines()[0] if p.stdout else ""
    m = TSC_KHZ_RE.search(first)
    if p.returncode != 0 or not m:
        raise HarnessError(f"cannot read tsc_khz from `tsubame run`: {first or p.stderr.strip()}")
    return int(m.group(1))


def check_prerequisites(args):
    if os.geteuid() != 0:
        raise HarnessError("needs root (ip netns, tc); run with sudo")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        raise HarnessError("/dev/kvm is not usable")
    if not os.path.exists(args.tsubame):
        raise HarnessError(f"{args.tsubame} not found: run `cargo build --release` first")
    if not shutil.which(args.qemu):
        raise HarnessError(f"{args.qemu} not found: scripts/setup.sh installs QEMU 10")
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise HarnessError("matplotlib missing: pip install -r bench/requirements.txt (or pass --no-plots)") \
                from None


def on_sigterm(signum, frame):
    raise KeyboardInterrupt


def progress_line(result):
    return (f"compare: {result.case}/{result.config}#{result.repetition}: {result.status}, "
            f"total {fmt(result.total_time_s)} s, guest stall {fmt(result.guest_stall_ms, 1, '{:.0f}')} ms, "
            f"VMM stop→resume {fmt(result.vmm_stop_resume_ms, 1, '{:.0f}')} ms, "
            f"VMM downtime {fmt(result.vmm_downtime_ms, 1, '{:.0f}')} ms, "
            f"guest downtime {fmt(result.guest_downtime_ms, 1, '{:.0f}')} ms, "
            f"{fmt(result.bytes_on_wire, 1 / 2**20, '{:.0f}')} MiB, "
            f"CPU-s src {fmt(result.cpu_source_s)} dst {fmt(result.cpu_destination_s)}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="?", help="case file (bench/cases/*.toml)")
    p.add_argument("--out", help="output directory (default: results/<today>)")
    p.add_argument("--only", help="comma-separated case names to run (default: all in the file)")
    p.add_argument("--configs", help="comma-separated config names to run (default: each case's list)")
    p.add_argument("--repetitions", type=int, help="override every case's repetitions")
    p.add_argument("--tsubame", default="target/release/tsubame", help="tsubame binary (default: %(default)s)")
    p.add_argument("--qemu", default="qemu-system-x86_64", help="QEMU binary (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (matplotlib not needed then)")
    p.add_argument("--keep-going", action="store_true",
                   help="after a failed run, go on with the others (exit status is still 1)")
    p.add_argument("--table-from", metavar="RUNS_JSONL",
                   help="only print the table (and plots into --out) of an existing runs.jsonl")
    args = p.parse_args(argv)
    if not args.cases and not args.table_from:
        p.error("give a case file, or --table-from RUNS_JSONL")
    return args


def load_runs(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_outputs(runs, out_dir, plots):
    table = make_table(runs)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(table)
    print(table)
    if plots:
        for case in group_runs(runs):
            for path in plot_case(case, runs, out_dir):
                print(f"compare: wrote {path}", file=sys.stderr)


def run_cases(args, out_dir):
    """Runs every selected case and config; returns (runs as dicts, list of failure messages)."""
    cases, configs = load_case_file(args.cases)
    if args.only:
        wanted = args.only.split(",")
        missing = set(wanted) - {c.name for c in cases}
        if missing:
            raise HarnessError(f"--only: no case named {', '.join(sorted(missing))} in {args.cases}")
        cases = [c for c in cases if c.name in wanted]
    if args.configs:
        missing = set(args.configs.split(",")) - set(configs)
        if missing:
            raise HarnessError(f"--configs: {', '.join(sorted(missing))} not defined in {args.cases}")
    remove_stale_namespaces()
    work = tempfile.mkdtemp(prefix="tsb-bench-")
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    try:
        elf = os.path.join(work, "guest.elf")
        sh(args.tsubame, "guest-elf", elf)
        env = Env(tsubame=args.tsubame, qemu=args.qemu, guest_elf=elf, tsc_khz=read_tsc_khz(args.tsubame),
                  sock_dir=work, log_dir=log_dir)
        # Every run records the QEMU it was compared with (also a tsubame run: its ratios are against it).
        # An invocation of tsubame configurations alone needs no QEMU (bench/device/stop_check.sh passes
        # --qemu /bin/true): its runs record none.
        selected = [configs[n] for c in cases for n in c.configs if not args.configs or n in args.configs.split(",")]
        try:
            qemu_version = qemu_version_line(args.qemu)
        except HarnessError:
            if any(config.vmm == "qemu" for config in selected):
                raise
            qemu_version = None
        print(f"compare: tsc_khz={env.tsc_khz}; {args.qemu}: {qemu_version or 'no QEMU version (no QEMU run)'}; "
              f"logs in {log_dir}", file=sys.stderr)
        skipped = qemu_configs_to_skip(args.qemu, qemu_version, selected)
        runs, failures = [], []
        invocation = datetime.datetime.now().isoformat(timespec="seconds")
        for case in cases:
            names = [n for n in case.configs if (not args.configs or n in args.configs.split(","))
                     and n not in skipped]
            reps = args.repetitions or case.repetitions
            for rep in range(1, reps + 1):
                for name in run_order(names, configs, rep):
                    config = configs[name]
                    print(f"compare: {case.name}/{name}#{rep}: {case.memory} {case.workload} "
                          f"{case.args} link {case.link} ...", file=sys.stderr, flush=True)
                    try:
                        result = run_one(case, config, rep, env)
                    except HarnessError as e:
                        failures.append(str(e))
                        print(f"compare: FAILED: {e}", file=sys.stderr, flush=True)
                        if not args.keep_going:
                            return runs, failures
                        continue
                    record = dataclasses.asdict(result)
                    record["invocation"] = invocation
                    record["case_file"] = args.cases
                    record["qemu"] = shutil.which(args.qemu) or args.qemu
                    record["qemu_version"] = qemu_version
                    with open(os.path.join(out_dir, "runs.jsonl"), "a") as f:
                        f.write(json.dumps(record) + "\n")
                    runs.append(record)
                    print(progress_line(result), file=sys.stderr, flush=True)
        return runs, failures
    finally:
        shutil.rmtree(work, ignore_errors=True)


def qemu_configs_to_skip(qemu, version, configs):
    """{name: why} for the QEMU configurations this QEMU cannot run here, each said in one line on stderr:
    one whose -accel this host's KVM refuses (a dirty ring), or one that needs a migration capability this
    QEMU lacks (dirty-limit before QEMU 8.1, with --qemu of a 7.2). Each distinct -accel is probed once,
    on a QEMU without a machine (about a second)."""
    probes, skipped = {}, {}
    for config in configs:
        if config.vmm != "qemu" or config.name in skipped:
            continue
        if config.accel not in probes:
            probes[config.accel] = probe_qemu(qemu, config.accel)
        offered, error = probes[config.accel]
        if error is not None and config.accel is None:
            raise HarnessError(f"{qemu} does not start under KVM (-accel kvm -M none): {error}")
        if error is not None:
            skipped[config.name] = f"this host refuses -accel {config.accel or 'kvm'}: {error}"
        else:
            missing = [c for c in config.capabilities if c not in offered]
            if missing:
                skipped[config.name] = (f"{qemu_version_label(version)} ({qemu}) offers no migration "
                                        f"capability {', '.join(missing)}")
        if config.name in skipped:
            print(f"compare: skipping {config.name}: {skipped[config.name]}", file=sys.stderr, flush=True)
    return skipped


def run_order(names: list[str], configs: dict, rep: int) -> list[str]:
    """The order of one repetition's runs: the configurations grouped by VMM
    (in the order the first of each comes), each group rotated by one per
    repetition. A tsubame run right after a QEMU run took 5-10 % longer
    than the same configuration after another tsubame run (medians over
    three full runs), and with the order reversed every other repetition
    tsubame-auto was that run in two of three, the fixed granularities it
    is compared with never.
    Rotated, each configuration of a group comes first in as many
    repetitions as the others (with as many repetitions as the group has
    configurations)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(configs[name].vmm, []).append(name)
    order = []
    for group in groups.values():
        k = (rep - 1) % len(group)
        order += group[k:] + group[:k]
    return order


def main(argv=None):
    args = parse_args(argv)
    out_dir = args.out or os.path.join("results", datetime.date.today().isoformat())
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (`cmd &`)
    try:
        os.makedirs(out_dir, exist_ok=True)
        if args.table_from:
            write_outputs(load_runs(args.table_from), out_dir, not args.no_plots)
            return 0
        check_prerequisites(args)
        runs, failures = run_cases(args, out_dir)
        if runs:
            write_outputs(runs, out_dir, not args.no_plots)
        if failures:
            more = f" (and {len(failures) - 1} more failure(s))" if len(failures) > 1 else ""
            print(f"error: {failures[0]}{more}", file=sys.stderr)
            return 1
        return 0
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("compare: interrupted; stopping processes and removing namespaces", file=sys.stderr)
        return 130
    finally:
        stop_all_processes()
        for link in list(ACTIVE_LINKS):
            link.teardown()


if __name__ == "__main__":
    sys.exit(main())
