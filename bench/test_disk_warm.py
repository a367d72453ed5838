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
