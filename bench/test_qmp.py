"""tsubame's control socket spoken as QMP, by QEMU's own client library.

test_migrate_with_qemu_qmp: `tsubame run --control` and `tsubame receive
--control`, each driven through qemu.qmp.QMPClient (the library sends
qmp_capabilities itself): query-status at the source, migrate to a unix:
uri, the MIGRATION events up to `completed`, and query-status at the
destination says the VM runs there.

test_bad_lines_get_one_error_each: a raw socket, in both of the socket's
forms (QMP and tsubame's {"cmd":...}): an oversized line, bad JSON, an
unknown command, missing and wrong-typed arguments each get exactly one
error, and a good request still works after each.

    python3 -m pytest -q bench/test_qmp.py      # a few seconds

Needs /dev/kvm (read-write) and target/release/tsubame (`cargo xtask
test` builds it); qemu.qmp comes from bench/requirements.txt
(scripts/setup.sh installs it). Without them the tests are skipped.
"""
import asyncio
import json
import os
import socket
import subprocess
import time

import pytest

from tsubame_bench.testing import TSUBAME, needs_kvm as needs

needs_kvm = needs("the QMP tests boot VMs")

VM = ["--memory", "64M", "--workload", "kv", "--workload-arg", "wss=24M"]
MAX_REQUEST = 64 * 1024


class Procs:
    """Processes started by a test, stopped (SIGTERM, then SIGKILL) at its end."""

    def __init__(self, tmp_path):
        self.tmp = str(tmp_path)
        self.procs = []

    def start(self, name, *args):
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        proc = subprocess.Popen([TSUBAME, *args], stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append((name, proc))
        return proc

    def log(self, name):
        with open(os.path.join(self.tmp, f"{name}.log"), errors="replace") as f:
            return f.read()

    def stop(self):
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.stop()


def wait_for_socket(path, proc, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, f"exited with {proc.returncode} before {path} appeared"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@needs_kvm
def test_migrate_with_qemu_qmp(procs, tmp_path):
    qmp = pytest.importorskip("qemu.qmp", reason="qemu.qmp missing: pip install -r bench/requirements.txt")
    src_ctl, dst_ctl, incoming = (str(tmp_path / n) for n in ("src.sock", "dst.sock", "incoming.sock"))
    src = procs.start("src", "run", "--quiet", "--control", src_ctl, *VM)
    dst = procs.start("dst", "receive", "--quiet", "--listen", f"unix:{incoming}", "--control", dst_ctl)
    wait_for_socket(src_ctl, src)
    wait_for_socket(dst_ctl, dst)

    async def migrate():
        source, dest = qmp.QMPClient("tsubame-src"), qmp.QMPClient("tsubame-dst")
        await source.connect(src_ctl)  # greeting, then qmp_capabilities
        await dest.connect(dst_ctl)
        assert source.greeting.QMP.version["package"].startswith("tsubame ")
        assert await source.execute("query-status") == {"running": True, "status": "running"}
        assert await dest.execute("query-status") == {"running": False, "status": "inmigrate"}
        dump = tmp_path / "low.bin"
        assert await source.execute("pmemsave", {"val": 4096, "size": 65536, "filename": str(dump)}) == {}
        assert dump.stat().st_size == 65536
        with pytest.raises(qmp.ExecuteError, match="outside the guest"):
            await source.execute("pmemsave", {"val": 1 << 40, "size": 4096, "filename": str(dump)})
        with source.listener("MIGRATION") as migration, dest.listener("RESUME") as resumed:
            assert await source.execute("migrate", {"uri": f"unix:{incoming}"}) == {}
            seen = []
            async for event in migration:
                seen.append(event["data"]["status"])
                assert event["timestamp"]["seconds"] > 0
                if seen[-1] in ("completed", "failed"):
                    break
            assert seen[0] == "setup" and seen[-1] == "completed", seen
            await asyncio.wait_for(resumed.get(), 10)
        status = await dest.execute("query-status")
        assert status == {"running": True, "status": "running"}, status
        await dest.execute("quit")
        await dest.disconnect()
        await source.disconnect()
        return seen

    seen = asyncio.run(asyncio.wait_for(migrate(), 60))
    # The source ends once its VM runs elsewhere, having said so.
    assert src.wait(timeout=10) == 0, procs.log("src")
    assert dst.wait(timeout=10) == 0, procs.log("dst")
    assert "migrated to" in procs.log("src"), (seen, procs.log("src"))


class Raw:
    """A raw connection: lines out, lines in."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.reader = self.sock.makefile("rb")
        self.greeting = self.read()

    def read(self):
        line = self.reader.readline()
        assert line, "the connection closed"
        return json.loads(line)

    def ask(self, line):
        self.sock.sendall(line if isinstance(line, bytes) else line.encode() + b"\n")
        return self.read()

    def close(self):
        self.reader.close()
        self.sock.close()


@needs_kvm
def test_bad_lines_get_one_error_each(procs, tmp_path):
    ctl = str(tmp_path / "vm.sock")
    vm = procs.start("vm", "run", "--quiet", "--control", ctl, *VM)
    wait_for_socket(ctl, vm)
    oversized = b'{"cmd":"stats","pad":"' + b"x" * (MAX_REQUEST + 100) + b'"}\n'
    for form in ("qmp", "cmd"):
        conn = Raw(ctl)
        assert "QMP" in conn.greeting and conn.greeting["QMP"]["capabilities"] == []
        if form == "qmp":
            good = '{"execute": "query-status", "id": "good"}'
            before = conn.ask('{"execute": "query-status", "id": 0}')
            assert before["error"]["class"] == "CommandNotFound" and before["id"] == 0, before
            assert conn.ask('{"execute": "qmp_capabilities"}') == {"return": {}}
            bad = [oversized, b"{not json\n", '{"execute": "dance", "id": 1}', '{"execute": "migrate", "id": 2}',
                   '{"execute": "migrate", "arguments": {"uri": 5}, "id": 3}',
                   '{"execute": "migrate-set-parameters", "arguments": {"downtime-limit": "soon"}}']
        else:
            good = '{"cmd": "query-status"}'
            bad = [oversized, b"{not json\n", '{"cmd": "dance"}', '{"cmd": "migrate"}',
                   '{"cmd": "migrate", "to": "unix:/nowhere", "channels": "two"}', '{"nocmd": 1}']
        for line in bad:
            reply = conn.ask(line)
            if form == "qmp":
                assert reply["error"]["class"] in ("GenericError", "CommandNotFound"), reply
                assert reply["error"]["desc"], reply
            else:
                assert reply["ok"] is False and reply["error"], reply
            # Exactly one reply to the bad line: the next one answers `good`.
            after = conn.ask(good)
            if form == "qmp":
                assert after == {"return": {"running": True, "status": "running"}, "id": "good"}, (line[:60], after)
            else:
                assert after == {"ok": True, "running": True, "status": "running"}, (line[:60], after)
        conn.close()
    conn = Raw(ctl)
    assert conn.ask('{"execute": "qmp_capabilities"}') == {"return": {}}
    deadline = time.monotonic() + 10
    while conn.ask('{"execute": "stats"}')["return"]["guest"]["ops"] == 0:  # a run that quits must have run
        assert time.monotonic() < deadline, "the guest never made progress"
        time.sleep(0.05)
    assert conn.ask('{"execute": "quit", "id": "q"}') == {"return": {}, "id": "q"}
    assert vm.wait(timeout=10) == 0, procs.log("vm")
