#!/usr/bin/env python3
"""Where each stop's CPU time went, from a scheduler trace of migrations
run on this host (both ends on one machine, as bench/compare.py runs
them): per CPU, the time each thread ran and the time it idled.

    perf record -e sched:sched_switch -a -k mono -o sched.data -- \\
        python3 bench/compare.py bench/cases/paper.toml --only rdma-kv-2G-10gbit ...
    perf script -i sched.data -F pid,tid,cpu,time,event,trace > sched.txt
    python3 bench/stop_cpus.py sched.txt [--json]

A stop is taken to run from the moment a `vcpu0` thread leaves its CPU
for 50 ms or more for the first time (the source paused it; a running
guest's vCPU thread is back within milliseconds) to the next time
another `vcpu0` thread gets a CPU (the destination runs the guest). The
source's fetch is `migration`, its stages `encode-N` and `send-N`; the
destination's channel-0 receiving thread is its main thread, its
decoders `decode-N`; both have a `digest`. Threads are labelled `src:`
or `dst:` by process (the one whose `migration`, `encode-N` or `send-N`
thread ran in the stop is the source, the one whose `decode-N` ran the
destination) where the trace has pids.

An idle guest's vCPU thread sleeps while the guest halts, so its pause
cannot be told from the trace: give `--runs DIR/runs.jsonl` of the same
compare.py invocation, and each tsubame run's `paused_at_monotonic_s`
and `downtime_ms` (the statistics' fields) set the stops instead.
"""

import argparse
import collections
import json
import re
import sys

SWITCH = re.compile(
    r"^\s*(?:(?P<pid>-?\d+)/)?(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<time>[\d.]+):\s+sched:sched_switch:\s+"
    r"prev_comm=(?P<prev_comm>.+?) prev_pid=(?P<prev_tid>\d+) .*==> "
    r"next_comm=(?P<next_comm>.+?) next_pid=(?P<next_tid>\d+)"
)
# Off its CPU this long, a vCPU thread was paused, not descheduled.
PAUSED_S = 0.05
# A source's vCPU thread ran the guest before its pause, on a CPU this many
# times at least; a destination's only loaded the state before the resume.
RAN_GUEST = 20
VCPU = "vcpu0"


class Switch(collections.namedtuple("Switch", "time cpu prev_tid prev_comm next_tid next_comm")):
    """One sched_switch: `cpu` went from the prev task to the next at `time` (seconds)."""


def parse(lines):
    """The sched_switch events of `perf script -F pid,tid,cpu,time,event,trace` output, in time order, and each
    thread's process (tid -> pid, for the tasks that ran)."""
    switches, process = [], {}
    for line in lines:
        m = SWITCH.match(line)
        if not m:
            continue
        if m["pid"] is not None:
            process[int(m["tid"])] = int(m["pid"])
        switches.append(Switch(float(m["time"]), int(m["cpu"]), int(m["prev_tid"]), m["prev_comm"],
                               int(m["next_tid"]), m["next_comm"]))
    switches.sort(key=lambda s: s.time)
    return switches, process


def stops(switches):
    """[(paused, resumed, source vCPU tid, destination vCPU tid)]: a vCPU thread that ran the guest leaves its CPU
    for PAUSED_S or more, and before it is back another vCPU thread, alive but not yet running the guest, gets a
    CPU."""
    # A thread gets its name after it first runs: go by the thread, one
    # that ran as a vCPU more than once (another thread may carry the name
    # for a moment before it renames itself).
    named = collections.Counter(s.next_tid for s in switches if s.next_comm == VCPU)
    vcpus = {tid for tid, n in named.items() if n > 2}
    ins, outs = collections.defaultdict(list), collections.defaultdict(list)
    for s in switches:
        if s.next_tid in vcpus:
            ins[s.next_tid].append(s.time)
        if s.prev_tid in vcpus:
            outs[s.prev_tid].append(s.time)
    found = []
    for tid, left in outs.items():
        back = ins[tid]
        for t in left:
            if sum(b < t for b in back) < RAN_GUEST:
                continue
            own_return = min((b for b in back if b > t), default=float("inf"))
            if own_return - t < PAUSED_S:
                continue
            resumes = [
                (min(b for b in times if b > t), other)
                for other, times in ins.items()
                if other != tid and 0 < sum(b < t for b in times) < RAN_GUEST and times[-1] > t
            ]
            resumes = [r for r in resumes if r[0] < own_return]
            if resumes:
                resumed, dest = min(resumes)
                found.append((t, resumed, tid, dest))
                break
    return sorted(found)


def cpu_time(switches, start, end):
    """{cpu: {task: seconds on it}} between start and end (the idle task under its name, swapper/N)."""
    running, spent = {}, collections.defaultdict(lambda: collections.defaultdict(float))
    for s in switches:
        if s.time > end:
            break
        if s.time > start and s.cpu in running:
            tid, comm, since = running[s.cpu]
            spent[s.cpu][(tid, comm)] += s.time - max(since, start)
        running[s.cpu] = (s.next_tid, s.next_comm, s.time)
    for cpu, (tid, comm, since) in running.items():
        spent[cpu][(tid, comm)] += end - max(since, start)
    return spent


def windows_of_runs(lines):
    """[(paused, resumed)] of each tsubame run in a `compare.py` runs.jsonl (its `paused_at_monotonic_s` and
    `downtime_ms`): exact where the trace's vCPU threads cannot tell (an idle guest's vCPU sleeps while halted)."""
    found = []
    for line in lines:
        stats = (json.loads(line) if line.strip() else {}).get("vmm_stats") or {}
        paused = stats.get("paused_at_monotonic_s") or 0.0
        if paused > 0:
            found.append((paused, paused + stats.get("downtime_ms", 0.0) / 1e3))
    return found


def sides_in(switches, process, start, end):
    """{pid: "src:" or "dst:"}: a process whose `migration`, `encode-N` or `send-N` thread ran in the window is a
    source, one whose `decode-N` thread ran a destination."""
    ran = {(process.get(s.next_tid), s.next_comm) for s in switches if start <= s.time <= end}
    src = {pid for pid, comm in ran if comm == "migration" or comm.startswith(("encode-", "send-"))}
    dst = {pid for pid, comm in ran if comm.startswith("decode-")} - src
    return {**{pid: "src:" for pid in src if pid}, **{pid: "dst:" for pid in dst if pid}}


def report(lines, windows=None):
    """One dict per stop: its window and, per CPU, the idle time and each labelled thread's time (ms). The stops are
    `windows` [(paused, resumed)] when given, else found from the vCPU threads (see `stops`)."""
    switches, process = parse(lines)
    if windows is None:
        windows = [(paused, resumed) for paused, resumed, _, _ in stops(switches)]
    out = []
    for paused, resumed in windows:
        sides = sides_in(switches, process, paused, resumed)
        cpus = {}
        for cpu, tasks in sorted(cpu_time(switches, paused, resumed).items()):
            idle = sum(t for (tid, _), t in tasks.items() if tid == 0)
            threads = {}
            for (tid, comm), t in tasks.items():
                if tid != 0:
                    label = sides.get(process.get(tid), "") + comm
                    threads[label] = threads.get(label, 0.0) + t * 1e3
            cpus[cpu] = {"idle_ms": round(idle * 1e3, 3),
                         "threads_ms": {k: round(v, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])}}
        window = resumed - paused
        idle = sum(c["idle_ms"] for c in cpus.values())
        out.append({"paused_s": paused, "window_ms": round(window * 1e3, 3),
                    "idle_share": round(idle / (window * 1e3 * max(len(cpus), 1)), 3) if window > 0 else 0.0,
                    "cpus": cpus})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("trace", help="`perf script -F pid,tid,cpu,time,event,trace` output")
    parser.add_argument("--runs", metavar="RUNS_JSONL",
                        help="take the stops from compare.py's runs.jsonl (each tsubame run's pause and downtime) "
                             "instead of from the vCPU threads")
    parser.add_argument("--json", action="store_true", help="print the stops as JSON")
    args = parser.parse_args(argv)
    try:
        windows = None
        if args.runs:
            with open(args.runs) as f:
                try:
                    windows = windows_of_runs(f)
                except (ValueError, AttributeError) as e:
                    sys.exit(f"stop_cpus: {args.runs} is not compare.py's runs.jsonl: {e}")
        with open(args.trace) as f:
            found = report(f, windows)
    except OSError as e:
        sys.exit(f"stop_cpus: cannot read {e.filename}: {e.strerror}")
    if args.json:
        print(json.dumps(found, indent=1))
        return
    if not found:
        sys.exit("stop_cpus: no stop found (no vcpu0 thread left its CPU for 50 ms, or no run in --runs paused; was "
                 "the trace taken with -e sched:sched_switch -a during a migration?)")
    for stop in found:
        print(f"stop at {stop['paused_s']:.6f} s: {stop['window_ms']:.2f} ms, CPUs idle {stop['idle_share']:.0%}")
        for cpu, c in stop["cpus"].items():
            threads = ", ".join(f"{k} {v:.2f}" for k, v in c["threads_ms"].items() if v >= 0.01)
            print(f"  cpu{cpu}: idle {c['idle_ms']:.2f}; {threads}")


if __name__ == "__main__":
    main()
