"""A minimal QMP client (QEMU's JSON control protocol) and the figures
of QEMU's final `query-migrate` reply."""
import json

from . import HarnessError
from .procs import connect_unix


class Qmp:
    """A minimal QMP client over a unix socket."""

    def __init__(self, path, proc, name):
        self.name = name
        self.sock = connect_unix(path, 10, proc)
        self.sock.settimeout(30)
        self.reader = self.sock.makefile("rb")
        greeting = self._read()
        if "QMP" not in greeting:
            raise HarnessError(f"{name}: unexpected QMP greeting {greeting}")
        self.execute("qmp_capabilities")

    def _read(self):
        line = self.reader.readline()
        if not line:
            raise HarnessError(f"{self.name}: QMP connection closed (QEMU exited?)")
        return json.loads(line)

    def execute(self, command, **arguments):
        msg = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._read()
            if "event" in reply:
                continue
            if "error" in reply:
                raise HarnessError(f"{self.name}: QMP {command} failed: {reply['error'].get('desc')}")
            return reply.get("return")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass




def qemu_figures(reply):
    """The figures of a final `query-migrate` reply (QEMU 7.2)."""
    ram = reply.get("ram", {})
    return {
        "status": reply.get("status"),
        "error": reply.get("error-desc"),
        "total_time_s": reply["total-time"] / 1e3 if "total-time" in reply else None,
        "vmm_downtime_ms": float(reply["downtime"]) if "downtime" in reply else None,
        "setup_time_ms": float(reply["setup-time"]) if "setup-time" in reply else None,
        "iterations": ram.get("dirty-sync-count"),
        "vmm_bytes": ram.get("transferred"),
    }
