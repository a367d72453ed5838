"""Unit tests of bench/tsubame_bench (no KVM, no root needed)."""
import json
import stat

import pytest

from tsubame_bench import HarnessError
from tsubame_bench.console import guest_stall, parse_progress, progress_points, stall_ms
from tsubame_bench.qmp import event_unix_s, stop_resume_ms
from tsubame_bench.demo import migration_cpu, run_demo
from tsubame_bench.units import parse_rate, parse_size


def test_progress_lines_with_and_without_extra_fields():
    assert parse_progress("tsb ops=12 pass=3") == {"ops": 12, "pass": 3}
    assert parse_progress("tsb ops=12 pass=3 rd=4096 wr=0") == {"ops": 12, "pass": 3, "rd": 4096, "wr": 0}
    assert parse_progress("  tsb ops=1 pass=0  \n") == {"ops": 1, "pass": 0}
    for bad in ["tsb ops=x pass=3", "tsb ops=1", "tsubame-guest: workload=kv", "tsb ops=1 pass=2 junk"]:
        assert parse_progress(bad) is None, bad
    assert progress_points([(1.0, "tsb ops=5 pass=0 rd=1"), (2.0, "noise"), (3.0, "tsb ops=9 pass=1")]) == [
        (1.0, 5), (3.0, 9)]


def test_guest_stall_is_the_largest_gap_us_from_migration_start_to_the_watch_end():
    assert parse_progress("tsb ops=12 pass=3 gap_us=812 rd=1") == {"ops": 12, "pass": 3, "gap_us": 812, "rd": 1}
    assert stall_ms("tsb ops=12 pass=3 gap_us=1500") == 1.5
    assert stall_ms("tsb ops=12 pass=3") is None and stall_ms("tsubame-guest: kv keys=1") is None
    src = [(0.5, "tsb ops=1 pass=0 gap_us=90000"),  # before migration start: not counted
           (1.1, "tsb ops=2 pass=0 gap_us=9000"), (1.2, "tsb ops=3 pass=0 gap_us=12000"),
           (9.0, "tsb ops=4 pass=0 gap_us=70000")]  # after the source's end (a timed-out source ran on)
    dst = [(1.5, "tsb ops=5 pass=0 gap_us=250000"),  # the first line after the resume carries the stop
           (1.6, "tsb ops=6 pass=0 gap_us=8000"), (5.0, "tsb ops=7 pass=0 gap_us=900000")]  # past the watch
    assert guest_stall(src, dst, 1.0, 2.0, 4.0) == (250.0, "destination", 1.5)
    assert guest_stall(src, [], 1.0, 2.0, 4.0) == (12.0, "source", 1.2)
    assert guest_stall([(1.1, "tsb ops=2 pass=0")], [], 1.0, 2.0, 4.0) == (None, None, None)


def test_stop_resume_from_one_clock():
    stop = {"event": "STOP", "timestamp": {"seconds": 1700000000, "microseconds": 250000}}
    assert event_unix_s(stop) == 1700000000.25
    assert stop_resume_ms(100.0, 100.2) == pytest.approx(200.0)
    assert stop_resume_ms(None, 100.2) is None and stop_resume_ms(100.0, None) is None
    assert stop_resume_ms(100.2, 100.0) is None  # a resume before the stop is someone else's


def test_units():
    assert parse_size("512M") == 512 << 20 and parse_size("4G") == 4 << 30
    assert parse_rate("1gbit") == 10**9 and parse_rate("100MB") == 8 * 10**8
    with pytest.raises(HarnessError):
        parse_rate("fast")


def fake_tsubame(tmp_path, stats):
    """A stand-in binary that writes `stats` to the path after --json."""
    script = tmp_path / "tsubame"
    payload = json.dumps(stats)
    script.write_text("#!/usr/bin/env python3\nimport sys\n"
                      "path = sys.argv[sys.argv.index('--json') + 1]\n"
                      f"open(path, 'w').write({payload!r})\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_run_demo_reads_and_checks_statistics(tmp_path):
    good = {"status": "completed", "digest_verified": True,
            "cpu_seconds": {"source_migration_thread": 0.5, "destination": 0.25},
            "pipeline": {"stages": [{"cpu_seconds": 0.25}, {"cpu_seconds": 0.5}]}}
    stats, proc = run_demo(fake_tsubame(tmp_path, good), ["--memory", "1G"], str(tmp_path / "a.json"))
    assert stats["status"] == "completed" and proc.returncode == 0
    assert migration_cpu(stats) == (1.25, 0.25)
    bad = dict(good, status="failed", error="destination refused")
    with pytest.raises(HarnessError, match="destination refused"):
        run_demo(fake_tsubame(tmp_path, bad), [], str(tmp_path / "b.json"))
    stats, _ = run_demo(fake_tsubame(tmp_path, bad), [], str(tmp_path / "c.json"), check=False)
    assert stats["status"] == "failed"


def test_ops_done_rate_counts_a_silent_guest_as_stalled():
    from tsubame_bench.console import ops_done_rate
    src = [(0.0, 100), (1.0, 200)]
    dst = [(3.0, 260), (3.5, 400)]
    # by t=2 the last count is the source's 200; by t=3, 260
    assert ops_done_rate(src, dst, 2.0, 3.0) == 60
    # nothing printed between: no progress
    assert ops_done_rate(src, dst, 1.5, 2.5) == 0
    assert ops_done_rate([], [], 0.0, 1.0) is None
    # the destination's first line (260 at t=3) carries what the source did after its last
    # line: counted from it, 140 ops over the 2.5 s window from t=1
    assert ops_done_rate(src, dst, 1.0, 3.5, counted_from=3.0) == 56
    # a destination that first printed after the window made no progress in it
    assert ops_done_rate(src, dst, 1.0, 2.5, counted_from=3.0) == 0
