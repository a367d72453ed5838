"""The pure parts of bench/disk_warm.py (tsubame_bench.disk): throughput
read off progress lines."""
import pytest

from tsubame_bench import HarnessError, disk


def lines(side_points):
    return [(t, f"tsb ops={i} pass=0 rd={rd} wr=0") for i, (t, rd) in enumerate(side_points)]


def test_rates_and_the_switch_over():
    # 100 MB/s for 3 s at the source, a 0.5 s stop, then 50 MB/s at the destination.
    src = lines([(t / 10, int(t / 10 * 100e6)) for t in range(31)])
    dst = lines([(3.5 + t / 10, int(300e6 + t / 10 * 50e6)) for t in range(31)])
    f = disk.figures(src, dst)
    assert f["before_mbs"] == pytest.approx(100, rel=1e-3)
    assert f["after_mbs"] == pytest.approx(50, rel=1e-3)
    assert f["ratio"] == pytest.approx(0.5, rel=1e-3)
    assert f["gap_ms"] == pytest.approx(500)
    bins = dict(f["timeline"])
    assert bins[-1.0] == pytest.approx(100, rel=1e-3)
    assert bins[1.0] == pytest.approx(50, rel=1e-3)
    assert bins[0.0] == 0  # the stop: nothing read between the two sides' lines


def test_a_guest_without_disk_fields_is_an_error():
    with pytest.raises(HarnessError):
        disk.figures([(0, "tsb ops=1 pass=0")], [(1, "tsb ops=2 pass=0")])


def test_the_table_leads_with_migration_time_and_the_reads_after():
    from tsubame_bench.disk_report import table
    vm = {"before_mbs": 26.0, "after_mbs": 25.0, "ratio": 0.96, "gap_ms": 40, "total_time_s": 2.5,
          "warm_cache": {"blocks_sent": 12800}}
    slow = dict(vm, total_time_s=3.0, ratio=0.9)
    text = table([{"config": "tsubame-warm", "vms": 2, "storage_rate": "100MB", "per_vm": [vm, slow]}])
    assert text.splitlines()[0].startswith("| storage | VMs | config | migration s")
    assert "| 100MB | 2 | tsubame-warm | **3.00** | **0.90** | 26.0 | 25.0 | 50 | 40 |" in text
