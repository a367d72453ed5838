"""Tests of the benchmark case files (bench/cases/*.toml) and the units they are written in: each case file
parses, names QEMU's best modes the same way, and gives settings both VMMs can honour.

    python3 -m pytest bench/test_case_files.py
"""
import os
import shutil
import time

import pytest

import compare
import tsubame_bench
from tsubame_bench.cases import guest_cmdline, load_case_file
from tsubame_bench import qmp, runner, units

HERE = os.path.dirname(os.path.abspath(__file__))



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
    cases, configs = load_case_file(os.path.join(HERE, "cases", "smoke.toml"))
    (case,) = cases
    assert (case.workload, case.memory, case.link, case.repetitions) == ("kv", "512M", "1gbit", 1)
    assert {"qemu-default", "tsubame-auto"} <= set(case.configs)
    assert case.bandwidth_bits() == 1_000_000_000
    assert guest_cmdline(case, 2599998) == "workload=kv wss=64M tsc_khz=2599998"


QEMU_BEST_MODES = ["qemu-default", "qemu-xbzrle", "qemu-multifd4", "qemu-multifd4-zstd", "qemu-auto-converge",
                   "qemu-dirty-limit", "qemu-postcopy-preempt-after1", "qemu-postcopy-preempt-now"]
CASE_FILES = ["smoke.toml", "paper.toml", "postcopy.toml", "autoconverge.toml", "idle.toml"]


def test_every_case_file_has_qemu_best_modes():
    """The same eight QEMU configurations, alike, in every case file: the best QEMU of a figure is chosen among
    them, so a file with fewer (or a mode set up differently) would compare with a weaker QEMU."""
    expected = load_case_file(os.path.join(HERE, "cases", "smoke.toml"))[1]
    for name in CASE_FILES:
        cases, configs = load_case_file(os.path.join(HERE, "cases", name))
        qemu = [n for n, c in configs.items() if c.vmm == "qemu"]
        assert qemu == QEMU_BEST_MODES, name
        assert all(configs[n] == expected[n] for n in qemu), name
        assert all(set(QEMU_BEST_MODES) <= set(c.configs) and "tsubame-auto" in c.configs for c in cases), name
    c = expected
    assert c["qemu-default"].capabilities == [] and c["qemu-default"].parameters == {}
    assert c["qemu-multifd4"].parameters == {"multifd-channels": 4}
    assert c["qemu-multifd4-zstd"].parameters == {"multifd-channels": 4, "multifd-compression": "zstd"}
    assert c["qemu-auto-converge"].capabilities == ["auto-converge"]
    assert c["qemu-dirty-limit"].accel == "kvm,dirty-ring-size=4096"
    assert c["qemu-dirty-limit"].parameters == {"x-vcpu-dirty-limit-period": 1000, "vcpu-dirty-limit": 50}
    for name, after in (("qemu-postcopy-preempt-after1", (1, None)), ("qemu-postcopy-preempt-now", (None, 0))):
        assert c[name].capabilities == ["postcopy-preempt"] and not any("multifd" in k for k in c[name].parameters)
        assert (c[name].postcopy_after_passes, c[name].postcopy_after_s) == after


def test_accel_option(tmp_path):
    cases, configs = load_case_file(os.path.join(HERE, "cases", "smoke.toml"))
    env = runner.Env(tsubame="tsubame", qemu="qemu-system-x86_64", guest_elf="g.elf", tsc_khz=1, sock_dir="/s",
                      log_dir="/l")
    ring = runner.qemu_command(env, cases[0], configs["qemu-dirty-limit"], "src", False)
    assert ring[ring.index("-accel") + 1] == "kvm,dirty-ring-size=4096" and "-enable-kvm" not in ring
    plain = runner.qemu_command(env, cases[0], configs["qemu-default"], "src", False)
    assert "-enable-kvm" in plain and "-accel" not in plain
    path = tmp_path / "c.toml"
    for line in ('t = { vmm = "tsubame", accel = "kvm,dirty-ring-size=4096" }',
                 'q = { vmm = "qemu", accel = "tcg" }'):
        path.write_text(f'[configs]\n{line}\n[[case]]\nname = "x"\nworkload = "idle"\nmemory = "64M"\n')
        with pytest.raises(tsubame_bench.HarnessError, match="accel is QEMU's -accel option"):
            load_case_file(str(path))


def test_skipped_qemu_configs(monkeypatch, capsys):
    """A configuration whose -accel the host's KVM refuses, or that needs a capability the QEMU lacks (a 7.2
    given with --qemu), is skipped with one line each; a QEMU that does not start under plain KVM is an error."""
    _, configs = load_case_file(os.path.join(HERE, "cases", "smoke.toml"))
    caps_10 = {"xbzrle", "multifd", "auto-converge", "dirty-limit", "postcopy-ram", "postcopy-preempt"}
    probes = []

    def refused_ring(qemu, accel=None):
        probes.append(accel)
        if accel:
            return None, "qemu-system-x86_64: -accel kvm,dirty-ring-size=4096: KVM dirty ring not supported"
        return caps_10, None
    monkeypatch.setattr(compare, "probe_qemu", refused_ring)
    version_10 = "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)"
    skipped = compare.qemu_configs_to_skip("qemu-system-x86_64", version_10, list(configs.values()) * 2)
    assert list(skipped) == ["qemu-dirty-limit"]
    assert sorted(probes, key=str) == [None, "kvm,dirty-ring-size=4096"]  # each -accel once
    assert capsys.readouterr().err.splitlines() == [
        "compare: skipping qemu-dirty-limit: this host refuses -accel kvm,dirty-ring-size=4096: "
        "qemu-system-x86_64: -accel kvm,dirty-ring-size=4096: KVM dirty ring not supported"]
    # QEMU 7.2 takes the dirty ring but has no dirty-limit (QEMU 8.1 added it)
    monkeypatch.setattr(compare, "probe_qemu", lambda qemu, accel=None: (caps_10 - {"dirty-limit"}, None))
    version = "QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)"
    skipped = compare.qemu_configs_to_skip("qemu-7.2", version, list(configs.values()))
    assert list(skipped) == ["qemu-dirty-limit"]
    assert capsys.readouterr().err.splitlines() == [
        "compare: skipping qemu-dirty-limit: QEMU 7.2.19 (qemu-7.2) offers no migration capability dirty-limit"]
    monkeypatch.setattr(compare, "probe_qemu", lambda qemu, accel=None: (None, "could not access KVM kernel module"))
    with pytest.raises(tsubame_bench.HarnessError, match="does not start under KVM"):
        compare.qemu_configs_to_skip("qemu", version, [configs["qemu-default"]])


QEMU_RUNS = shutil.which("qemu-system-x86_64") is not None and os.access("/dev/kvm", os.R_OK | os.W_OK)


@pytest.mark.skipif(not QEMU_RUNS, reason="needs qemu-system-x86_64 and /dev/kvm")
def test_probe_this_qemu():
    line = qmp.qemu_version_line("qemu-system-x86_64")
    assert line.startswith("QEMU emulator version ") and qmp.qemu_version_label(line).startswith("QEMU ")
    offered, error = qmp.probe_qemu("qemu-system-x86_64")
    assert error is None and {"xbzrle", "multifd", "auto-converge", "postcopy-ram"} <= offered
    offered, error = qmp.probe_qemu("qemu-system-x86_64", "kvm,dirty-ring-size=3")
    assert offered is None and "dirty-ring-size" in error


def test_version_label():
    assert qmp.qemu_version_label("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)") \
        == "QEMU 10.0.2"
    assert qmp.qemu_version_label(None) == "QEMU (version unknown)"
    assert qmp.qemu_version_label("qemu, some build") == "QEMU (version unknown)"
    with pytest.raises(tsubame_bench.HarnessError, match="printed no QEMU version"):
        qmp.qemu_version_line("true")


def test_paper_case_file():
    cases, configs = load_case_file(os.path.join(HERE, "cases", "paper.toml"))
    assert set(QEMU_BEST_MODES) | {"tsubame-auto"} <= set(configs)
    assert configs["qemu-xbzrle"].parameters["xbzrle-cache-size"] == 512 * 2**20
    assert configs["qemu-multifd4-zstd"].capabilities == ["multifd"]
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
    cases, configs = load_case_file(str(path))
    assert configs["tsubame-zstd"].args == ["--codec", "zstd"]
    assert cases[0].configs == ["tsubame-zstd", "qemu-default"]  # default: every config, in file order
    assert cases[0].link_bits() is None and cases[0].bandwidth_bits() is None  # loopback: unlimited
    caps, params = runner.qemu_migration_settings(cases[0], configs["qemu-default"])
    assert caps == [] and params["max-bandwidth"] == 10**12 and params["downtime-limit"] == 300


def test_bad_case_files(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[configs]\nq = { vmm = "qemu" }\n[[case]]\nname = "x"\nworkload = "kv"\nmemory = "64M"\n'
                    'configs = ["nope"]\n')
    with pytest.raises(tsubame_bench.HarnessError, match="config 'nope' is not defined"):
        load_case_file(str(path))
    path.write_text('[configs]\nq = { vmm = "xen" }\n')
    with pytest.raises(tsubame_bench.HarnessError, match="vmm"):
        load_case_file(str(path))
    path.write_text('[configs]\nt = { vmm = "tsubame", postcopy_after_passes = 1 }\n'
                    '[[case]]\nname = "x"\nworkload = "idle"\nmemory = "64M"\n')
    with pytest.raises(tsubame_bench.HarnessError, match="postcopy_after_\\* is for QEMU"):
        load_case_file(str(path))


def test_postcopy_case_file():
    cases, configs = load_case_file(os.path.join(HERE, "cases", "postcopy.toml"))
    workloads = {(c.workload, c.memory, c.link, tuple(c.args.items())) for c in cases}
    assert {("fill-random", "4G", "1gbit", (("wss", "3000M"),)),
            ("sparse", "1G", "1gbit", (("wss", "768M"), ("rate", "40")))} <= workloads
    qemu = configs["qemu-postcopy-preempt-after1"]
    assert qemu.qemu_postcopy() and qemu.postcopy_after_passes == 1
    caps, _ = runner.qemu_migration_settings(cases[0], qemu)
    assert caps == [{"capability": "postcopy-preempt", "state": True}, {"capability": "postcopy-ram", "state": True}]
    assert configs["tsubame-auto"].args == []  # the default is --postcopy auto
    assert configs["tsubame-postcopy-after1"].args == ["--postcopy", "after=1"]
    # the switch: after the first pass is done (dirty-sync-count 2), or at once
    t0 = time.monotonic()
    assert not runner.qemu_postcopy_due(qemu, {"ram": {"dirty-sync-count": 1}}, t0)
    assert runner.qemu_postcopy_due(qemu, {"ram": {"dirty-sync-count": 2}}, t0)
    assert runner.qemu_postcopy_due(configs["qemu-postcopy-preempt-now"], {}, t0)


def test_qemu_settings_of_a_link_case():
    cases, configs = load_case_file(os.path.join(HERE, "cases", "paper.toml"))
    case = next(c for c in cases if c.link == "10gbit")
    caps, params = runner.qemu_migration_settings(case, configs["qemu-multifd4-zstd"])
    assert caps == [{"capability": "multifd", "state": True}]
    assert params == {"max-bandwidth": 1_250_000_000, "downtime-limit": 300, "multifd-channels": 4,
                      "multifd-compression": "zstd"}


def test_big_cases_give_a_wss_that_fits_both_vmms():
    # QEMU splits a 4 GiB guest's RAM at the PCI hole: its largest range is 3070 MiB.
    for name in ("paper.toml", "postcopy.toml"):
        cases, _ = load_case_file(os.path.join(HERE, "cases", name))
        for case in cases:
            if units.parse_size(case.memory) > 3 * 2**30 and case.workload != "idle":
                assert units.parse_size(case.args["wss"]) <= 3070 * 2**20, case.name
