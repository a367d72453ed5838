"""The network of a run: two network namespaces joined by a veth pair
with a `tbf` qdisc at the case's rate, or one namespace's loopback."""
import os
import re
import sys

from .procs import pid_alive, sh
from .units import tbf_burst_bytes

NS_NAME_RE = re.compile(r"^tsb-(\d+)-(src|dst|lo)$")
VETH_NAME_RE = re.compile(r"^tsb(\d+)[sd]$")


def remove_stale_namespaces():
    """Deletes tsb-<pid>-* namespaces and tsb<pid>s/d veths left by an earlier harness that is no longer running."""
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = NS_NAME_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            print(f"compare: removing stale namespace {name}", file=sys.stderr)
            sh("ip", "netns", "del", name, check=False)
    for line in sh("ip", "-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            dev = parts[1].strip().split("@")[0]
            m = VETH_NAME_RE.match(dev)
            if m and not pid_alive(int(m.group(1))):
                sh("ip", "link", "del", dev, check=False)


class Link:
    """The network of one run: two namespaces and a shaped veth pair, or one namespace's loopback."""

    def __init__(self, rate_bits):
        pid = os.getpid()
        self.rate_bits = rate_bits
        self.namespaces = []
        self.veths = []
        if rate_bits is None:
            self.src_ns = self.dst_ns = f"tsb-{pid}-lo"
            self.src_dev = "lo"
            self.dst_ip = "127.0.0.1"
        else:
            self.src_ns, self.dst_ns = f"tsb-{pid}-src", f"tsb-{pid}-dst"
            self.src_dev, self.dst_dev = f"tsb{pid}s", f"tsb{pid}d"
            self.src_ip, self.dst_ip = "10.201.0.1", "10.201.0.2"
        ACTIVE_LINKS.append(self)

    def setup(self):
        for ns in dict.fromkeys([self.src_ns, self.dst_ns]):
            sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if self.rate_bits is None:
            return
        sh("ip", "link", "add", self.src_dev, "type", "veth", "peer", "name", self.dst_dev)
        self.veths.append(self.src_dev)
        burst = tbf_burst_bytes(self.rate_bits)
        for dev, ns, ip in ((self.src_dev, self.src_ns, self.src_ip), (self.dst_dev, self.dst_ns, self.dst_ip)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", str(self.rate_bits), "burst", str(burst), "latency", "50ms")
        self.veths.clear()  # moved into the namespaces: deleting those deletes the pair

    def tx_bytes(self):
        """Bytes sent by the source side so far (veth or lo counter)."""
        out = sh("ip", "netns", "exec", self.src_ns, "cat", f"/sys/class/net/{self.src_dev}/statistics/tx_bytes")
        return int(out.strip())

    def netns_exec(self, ns):
        return ["ip", "netns", "exec", ns]

    def teardown(self):
        for dev in self.veths:
            sh("ip", "link", "del", dev, check=False)
        self.veths.clear()
        while self.namespaces:
            sh("ip", "netns", "del", self.namespaces.pop(), check=False)
        if self in ACTIVE_LINKS:
            ACTIVE_LINKS.remove(self)


ACTIVE_LINKS = []
