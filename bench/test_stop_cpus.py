"""stop_cpus.py on a made-up scheduler trace: a source vCPU thread that
ran the guest is paused, the source's fetch and the destination's
decoder share the stop's CPUs, the destination's vCPU resumes."""

import stop_cpus

PAUSE = 10.0


def switch(pid, tid, cpu, t, prev, prev_tid, nxt, next_tid):
    return (f"{pid:>6}/{tid:<6} [{cpu:03d}] {t:.6f}: sched:sched_switch: prev_comm={prev} prev_pid={prev_tid} "
            f"prev_prio=120 prev_state=S ==> next_comm={nxt} next_pid={next_tid} next_prio=120")


def trace(back_after=None):
    """The stop; with `back_after` (seconds) the source's vCPU is back on a CPU that soon after leaving it."""
    lines = []
    # The destination's vCPU thread, created before the stop, loads nothing yet.
    lines.append(switch(0, 0, 1, 1.0, "swapper/1", 0, "vcpu0", 200))
    lines.append(switch(200, 200, 1, 1.001, "vcpu0", 200, "swapper/1", 0))
    # The source's vCPU runs the guest in short slices, then is paused.
    t = 2.0
    while t < PAUSE - 0.5:
        lines.append(switch(0, 0, 0, t, "swapper/0", 0, "vcpu0", 101))
        lines.append(switch(100, 101, 0, t + 0.1, "vcpu0", 101, "swapper/0", 0))
        t += 0.25
    lines.append(switch(0, 0, 0, PAUSE - 0.5, "swapper/0", 0, "vcpu0", 101))
    lines.append(switch(100, 101, 0, PAUSE, "vcpu0", 101, "migration", 102))
    # In the stop: the fetch on CPU 0 for 1 ms, a decoder on CPU 1 from 0.5 ms.
    lines.append(switch(100, 102, 0, PAUSE + 0.001, "migration", 102, "swapper/0", 0))
    lines.append(switch(0, 0, 1, PAUSE + 0.0005, "swapper/1", 0, "decode-0", 201))
    lines.append(switch(200, 201, 1, PAUSE + 0.0015, "decode-0", 201, "vcpu0", 200))
    if back_after is not None:
        lines.append(switch(0, 0, 0, PAUSE + back_after, "swapper/0", 0, "vcpu0", 101))
    # The destination's vCPU runs the guest from then on.
    t = PAUSE + 0.0015
    for _ in range(30):
        lines.append(switch(200, 200, 1, t + 0.4, "vcpu0", 200, "swapper/1", 0))
        lines.append(switch(0, 0, 1, t + 0.5, "swapper/1", 0, "vcpu0", 200))
        t += 0.5
    return lines


def test_finds_the_stop_and_its_cpu_time():
    (stop,) = stop_cpus.report(trace())
    assert stop["paused_s"] == PAUSE
    assert abs(stop["window_ms"] - 1.5) < 1e-6
    cpu0, cpu1 = stop["cpus"][0], stop["cpus"][1]
    assert abs(cpu0["threads_ms"]["src:migration"] - 1.0) < 1e-6
    assert abs(cpu0["idle_ms"] - 0.5) < 1e-6
    assert abs(cpu1["threads_ms"]["dst:decode-0"] - 1.0) < 1e-6
    assert abs(cpu1["idle_ms"] - 0.5) < 1e-6
    assert abs(stop["idle_share"] - 1.0 / 3.0) < 1e-3


def test_a_vcpu_back_within_50_ms_was_not_paused():
    assert stop_cpus.report(trace(back_after=0.02)) == []
    assert len(stop_cpus.report(trace(back_after=0.06))) == 1


def test_unreadable_lines_are_skipped():
    assert stop_cpus.report(["not a perf line", ""]) == []


def test_stops_from_the_runs_statistics():
    runs = ['{"vmm": "tsubame", "vmm_stats": {"paused_at_monotonic_s": %r, "downtime_ms": 1.5}}' % PAUSE,
            '{"vmm": "qemu", "vmm_stats": null}', ""]
    windows = stop_cpus.windows_of_runs(runs)
    assert windows == [(PAUSE, PAUSE + 0.0015)]
    # An idle guest: its vCPU never ran enough to tell the pause from the trace.
    idle = [line for line in trace() if "next_comm=vcpu0 next_pid=101" not in line]
    assert stop_cpus.report(idle) == []
    (stop,) = stop_cpus.report(idle, windows)
    assert abs(stop["cpus"][0]["threads_ms"]["src:migration"] - 1.0) < 1e-6
