"""One memory budget for a VM's process: a v1 memory cgroup with the
kernel's OOM killer left on, and the swap it may use (a file on the local
disk, or zram), with the host's own swap put back afterwards.

Why the OOM killer stays on: with `memory.oom_control` = 1 a cgroup at its
limit cannot hand the kernel a page even for the kernel's own writes to the
process (the rseq area it updates on every return to user space), and the
kernel answers that with SIGSEGV (traced: `force_sigsegv` from
`exit_to_user_mode_loop`, si_code SI_KERNEL); the VMM then looks as if it
crashed. With the killer on, the same shortage ends in an OOM kill that the
cgroup counts and the harness can name.
"""

import os
import subprocess
import time

CGROUP_ROOT = "/sys/fs/cgroup/memory"
ZRAM = "/dev/zram0"


class MemLimitError(Exception):
    pass


def _sh(*cmd):
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise MemLimitError(f"{' '.join(cmd)}: {p.stderr.strip()}")


def _write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


def active_swaps():
    """The host's swap areas in use now: (path, priority) each."""
    with open("/proc/swaps") as f:
        return [(line.split()[0], int(line.split()[4])) for line in f.readlines()[1:] if line.strip()]


class HostSwap:
    """Takes the host's swap areas offline for the measurement, so the
    one the harness adds is the only swap, and puts them back (same
    priority) on `restore`."""

    def __init__(self):
        self.saved = active_swaps()
        if any(path == ZRAM for path, _ in self.saved):
            raise MemLimitError(f"{ZRAM} is this host's swap: the zram configurations would reset it; "
                                "use another host or turn it off first")
        for path, _ in self.saved:
            _sh("swapoff", path)

    def restore(self):
        for path, _ in active_swaps():
            subprocess.run(["swapoff", path], stderr=subprocess.DEVNULL)
        for path, prio in self.saved:
            subprocess.run(["swapon", "-p", str(prio), path] if prio >= 0 else ["swapon", path],
                           stderr=subprocess.DEVNULL)


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


class HostThp:
    """Sets transparent huge pages host-wide for the measurement (QEMU asks
    for them on guest memory and tsubame's harness runs pass
    --no-hugepages: `never` makes both VMMs swap 4 KiB pages) and puts the
    host's setting back on `restore`."""

    def __init__(self, mode):
        with open(THP) as f:
            self.saved = f.read().split("[")[1].split("]")[0]
        _write(THP, mode)

    def restore(self):
        _write(THP, self.saved)


class Swap:
    """A swap file on the local disk (`disk`) or zram (`zram`), sized to
    hold all of guest memory; the only swap while it lives."""

    def __init__(self, kind, size_bytes, work):
        self.kind = kind
        if kind == "disk":
            self.path = os.path.join(work, "swapfile")
            _sh("fallocate", "-l", str(size_bytes), self.path)
            os.chmod(self.path, 0o600)
        elif kind == "zram":
            if not os.path.exists("/sys/block/zram0"):
                raise MemLimitError("no zram0 device (modprobe zram)")
            self.path = ZRAM
            subprocess.run(["swapoff", self.path], stderr=subprocess.DEVNULL)
            _write("/sys/block/zram0/reset", 1)
            _write("/sys/block/zram0/disksize", size_bytes)
        else:
            raise MemLimitError(f"unknown swap kind {kind}")
        _sh("mkswap", self.path)
        _sh("swapon", self.path)

    def used_bytes(self):
        with open("/proc/swaps") as f:
            for line in f.readlines()[1:]:
                if line.split()[0] == self.path:
                    return int(line.split()[3]) * 1024
        return 0

    def stop(self):
        subprocess.run(["swapoff", self.path], stderr=subprocess.DEVNULL)
        if self.kind == "disk":
            os.unlink(self.path)
        else:
            _write("/sys/block/zram0/reset", 1)


class Cgroup:
    """A v1 memory cgroup with a limit (None: no limit, to measure what a
    process uses) and a stated swappiness; processes join it by pid."""

    def __init__(self, name, limit_bytes, swappiness=60):
        if not os.path.isdir(CGROUP_ROOT):
            raise MemLimitError(f"{CGROUP_ROOT} is missing: a v1 memory cgroup is needed")
        self.path = os.path.join(CGROUP_ROOT, f"tsb-{name}-{os.getpid()}")
        os.makedirs(self.path, exist_ok=True)
        if limit_bytes is not None:
            _write(os.path.join(self.path, "memory.limit_in_bytes"), limit_bytes)
        _write(os.path.join(self.path, "memory.swappiness"), swappiness)

    def command(self, cmd):
        # The shell joins the cgroup, then becomes the command.
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"] + cmd

    def _read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def max_usage(self):
        return int(self._read("memory.max_usage_in_bytes"))

    def oom_kills(self):
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def stat(self, key):
        for line in self._read("memory.stat").splitlines():
            name, value = line.split()
            if name == key:
                return int(value)
        return 0

    def why_stalled(self, swap_peak):
        """One line on what the cgroup saw, for a run that made no progress."""
        if self.oom_kills():
            return (f"the kernel's OOM killer ended the VM ({self.oom_kills()} kill(s)): the cgroup could not "
                    f"reclaim enough at its limit (at most {swap_peak >> 20} MiB had gone to swap)")
        return (f"{self.stat('rss') >> 20} MiB resident at the limit, at most {swap_peak >> 20} MiB in swap: "
                f"reclaim made no progress")

    def stop(self):
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)
