"""A minimal QMP client (QEMU's JSON control protocol), the figures
of QEMU's final `query-migrate` reply, QEMU's version line and a probe of
what a QEMU binary offers for migration."""
import json
import re
import subprocess

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
        try:
            line = self.reader.readline()
        except OSError as e:  # reset by a QEMU that exits as it starts (e.g. no BIOS), or timed out
            raise HarnessError(f"{self.name}: QMP connection lost ({e}): QEMU exited?") from None
        if not line:
            raise HarnessError(f"{self.name}: QMP connection closed (QEMU exited?)")
        return json.loads(line)

    def execute(self, command, **arguments):
        msg = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError as e:
            raise HarnessError(f"{self.name}: QMP connection lost ({e}): QEMU exited?") from None
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
    """The figures of a final `query-migrate` reply (the same fields in QEMU 7.2 and 10)."""
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


VERSION_RE = re.compile(r"^QEMU emulator version (\d+(?:\.\d+)*)")


def qemu_version_line(qemu):
    """The first line of `QEMU --version` of this binary, e.g. "QEMU emulator version 10.0.2
    (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)". Raises HarnessError when it prints none."""
    try:
        p = subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HarnessError(f"{qemu} --version: {e}") from None
    lines = [line.strip() for line in p.stdout.splitlines() if line.strip()]
    if p.returncode != 0 or not lines or not VERSION_RE.match(lines[0]):
        raise HarnessError(f"{qemu} --version printed no QEMU version (exit {p.returncode}): "
                           f"{(lines[0] if lines else p.stderr.strip()) or 'nothing'}")
    return lines[0]


def qemu_version_label(line):
    """"QEMU 10.0.2" from a version line; "QEMU (version unknown)" for None (a run recorded without it)
    or a line that names no version."""
    m = VERSION_RE.match(line or "")
    return f"QEMU {m.group(1)}" if m else "QEMU (version unknown)"


def probe_qemu(qemu, accel=None, timeout_s=60):
    """Starts this QEMU without a machine (`-M none`) under `-accel ACCEL` (default kvm), asks QMP for its
    migration capabilities and quits. -> (set of capability names, None), or (None, QEMU's first error
    line) when QEMU refused to start, e.g. a KVM without the dirty ring under "kvm,dirty-ring-size=4096"
    (KVM is set up as the accelerator starts, machine or not)."""
    cmd = [qemu, "-accel", accel or "kvm", "-M", "none", "-display", "none", "-nodefaults", "-qmp", "stdio"]
    requests = "".join(json.dumps({"execute": c}) + "\n"
                       for c in ("qmp_capabilities", "query-migrate-capabilities", "quit"))
    try:
        p = subprocess.run(cmd, input=requests, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    for line in p.stdout.splitlines():
        try:
            reply = json.loads(line)
        except ValueError:
            continue
        if isinstance(reply, dict) and isinstance(reply.get("return"), list):
            return {c["capability"] for c in reply["return"]}, None
    errors = [line.strip() for line in p.stderr.splitlines() if line.strip()]
    return None, errors[0] if errors else f"exit status {p.returncode}, no QMP reply"

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
