"""Tests of bench/compare.py: parsing and ratio arithmetic on recorded outputs (bench/testdata/),
and one real smoke run of both VMMs when /dev/kvm, QEMU, root and a built tsubame are present.

    python3 -m pytest bench/test_compare.py            # all (the real run takes about a minute)
    TSB_BENCH_NO_REAL=1 python3 -m pytest bench/test_compare.py   # recorded outputs only

bench/testdata/:
  {qemu,tsubame}-{src,dst}-console.txt  guest lines of a smoke run (512M kv 1gbit) as the harness
                                        timestamped them, in seconds from migration start
  smoke-runs.jsonl                      the runs.jsonl of that same run
  qemu-query-migrate.json               QEMU 7.2's final query-migrate reply of it
  tsubame-migrate.json                  `tsubame migrate --json` statistics of it
  qemu-proc-stat.txt, qemu-task-stats.txt  /proc/PID/stat and /proc/PID/task/*/stat of a QEMU
  ratio-runs.jsonl                      hand-made runs with round numbers, for the medians and ratios
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(HERE, "testdata")
sys.path.insert(0, HERE)

import compare  # noqa: E402
import tsubame_bench  # noqa: E402
from tsubame_bench import console, demo, link, procs, qmp, units  # noqa: E402


def data(name):
    return os.path.join(DATA, name)


def recorded_runs():
    return {r["config"]: r for r in compare.load_runs(data("smoke-runs.jsonl"))}


# ---- units and case files


def test_sizes_and_rates():
    assert units.parse_size("512M") == 512 * 2**20
    assert units.parse_size("4G") == 4 * 2**30
    assert units.parse_rate("1gbit") == 1_000_000_000
    assert units.parse_rate("10Gbit") == 10_000_000_000
    assert units.parse_rate("500mbit") == 500_000_000
    assert units.parse_rate("100MB") == 800_000_000  # bytes per second
    assert units.tsubame_rate_arg(1_000_000_000) == "1000Mbit"
    assert units.tbf_burst_bytes(1e9) == 512 * 1024
    assert units.tbf_burst_bytes(1e10) == 5_000_000
    for bad in ("fast", "0gbit", "1gbps"):
        with pytest.raises(tsubame_bench.HarnessError):
            units.parse_rate(bad)


def test_smoke_case_file():
    cases, configs = compare.load_case_file(os.path.join(HERE, "cases", "smoke.toml"))
    (case,) = cases
    assert (case.workload, case.memory, case.link, case.repetitions) == ("kv", "512M", "1gbit", 1)
    assert {"qemu-default", "tsubame-auto"} <= set(case.configs)
    assert case.bandwidth_bits() == 1_000_000_000
    assert compare.guest_cmdline(case, 2599998) == "workload=kv wss=64M tsc_khz=2599998"


def test_paper_case_file():
    cases, configs = compare.load_case_file(os.path.join(HERE, "cases", "paper.toml"))
    assert {"qemu-default", "qemu-xbzrle", "qemu-multifd-zstd", "qemu-autoconverge", "tsubame-auto"} <= set(configs)
    assert configs["qemu-xbzrle"].parameters["xbzrle-cache-size"] == 512 * 2**20
    assert configs["qemu-multifd-zstd"].capabilities == ["multifd"]
    workloads = {(c.workload, c.memory, c.link) for c in cases}
    assert {("fill-zero", "4G", "1gbit"), ("fill-random", "4G", "1gbit"), ("kv", "4G", "1gbit"),
            ("kv", "2G", "10gbit")} <= workloads
    assert any(c.link == "1gbit" and c.memory == "1G" for c in cases)  # the SPP paper's setup


def test_tsubame_config_is_one_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[configs]\n'
                    'tsubame-zstd = { vmm = "tsubame", args = ["--codec", "zstd"] }\n'
                    'qemu-default = { vmm = "qemu" }\n'
                    '[[case]]\nname = "x"\nworkload = "idle"\nmemory = "64M"\nlink = "loopback"\n')
    cases, configs = compare.load_case_file(str(path))
    assert configs["tsubame-zstd"].args == ["--codec", "zstd"]
    assert cases[0].configs == ["tsubame-zstd", "qemu-default"]  # default: every config, in file order
    assert cases[0].link_bits() is None and cases[0].bandwidth_bits() is None  # loopback: unlimited
    caps, params = compare.qemu_migration_settings(cases[0], configs["qemu-default"])
    assert caps == [] and params["max-bandwidth"] == 10**12 and params["downtime-limit"] == 300


def test_bad_case_files(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[configs]\nq = { vmm = "qemu" }\n[[case]]\nname = "x"\nworkload = "kv"\nmemory = "64M"\n'
                    'configs = ["nope"]\n')
    with pytest.raises(tsubame_bench.HarnessError, match="config 'nope' is not defined"):
        compare.load_case_file(str(path))
    path.write_text('[configs]\nq = { vmm = "xen" }\n')
    with pytest.raises(tsubame_bench.HarnessError, match="vmm"):
        compare.load_case_file(str(path))


def test_postcopy_case_file():
    cases, configs = compare.load_case_file(os.path.join(HERE, "cases", "postcopy.toml"))
    workloads = {(c.workload, c.memory, c.link, tuple(c.args.items())) for c in cases}
    assert {("fill-random", "4G", "1gbit", (("wss", "3000M"),)),
            ("sparse", "1G", "1gbit", (("wss", "768M"), ("rate", "40")))} <= workloads
    qemu = configs["qemu-postcopy-1pass"]
    assert qemu.qemu_postcopy() and qemu.postcopy_after_passes == 1
    caps, _ = compare.qemu_migration_settings(cases[0], qemu)
    assert caps == [{"capability": "postcopy-ram", "state": True}]
    assert configs["tsubame-auto"].args == []  # the default is --postcopy auto
    assert configs["tsubame-postcopy-after1"].args == ["--postcopy", "after=1"]
    # the switch: after the first pass is done (dirty-sync-count 2), or at once
    t0 = compare.time.monotonic()
    assert not compare.qemu_postcopy_due(qemu, {"ram": {"dirty-sync-count": 1}}, t0)
    assert compare.qemu_postcopy_due(qemu, {"ram": {"dirty-sync-count": 2}}, t0)
    assert compare.qemu_postcopy_due(configs["qemu-postcopy-at-once"], {}, t0)


def test_postcopy_keys_are_for_qemu(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[configs]\nt = { vmm = "tsubame", postcopy_after_passes = 1 }\n'
                    '[[case]]\nname = "x"\nworkload = "idle"\nmemory = "64M"\n')
    with pytest.raises(tsubame_bench.HarnessError, match="postcopy_after_\\* is for QEMU"):
        compare.load_case_file(str(path))


def test_qemu_settings_of_a_link_case():
    cases, configs = compare.load_case_file(os.path.join(HERE, "cases", "paper.toml"))
    case = next(c for c in cases if c.link == "10gbit")
    caps, params = compare.qemu_migration_settings(case, configs["qemu-multifd-zstd"])
    assert caps == [{"capability": "multifd", "state": True}]
    assert params == {"max-bandwidth": 1_250_000_000, "downtime-limit": 300, "multifd-channels": 4,
                      "multifd-compression": "zstd"}


# ---- recorded guest lines


@pytest.mark.parametrize("vmm", ["qemu", "tsubame"])
def test_recorded_consoles(vmm):
    src = compare.read_console(data(f"{vmm}-src-console.txt"))
    dst = compare.read_console(data(f"{vmm}-dst-console.txt"))
    assert src[0][1].startswith("tsubame-guest: workload=kv wss=256M")
    assert "tsc_khz=2599998 (cmdline)" in src[0][1]
    assert console.guest_errors(src + dst) == []
    sp, dp = console.progress_points(src), console.progress_points(dst)
    # every line is progress but the guest's info lines (banner, "kv keys=...")
    assert len(sp) + sum(1 for _, text in src if text.startswith("tsubame-guest: ")) == len(src)
    assert len(dp) == len(dst)
    assert console.ops_continuous(sp, dp)
    assert all(b[1] >= a[1] for a, b in zip(sp, sp[1:]))


@pytest.mark.parametrize("vmm", ["qemu", "tsubame"])
def test_guest_figures_from_recorded_lines(vmm):
    """The guest figures recomputed from the recorded consoles equal those the harness recorded."""
    run = recorded_runs()[f"{vmm}-default"]
    sp = console.progress_points(compare.read_console(data(f"{vmm}-src-console.txt")))
    dp = console.progress_points(compare.read_console(data(f"{vmm}-dst-console.txt")))
    t_src_last, t_dst_first, gap = console.switchover(sp, dp, 0.0)
    assert gap == pytest.approx(run["switchover_gap_ms"], abs=0.2)  # consoles keep 0.1 ms
    assert t_dst_first - t_src_last == pytest.approx(gap / 1e3)
    assert t_dst_first == pytest.approx(run["time_to_destination_s"], abs=2e-4)
    downtime = console.guest_downtime_ms(sp, dp, t_src_last, t_dst_first)
    assert downtime == pytest.approx(run["guest_downtime_ms"], abs=0.2)
    assert downtime >= gap
    assert console.ops_rate(sp, -1.5, 0.0) == pytest.approx(run["ops_per_sec_before"], rel=1e-3)
    assert console.ops_rate(sp, 0.0, t_src_last) == pytest.approx(run["ops_per_sec_during"], rel=1e-3)
    assert console.ops_rate(dp, t_dst_first, t_dst_first + 3) == pytest.approx(run["ops_per_sec_after"], rel=1e-3)
    assert console.max_gap_ms(sp, 0.0, t_src_last) == pytest.approx(run["max_source_gap_ms"], abs=0.2)


def test_guest_figures_by_hand():
    src = [(0.0, 0), (0.05, 100), (0.10, 200), (0.30, 300)]  # a 200 ms stall, then the switch-over
    dst = [(0.75, 310), (0.80, 410)]
    assert console.switchover(src, dst, 0.0) == (0.30, 0.75, pytest.approx(450))
    assert console.max_gap_ms(src, 0.0, 0.30) == pytest.approx(200)
    assert console.ops_rate(src, 0.0, 0.10) == pytest.approx(2000)
    assert console.ops_rate(src, 0.2, 0.25) is None  # fewer than two lines
    assert console.switchover(src, [], 0.0) == (None, None, None)
    # the largest gap around the switch-over: here the 450 ms switch-over itself ...
    assert console.guest_downtime_ms(src, dst, 0.30, 0.75) == pytest.approx(450)
    # ... or a longer stall right after the destination resumed
    stalled = [(0.75, 310), (1.35, 410), (1.40, 510)]
    assert console.guest_downtime_ms(src, stalled, 0.30, 0.75) == pytest.approx(600)
    assert console.guest_downtime_ms(src, stalled, 0.30, None) is None
    lines = [(0, "tsb ops=5 pass=0"), (1, "tsubame-guest: exception #PF at 0x1"), (2, "tsb ops=x pass=1")]
    assert console.progress_points(lines) == [(0, 5)]
    assert console.guest_errors(lines) == ["tsubame-guest: exception #PF at 0x1"]


# ---- VMM statistics and /proc


def test_qemu_figures():
    with open(data("qemu-query-migrate.json")) as f:
        fig = qmp.qemu_figures(json.load(f))
    run = recorded_runs()["qemu-default"]
    assert fig["status"] == "completed"
    assert fig["total_time_s"] == pytest.approx(run["vmm_stats"]["total-time"] / 1000)
    assert fig["vmm_downtime_ms"] == run["vmm_stats"]["downtime"]
    assert fig["iterations"] == run["vmm_stats"]["ram"]["dirty-sync-count"]
    assert fig["vmm_bytes"] == run["vmm_stats"]["ram"]["transferred"]
    assert qmp.qemu_figures({"status": "failed", "error-desc": "boom"})["error"] == "boom"


def test_tsubame_figures():
    with open(data("tsubame-migrate.json")) as f:
        stats = json.load(f)
    fig = demo.tsubame_figures(stats)
    assert fig["status"] == "completed" and fig["converged"] is True
    assert fig["total_time_s"] == pytest.approx(stats["total_time_ms"] / 1000)
    assert fig["vmm_downtime_ms"] == stats["downtime_ms"]
    assert fig["iterations"] == stats["iterations"] == len(stats["per_iteration"])
    assert fig["vmm_bytes"] == stats["bytes_on_wire"]


def test_bytes_on_wire_close_to_vmm_figures():
    """The veth counter sees the VMM's bytes plus TCP/IP headers (a few percent more)."""
    for run in recorded_runs().values():
        assert 1.0 <= run["bytes_on_wire"] / run["vmm_bytes"] < 1.1


def test_parse_proc_stat():
    with open(data("qemu-proc-stat.txt")) as f:
        comm, ticks = procs.parse_proc_stat(f.read())
    assert comm == "qemu-system-x86" and ticks >= 0
    with open(data("qemu-task-stats.txt")) as f:
        threads = [procs.parse_proc_stat(line) for line in f]
    vcpus = [(c, t) for c, t in threads if procs.VCPU_THREAD_RE.match(c)]
    assert [c for c, _ in vcpus] == ["CPU 0/KVM"] and vcpus[0][1] > 0
    assert procs.VCPU_THREAD_RE.match("vcpu0") and not procs.VCPU_THREAD_RE.match("migration")


def test_cpu_sampler_keeps_threads_that_exit(monkeypatch):
    samples = iter([
        (100, {1: ("tsubame", 10), 2: ("vcpu0", 80)}),
        (250, {1: ("tsubame", 30), 2: ("vcpu0", 200), 3: ("migration", 10)}),
        (300, {1: ("tsubame", 40)}),  # vcpu0 ended before the process
        None,  # the process exited: the last sample stays
    ])
    monkeypatch.setattr(procs, "read_cpu_ticks", lambda pid: next(samples))
    monkeypatch.setattr(procs, "CLK_TCK", 100)
    sampler = procs.CpuSampler(1234)
    for _ in range(4):
        sampler.sample()
    total, vcpu = sampler.seconds()
    assert total == pytest.approx(2.0) and vcpu == pytest.approx(1.2)


# ---- medians, ratios, table


def test_medians_and_ratios():
    runs = compare.load_runs(data("ratio-runs.jsonl"))
    groups = compare.group_runs(runs)
    q = compare.summarize(groups["a"]["qemu-default"])
    t = compare.summarize(groups["a"]["tsubame-auto"])
    assert (q["total_time_s"], q["vmm_downtime_ms"], q["bytes_on_wire"]) == (10.0, 300, 1000 * 2**20)
    assert q["cpu_source_migration_s"] == pytest.approx(1.0)
    # the timeout is left out of the medians but counted
    assert (t["completed"], t["runs"], t["converged"]) == (2, 3, 2)
    assert (t["total_time_s"], t["vmm_downtime_ms"], t["guest_downtime_ms"]) == (5.0, 150, 200)
    rows = {(c, tn, qn): r for c, tn, qn, r in compare.ratio_rows(runs)}
    a = rows[("a", "tsubame-auto", "qemu-default")]
    assert a["total_time_s"] == pytest.approx(0.5)
    assert a["time_to_destination_s"] == pytest.approx(5.1 / 10.1)
    assert a["guest_downtime_ms"] == pytest.approx(200 / 320)
    assert a["bytes_on_wire"] == pytest.approx(0.6)
    assert a["cpu_source_s"] == pytest.approx(5 / 9)
    assert a["cpu_source_migration_s"] == pytest.approx(0.5)
    assert a["ops_per_sec_during"] == pytest.approx(2.0)
    b = rows[("b", "tsubame-auto", "qemu-default")]
    assert all(v is None for v in b.values())  # QEMU never completed: no ratio
    assert compare.ratio(1, 0) is None and compare.ratio(None, 2) is None


def test_table_text():
    table = compare.make_table(compare.load_runs(data("ratio-runs.jsonl")))
    # recorded before the guest reported its own stall: guest stall and VMM stop→resume are "–"
    assert "| a | qemu-default | 3/3 | 3/3 | 10.00 | 10.10 | – | – | 300 | 320 | 1000 |" in table
    assert "| b | qemu-default | 0/1 | 0/1 | >120 | – |" in table
    assert ("| a | tsubame-auto | qemu-default | 0.50 | 0.50 | – | – | 0.50 | 0.62 | 0.60 | 0.56 | 0.50 | 0.50 | "
            "2.00 |" in table)
    assert "| b | tsubame-auto | qemu-default | – |" in table
    # the default against the best QEMU configuration (qemu-xbzrle's median 9 s) and qemu-default's downtime
    assert "| a | qemu-xbzrle | 2/3 | 0.56 | 0.50 | 200 | – |" in table
    assert "| b | none completed | 1/1 | – | – | 450 | – |" in table


def test_downtime_columns_lead_for_both_vmms():
    runs = [r for r in compare.load_runs(data("ratio-runs.jsonl")) if r["case"] == "a"]
    for r in runs:
        r["guest_stall_ms"], r["vmm_stop_resume_ms"] = (240.0, 230.0) if r["vmm"] == "qemu" else (60.0, 46.0)
    table = compare.make_table(runs)
    header = table.splitlines()[0]
    assert header.index("guest stall (ms)") < header.index("VMM stop→resume (ms)") < header.index("VMM downtime")
    assert "| a | qemu-default | 3/3 | 3/3 | 10.00 | 10.10 | 240.0 | 230.0 | 300 |" in table
    assert "| a | tsubame-auto | qemu-default | 0.50 | 0.50 | 0.25 | 0.20 | 0.50 |" in table


def test_run_order_rotates_each_vmm_group():
    configs = {n: compare.VmmConfig(name=n, vmm=n.split("-")[0], args=[]) for n in
               ["qemu-default", "qemu-xbzrle", "tsubame-auto", "tsubame-4096", "tsubame-spp128"]}
    names = list(configs)
    orders = [compare.run_order(names, configs, rep) for rep in (1, 2, 3)]
    assert orders[0] == names
    assert orders[1] == ["qemu-xbzrle", "qemu-default", "tsubame-4096", "tsubame-spp128", "tsubame-auto"]
    # Each tsubame configuration follows the QEMU runs once in three.
    assert sorted(order[2] for order in orders) == sorted(["tsubame-auto", "tsubame-4096", "tsubame-spp128"])
    assert all(sorted(order) == sorted(names) for order in orders)


def test_auto_against_the_better_fixed_granularity():
    runs = [r for r in compare.load_runs(data("ratio-runs.jsonl")) if r["case"] == "a"]
    auto = [r for r in runs if r["config"] == "tsubame-auto"]
    for name, total in (("tsubame-4096", 8.0), ("tsubame-spp128", 4.0)):
        runs += [dict(r, config=name, total_time_s=total) for r in auto]
    [(_, _, figures)] = compare.best_qemu_rows(runs)
    assert figures["granularity"] == pytest.approx(5.0 / 4.0)  # auto's median 5 s against 128's 4 s


def test_expected_against_measured_downtime():
    runs = compare.load_runs(data("ratio-runs.jsonl"))
    # Case a's converged tsubame runs stopped 100 and 200 ms; the engine expected 115 and 130. Runs that did not
    # converge (b's, a's timeout) and QEMU's are left out.
    expected = iter([115, 130])
    for r in runs:
        if r["vmm"] == "tsubame" and r["status"] == "completed":
            r["vmm_stats"] = {"expected_downtime_ms": next(expected, 380)}
    [(case, config, figures)] = compare.expected_rows(runs)
    assert (case, config) == ("a", "tsubame-auto")
    assert (figures["converged"], figures["within"]) == (2, 1)
    assert figures["shares"] == pytest.approx((0.65, 1.15))
    assert figures["measured_ms"] == (100, 200)
    table = compare.make_table(runs)
    assert "converged runs: 1 of 2 within ±20 %:" in table
    assert "| a | tsubame-auto | 1/2 | 0.65-1.15 | 100.00-200.00 |" in table
    # Runs recorded without the engine's statistics have no row.
    assert compare.expected_rows(compare.load_runs(data("ratio-runs.jsonl"))) == []


def test_table_from_recorded_run(tmp_path):
    """--table-from needs neither root nor KVM: it prints the table of a runs.jsonl (and plots it)."""
    args = [sys.executable, os.path.join(HERE, "compare.py"), "--table-from", data("smoke-runs.jsonl"),
            "--out", str(tmp_path)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        args.append("--no-plots")
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "| smoke-kv-512M-1gbit | tsubame-default | qemu-default |" in p.stdout  # a recorded run, under its old name
    assert (tmp_path / "table.md").read_text() == p.stdout.rstrip("\n") + "\n"
    if "--no-plots" not in args:
        for name in ("smoke-kv-512M-1gbit-bars.png", "smoke-kv-512M-1gbit-timeline.png"):
            assert (tmp_path / name).stat().st_size > 10_000


# ---- a real run of both VMMs


TSUBAME = os.path.join(ROOT, "target", "release", "tsubame")
REAL_RUN_POSSIBLE = (os.environ.get("TSB_BENCH_NO_REAL") != "1" and os.geteuid() == 0
                     and os.access("/dev/kvm", os.R_OK | os.W_OK) and shutil.which("qemu-system-x86_64") is not None
                     and os.path.exists(TSUBAME) and shutil.which("ip") is not None)


@pytest.mark.skipif(not REAL_RUN_POSSIBLE, reason="needs root, /dev/kvm, qemu-system-x86_64, ip and "
                                                  "target/release/tsubame (or TSB_BENCH_NO_REAL=1 was set)")
def test_real_smoke_run(tmp_path):
    case = tmp_path / "tiny.toml"
    case.write_text('[configs]\n'
                    'qemu-default = { vmm = "qemu" }\n'
                    'tsubame-auto = { vmm = "tsubame", args = [] }\n'
                    # 10 Gbit/s: kv over 128M converges for both VMMs however
                    # fast the host runs the guest (at 1 Gbit/s QEMU ran 136
                    # iterations without converging once this machine was quiet).
                    '[[case]]\nname = "tiny-kv-256M-10gbit"\nworkload = "kv"\nargs = { wss = "128M" }\n'
                    'memory = "256M"\nlink = "10gbit"\nrepetitions = 1\ntime_limit_s = 60\n'
                    'warmup_s = 2\nwatch_s = 2\n')
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(HERE, "compare.py"), str(case), "--out", str(out),
                        "--tsubame", TSUBAME, "--no-plots"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = {r["config"]: r for r in compare.load_runs(str(out / "runs.jsonl"))}
    assert set(runs) == {"qemu-default", "tsubame-auto"}
    assert runs["qemu-default"]["vmm_stats"]["status"] == "completed"  # QMP's own word
    assert runs["tsubame-auto"]["vmm_stats"]["status"] == "completed"
    for run in runs.values():
        assert run["status"] == "completed", run["error"]
        assert run["destination_progress_lines"] >= 10  # the destination kept printing progress
        assert run["ops_continuous"] and run["ops_per_sec_after"] > 0
        assert run["guest_downtime_ms"] > 0 and run["bytes_on_wire"] > 256 * 2**20 * 0.5
        assert run["cpu_source_s"] > 0 and run["cpu_destination_s"] >= 0
        # downtime the same way for both: the guest's own stall and the VMM's stop→resume
        assert run["guest_stall_ms"] > 0 and run["vmm_stop_resume_ms"] > 0
    assert "| tiny-kv-256M-10gbit | tsubame-auto | qemu-default |" in p.stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    leftover = [n.split()[0] for n in names.splitlines() if n.strip()]
    dead = [n for n in leftover if link.NS_NAME_RE.match(n) and not procs.pid_alive(int(n.split("-")[1]))]
    assert dead == [], f"namespaces left behind: {dead}"
