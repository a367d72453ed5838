#!/usr/bin/env python3
"""Issue 9's check: trace a running VM, predict its migration with
`simulate` and `plan`, then migrate it for real at the same bandwidth and
compare, iteration by iteration. The guest's speed (ops/s from its
progress lines, via the control socket's `stats`) is sampled before,
while tracing and while migrating, since the prediction depends on it.

    python3 bench/predict_check.py --memory 1G --workload kv --bandwidth 1Gbit
    python3 bench/predict_check.py --memory 1G --workload "sparse wss=1G rate=2" \
        --granularity 128 --method all

Prints a markdown table; writes everything to --out.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from tsubame_bench.control import control_request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TSUBAME = os.path.join(ROOT, "target", "release", "tsubame")


def control(path, request, timeout=120):
    return control_request(path, request, timeout_s=timeout)


def wait_socket(path, proc, what):
    for _ in range(300):
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            sys.exit(f"{what} exited early ({proc.returncode})")
        time.sleep(0.05)
    sys.exit(f"{what} did not open {path}")


class OpsSampler:
    """Polls the guest's ops counter; mean ops/s over a time window."""

    def __init__(self, sock, pid):
        self.sock = sock
        self.pid = pid
        self.samples = []
        # The vCPU's schedstat too: the VM process is gone once migrated.
        self.sched = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            try:
                stats = control(self.sock, {"cmd": "stats"}, timeout=2)
                ops = stats.get("guest", {}).get("ops")
                if ops is not None:
                    self.samples.append((time.monotonic(), ops))
            except (OSError, ValueError):
                pass
            st = vcpu_schedstat(self.pid)
            if st:
                self.sched.append(st)
            time.sleep(0.1)

    def rate(self, start, end):
        inside = [(t, o) for t, o in self.samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def vcpu_schedstat(pid):
    """(seconds on CPU, seconds runnable but waiting) of the VM's vCPU
    thread, from /proc's schedstat; None when it cannot be read."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == "vcpu0":
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        run, wait = f.read().split()[:2]
                    return time.monotonic(), int(run) / 1e9, int(wait) / 1e9
    except OSError:
        pass
    return None


def pin_vcpu(pid, cpu):
    """Moves the VM's vCPU thread onto `cpu` alone."""
    for _ in range(100):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == "vcpu0":
                    os.sched_setaffinity(int(tid), {cpu})
                    return
        time.sleep(0.05)
    sys.exit("no vcpu0 thread to pin")


def shares(a, b):
    """The vCPU's share of wall time on a CPU and waiting for one."""
    if not a or not b or b[0] <= a[0]:
        return None
    wall = b[0] - a[0]
    return {"running": (b[1] - a[1]) / wall, "waiting": (b[2] - a[2]) / wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--workload", default="kv")
    ap.add_argument("--bandwidth", default="1Gbit")
    ap.add_argument("--interval", default="10ms")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--granularity", type=int, default=128)
    ap.add_argument("--method", default="page", help="simulate's --method (page, all, ...)")
    ap.add_argument("--migrate-granularity", type=int, default=4096, help="the real migration's --granularity")
    ap.add_argument("--max-iterations", type=int, default=30,
                    help="give up after this many iterations, in the replay and the real migration alike "
                         "(default: the engine's, %(default)s)")
    ap.add_argument("--auto-converge", action="store_true",
                    help="migrate with --auto-converge and replay it (simulate --auto-converge)")
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--run-flag", action="append", default=[], help="extra flag for `tsubame run` (repeatable)")
    ap.add_argument("--pin-vcpu", action="store_true",
                    help="run the vCPU alone on CPU 0 and everything else (tracer, migration, destination) on CPU 1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--report-only", action="store_true", help="re-print the report of an earlier --out")
    args = ap.parse_args()
    if args.report_only:
        return report(args.out, json.load(open(os.path.join(args.out, "check.json"))))
    out = args.out or tempfile.mkdtemp(prefix="tsubame-predict-")
    os.makedirs(out, exist_ok=True)
    src_sock, dst_addr = os.path.join(out, "src.sock"), os.path.join(out, "dst.sock")
    trace_file = os.path.join(out, "vm.trace")
    for p in (src_sock, dst_addr):
        if os.path.exists(p):
            os.unlink(p)
    workload = args.workload.split()
    run_cmd = [TSUBAME, "run", "--memory", args.memory, "--workload", workload[0], "--control", src_sock, "--quiet"]
    for kv in workload[1:]:
        run_cmd += ["--workload-arg", kv]
    run_cmd += args.run_flag
    procs = []
    if args.pin_vcpu:
        if not {0, 1} <= os.sched_getaffinity(0):
            sys.exit("--pin-vcpu needs CPUs 0 and 1")
        os.sched_setaffinity(0, {1})  # inherited by every process started below
    try:
        vm = subprocess.Popen(run_cmd)
        procs.append(vm)
        wait_socket(src_sock, vm, "tsubame run")
        if args.pin_vcpu:
            pin_vcpu(vm.pid, 0)
        sampler = OpsSampler(src_sock, vm.pid)
        time.sleep(args.warmup)
        t0 = time.monotonic()
        s0 = vcpu_schedstat(vm.pid)
        time.sleep(2.0)
        native = sampler.rate(t0, time.monotonic())
        s1 = vcpu_schedstat(vm.pid)
        trace_cmd = [TSUBAME, "trace", "--control", src_sock, "--out", trace_file, "--seconds", str(args.seconds),
                     "--interval", args.interval, "--granularity", str(args.granularity)]
        t1 = time.monotonic()
        subprocess.run(trace_cmd, check=True)
        tracing = sampler.rate(t1, time.monotonic())
        s2 = vcpu_schedstat(vm.pid)
        sim_json = os.path.join(out, "simulate.json")
        sim_cmd = [TSUBAME, "simulate", "--trace", trace_file, "--bandwidth", args.bandwidth,
                   "--method", args.method, "--max-iterations", str(args.max_iterations), "--json", sim_json]
        if args.auto_converge:
            sim_cmd.append("--auto-converge")
        sim_text = subprocess.run(sim_cmd, check=True, capture_output=True, text=True).stdout
        plan_json = os.path.join(out, "plan.json")
        plan_cmd = [TSUBAME, "plan", "--trace", trace_file, "--bandwidths", args.bandwidth, "--json", plan_json]
        plan_text = subprocess.run(plan_cmd, check=True, capture_output=True, text=True).stdout
        time.sleep(1.0)
        dst = subprocess.Popen([TSUBAME, "receive", "--listen", "unix:" + dst_addr, "--once", "--quiet"])
        procs.append(dst)
        wait_socket(dst_addr, dst, "tsubame receive")
        real_json = os.path.join(out, "migrate.json")
        mig_cmd = [TSUBAME, "migrate", "--control", src_sock, "--to", "unix:" + dst_addr,
                   "--max-bandwidth", args.bandwidth, "--granularity", str(args.migrate_granularity),
                   "--max-iterations", str(args.max_iterations),
                   "--json", real_json]
        if args.auto_converge:
            mig_cmd.append("--auto-converge")
        t2 = time.monotonic()
        s3 = vcpu_schedstat(vm.pid)
        subprocess.run(mig_cmd, check=True, stdout=subprocess.DEVNULL)
        s4 = vcpu_schedstat(vm.pid) or (sampler.sched[-1] if sampler.sched else None)
        migrating = sampler.rate(t2, time.monotonic() - 0.5)
        sampler.stop.set()
        migrating_samples = [(t - t2, o) for t, o in sampler.samples if t >= t2 - 0.5]
        dst.terminate()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    doc = {"commands": [run_cmd, trace_cmd, sim_cmd, plan_cmd, mig_cmd], "native_ops": native,
           "tracing_ops": tracing, "migrating_ops": migrating, "migrating_samples": migrating_samples,
           "pinned_vcpu": args.pin_vcpu,
           "vcpu": {"before": shares(s0, s1), "tracing": shares(s1, s2), "migrating": shares(s3, s4)},
           "real": json.load(open(real_json)),
           "simulate": json.load(open(sim_json)), "plan": json.load(open(plan_json)),
           "simulate_text": sim_text, "plan_text": plan_text}
    json.dump(doc, open(os.path.join(out, "check.json"), "w"), indent=1)
    report(out, doc)


def real_guest_speeds(doc):
    """The guest's ops/s over each real pre-copy iteration, as a fraction of
    its speed before tracing (from the samples taken while migrating)."""
    samples, native = doc.get("migrating_samples"), doc["native_ops"]
    if not samples or not native:
        return None
    at = doc["real"].get("setup_time_ms", 0) / 1e3
    speeds = []
    for it in doc["real"]["per_iteration"][:-1]:
        end = at + it["duration_ms"] / 1e3
        inside = [(t, o) for t, o in samples if at <= t <= end]
        ok = len(inside) >= 2 and inside[-1][0] - inside[0][0] >= 0.15
        speeds.append((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]) / native if ok else None)
        at = end
    return speeds


def report(out, doc):
    sim, plan, real = doc["simulate"], doc["plan"], doc["real"]
    native, tracing, migrating = doc["native_ops"], doc["tracing_ops"], doc["migrating_ops"]
    its = real["per_iteration"]
    real_time = real["total_time_ms"] / 1e3
    real_bytes = real["bytes_on_wire"]
    print("commands:\n" + "".join("  " + " ".join(c) + "\n" for c in doc["commands"]))
    if doc.get("pinned_vcpu"):
        print("(--pin-vcpu: the vCPU alone on CPU 0, every other thread and process on CPU 1)\n")
    print(f"guest ops/s: before {native or 0:,.0f}, while traced {tracing or 0:,.0f}, "
          f"while migrating {migrating or 0:,.0f}")
    for phase, v in (doc.get("vcpu") or {}).items():
        if v:
            print(f"vCPU thread {phase}: on a CPU {v['running']:.2f} of the time, waiting for one {v['waiting']:.2f}")
    print()
    print("| | iterations | total (s) | GiB sent | iteration-1 pages |")
    print("|---|---|---|---|---|")
    it1 = its[1]["pages_sent"] if len(its) > 1 else 0
    print(f"| real `migrate` | {len(its)} | {real_time:.2f} | {real_bytes / 2**30:.2f} | {it1:,} |")
    for r in sim:
        s_it1 = r["iterations"][1]["pages"] if len(r["iterations"]) > 1 else 0
        print(f"| simulate `{r['method']}` | {len(r['iterations'])} | {r['total_time_s']:.2f} "
              f"({r['total_time_s'] / real_time:.2f}×) | {r['bytes_total'] / 2**30:.2f} "
              f"({r['bytes_total'] / real_bytes:.2f}×) | {s_it1:,} ({s_it1 / max(it1, 1):.2f}×) |")
    for p in plan["predictions"]:
        if p["method"] == "page":
            print(f"| plan `page` | {p['iterations']} | {p['total_time_s']:.2f} | – | "
                  f"{p['iteration1_dirty_pages']:,.0f} ({p['iteration1_dirty_pages'] / max(it1, 1):.2f}×) |")
    granularity = next((int(c[i + 1]) for c in doc["commands"] for i, a in enumerate(c) if a == "--granularity"
                        and "migrate" in c), 4096)
    same = "page" if granularity == 4096 else "subpage"
    for r in sim:
        sp = r.get("spread")
        if sp and r["method"] == same:
            lo, hi = sp["iterations"]
            inside = "inside" if lo <= len(its) <= hi else "OUTSIDE"
            print(f"\nsimulate `{r['method']}` with the guest ±{sp['by'] * 100:.0f} %: {lo}–{hi} iterations, "
                  f"{sp['total_time_s'][0]:.2f}–{sp['total_time_s'][1]:.2f} s; the real {len(its)} is {inside} the range")
    m = plan["model"]
    print(f"\nD(t) fit: M = {m['m']:,.0f} pages, tau = {m['tau']:.3f} s, R² = {m['r_squared']:.4f}")
    print("\nreal iterations (pages sent, ms):", [(i["pages_sent"], round(i["duration_ms"])) for i in its])
    for r in sim:
        print(f"simulate {r['method']} iterations:", [(i["pages"], round(i["duration_s"] * 1e3)) for i in r["iterations"]])
    speeds = real_guest_speeds(doc)
    if speeds:
        print("\nguest speed per iteration, fraction of before (real, from progress lines):",
              [round(x, 2) if x is not None else None for x in speeds])
        for r in sim:
            if "guest_speed" in r["iterations"][0]:
                print(f"guest speed per iteration (simulate {r['method']}, modelled):",
                      [round(i["guest_speed"], 2) for i in r["iterations"][:-1]])
    print(doc["simulate_text"])
    print(doc["plan_text"])


if __name__ == "__main__":
    main()
