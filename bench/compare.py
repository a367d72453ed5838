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
import subprocess
import sys
import tempfile

from tsubame_bench import HarnessError
from tsubame_bench.cases import load_case_file
from tsubame_bench.console import TSC_KHZ_RE
from tsubame_bench.link import ACTIVE_LINKS, remove_stale_namespaces
from tsubame_bench.plots import plot_case
from tsubame_bench.procs import sh, stop_all_processes
from tsubame_bench.qmp import probe_qemu, qemu_version_label, qemu_version_line
from tsubame_bench.runner import Env, run_one
from tsubame_bench.tables import fmt, group_runs, make_table


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
