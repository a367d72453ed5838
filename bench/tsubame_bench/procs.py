"""Child processes in their own sessions, their logs, and their CPU time
from /proc."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

from . import HarnessError
from .console import LineLog

CLK_TCK = os.sysconf("SC_CLK_TCK")
VCPU_THREAD_RE = re.compile(r"^(CPU \d+/KVM|vcpu\d+)$")  # QEMU's and tsubame's vCPU thread names


def sh(*cmd, check=True):
    """Runs a short command; HarnessError with its stderr when it fails and check is set."""
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise HarnessError(f"`{' '.join(cmd)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Proc:
    """A child process in its own session; stdout followed into a LineLog, stderr into a log file."""

    def __init__(self, name, cmd, log_path, capture_stdout=False):
        self.name = name
        self.cmd = cmd
        self.out = LineLog()
        self.log_path = log_path
        self.log_file = open(log_path, "wb")
        self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE if capture_stdout else self.log_file,
                                      stderr=self.log_file, start_new_session=True)
        if capture_stdout:
            self.out.follow(self.popen.stdout)
        PROCESSES.append(self)

    @property
    def pid(self):
        return self.popen.pid

    def alive(self):
        return self.popen.poll() is None

    def stderr_tail(self, n=3):
        """The last lines of the process's stderr log, joined (for error messages)."""
        try:
            self.log_file.flush()
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").strip().splitlines()
            return " | ".join(lines[-n:])
        except OSError:
            return ""

    def wait(self, timeout):
        """Waits up to timeout seconds; True if the process has exited."""
        try:
            self.popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, grace_s=5):
        """SIGTERM to its process group, then SIGKILL after grace_s."""
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not self.wait(grace_s):
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.wait(5)
        if self.popen.stdout:
            self.popen.stdout.close()
        self.log_file.close()


PROCESSES = []  # every Proc started, so that cleanup can stop them all


def stop_process(p):
    """Stops one Proc and forgets it."""
    p.stop()
    if p in PROCESSES:
        PROCESSES.remove(p)


def stop_all_processes():
    while PROCESSES:
        p = PROCESSES.pop()
        try:
            p.stop(grace_s=3)
        except Exception as e:  # keep cleaning up the others
            print(f"compare: could not stop {p.name} (pid {p.pid}): {e}", file=sys.stderr)


def wait_until(done, proc, what, timeout_s, poll_s=0.02):
    """Polls done() until it returns true; HarnessError when proc exits first (with its stderr's tail)
    or timeout_s passes. what names the awaited event: "the guest printed progress"."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if not proc.alive():
            raise HarnessError(f"{proc.name} exited (status {proc.popen.returncode}) before {what}: "
                               f"{proc.stderr_tail()}")
        if time.monotonic() > deadline:
            raise HarnessError(f"{proc.name}: not {what} within {timeout_s:.0f} s")
        time.sleep(poll_s)


def wait_for_path(path, timeout_s, proc):
    """Waits until path exists; fails if proc dies first or the time runs out."""
    wait_until(lambda: os.path.exists(path), proc, f"it created {os.path.basename(path)}", timeout_s)


def connect_unix(path, timeout_s, proc):
    """A connected AF_UNIX stream socket to path, retrying until the server listens."""
    wait_for_path(path, timeout_s, proc)
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline or not proc.alive():
                raise HarnessError(f"cannot connect to {proc.name}'s socket {path}") from None
            time.sleep(0.05)




def follow_console_socket(path, proc):
    """A LineLog fed from QEMU's debugcon chardev socket."""
    sock = connect_unix(path, 10, proc)
    log = LineLog()
    log.follow(sock.makefile("rb"))
    return log




def parse_proc_stat(text):
    """/proc/PID[/task/TID]/stat -> (comm, utime+stime in clock ticks)."""
    head, _, rest = text.rpartition(")")
    comm = head.partition("(")[2]
    fields = rest.split()
    # fields[0] is state (field 3); utime and stime are fields 14 and 15
    return comm, int(fields[11]) + int(fields[12])




def read_cpu_ticks(pid):
    """(process utime+stime, {tid: (comm, ticks)}) in clock ticks, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            _, total = parse_proc_stat(f.read())
        threads = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    threads[int(tid)] = parse_proc_stat(f.read())
            except (OSError, IndexError, ValueError):
                pass  # the thread exited meanwhile
        return total, threads
    except (OSError, IndexError, ValueError):
        return None


class CpuSampler:
    """Samples a process's CPU ticks: the first sample is the baseline, each later one the latest value.

    The delta between them is the process's CPU-seconds over the window. A process that exits keeps
    its last sample (taken at most POLL_S before); a thread that exits keeps its last seen ticks (the
    vCPU thread of tsubame's source ends before the process does)."""

    def __init__(self, pid):
        self.pid = pid
        self.first = None  # (total ticks, {tid: (comm, ticks)})
        self.last_total = None
        self.threads = {}  # tid -> (comm, ticks) last seen

    def sample(self):
        s = read_cpu_ticks(self.pid)
        if s is None:
            return
        if self.first is None:
            self.first = s
        self.last_total = s[0]
        self.threads.update(s[1])

    def seconds(self):
        """(CPU-seconds of the process, CPU-seconds of its vCPU threads) over the window."""
        if self.first is None:
            return None, None
        total = (self.last_total - self.first[0]) / CLK_TCK
        vcpu = 0
        for tid, (comm, ticks) in self.threads.items():
            if VCPU_THREAD_RE.match(comm):
                base = self.first[1].get(tid, (comm, 0))[1]  # a thread born later started from zero
                vcpu += ticks - base
        return total, vcpu / CLK_TCK
