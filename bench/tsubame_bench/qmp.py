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
        self.events = []  # every event read so far (they arrive between replies), oldest first
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
                self.events.append(reply)
                continue
            if "error" in reply:
                raise HarnessError(f"{self.name}: QMP {command} failed: {reply['error'].get('desc')}")
            return reply.get("return")

    def event_times(self, name):
        """Unix times (s) of the events of this name read so far, oldest first (QEMU stamps them with
        the host's CLOCK_REALTIME, as tsubame stamps its vCPU's stop and resume)."""
        return [event_unix_s(e) for e in self.events if e.get("event") == name]

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


def event_unix_s(event):
    """A QMP event's `timestamp` ({seconds, microseconds}) in Unix seconds."""
    stamp = event["timestamp"]
    return stamp["seconds"] + stamp["microseconds"] / 1e6


def stop_resume_ms(stopped_at_s, resumed_at_s):
    """A VMM's downtime from its own events: source vCPU stop -> destination vCPU resume, in ms (Unix
    seconds of one host clock in); None when either is missing or the resume is not after the stop."""
    if not stopped_at_s or not resumed_at_s or resumed_at_s < stopped_at_s:
        return None
    return (resumed_at_s - stopped_at_s) * 1e3
