"""Unit tests of bench/tsubame_bench (no KVM, no root needed)."""
import json
import os
import stat
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tsubame_bench import HarnessError  # noqa: E402
from tsubame_bench.console import parse_progress, progress_points  # noqa: E402
from tsubame_bench.demo import migration_cpu, run_demo  # noqa: E402
from tsubame_bench.units import parse_rate, parse_size  # noqa: E402


def test_progress_lines_with_and_without_extra_fields():
    assert parse_progress("tsb ops=12 pass=3") == {"ops": 12, "pass": 3}
    assert parse_progress("tsb ops=12 pass=3 rd=4096 wr=0") == {"ops": 12, "pass": 3, "rd": 4096, "wr": 0}
    assert parse_progress("  tsb ops=1 pass=0  \n") == {"ops": 1, "pass": 0}
    for bad in ["tsb ops=x pass=3", "tsb ops=1", "tsubame-guest: workload=kv", "tsb ops=1 pass=2 junk"]:
        assert parse_progress(bad) is None, bad
    assert progress_points([(1.0, "tsb ops=5 pass=0 rd=1"), (2.0, "noise"), (3.0, "tsb ops=9 pass=1")]) == [
        (1.0, 5), (3.0, 9)]


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
