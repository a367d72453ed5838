#!/usr/bin/env python3
"""Pages of every guest workload, for the GPU check's byte-identity test.

Boots each workload in a small VM (needs /dev/kvm), lets it run, and saves
its memory twice, half a second apart, with the control socket's
`pmemsave`. From the first save it keeps up to --pages non-zero pages
spread over the memory, and some zero pages; the second save gives the same
pages as the guest rewrote them (XBZRLE's and dedup's cache hits). Each
workload becomes DIR/WORKLOAD.pages.xz: records of (index u64 LE, 4096
bytes), the first save's pages, then the same indices from the second.

usage: sample_pages.py TSUBAME DIR [--pages N] [--memory SIZE]
"""

import argparse
import lzma
import os
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tsubame_bench.control import control_request  # noqa: E402

PAGE = 4096
WORKLOADS = ["kv", "bwmem", "sparse", "fill-random", "zero-clear", "stream", "fill-zero", "idle"]


def ask(path, request):
    """One request on tsubame's own control form; fails on an error reply."""
    reply = control_request(path, request, timeout_s=60)
    if not reply.get("ok"):
        raise RuntimeError(f"{request['cmd']}: {reply.get('error')}")
    return reply


def save(tsubame, workload, memory, tmp):
    """Two saves of the guest memory of `workload`, 0.5 s apart."""
    control = os.path.join(tmp, f"{workload}.sock")
    vm = subprocess.Popen(
        [tsubame, "run", "--quiet", "--memory", str(memory), "--workload", workload, "--control", control],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(control):
            if vm.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{workload}: the VM did not start: {vm.stderr.read().decode()[-500:]}")
            time.sleep(0.05)
        time.sleep(2.0)  # the workload fills its working set
        saves = []
        for n in range(2):
            path = os.path.join(tmp, f"{workload}.{n}")
            ask(control, {"cmd": "pmemsave", "val": 0, "size": memory, "filename": path})
            saves.append(path)
            time.sleep(0.5)
        ask(control, {"cmd": "quit"})
        vm.wait(timeout=30)
        return saves
    finally:
        if vm.poll() is None:
            vm.kill()
            vm.wait()


def sample(first, second, pages):
    """Indices of up to `pages` non-zero pages spread over memory, plus zeros."""
    with open(first, "rb") as f:
        data = f.read()
    zero = bytes(PAGE)
    total = len(data) // PAGE
    nonzero = [i for i in range(total) if data[i * PAGE : (i + 1) * PAGE] != zero]
    step = max(1, len(nonzero) // pages)
    chosen = nonzero[::step][:pages]
    zeros = [i for i in range(0, total, 97) if data[i * PAGE : (i + 1) * PAGE] == zero][: max(8, pages // 8)]
    indices = sorted(set(chosen) | set(zeros))
    out = bytearray()
    for path in (first, second):
        with open(path, "rb") as f:
            mem = f.read()
        for i in indices:
            out += struct.pack("<Q", i) + mem[i * PAGE : (i + 1) * PAGE]
    return bytes(out), len(chosen), len(zeros)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tsubame")
    p.add_argument("dir")
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--memory", type=int, default=128 << 20)
    args = p.parse_args()
    if not os.path.exists("/dev/kvm"):
        sys.exit("sample_pages: no /dev/kvm: the workloads' pages are recorded from a running VM")
    os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for workload in WORKLOADS:
            first, second = save(args.tsubame, workload, args.memory, tmp)
            records, nonzero, zeros = sample(first, second, args.pages)
            os.remove(first)
            os.remove(second)
            path = os.path.join(args.dir, f"{workload}.pages.xz")
            with lzma.open(path, "wb", preset=6) as f:
                f.write(records)
            print(f"sample_pages: {workload}: {nonzero} non-zero + {zeros} zero pages, twice: {os.path.getsize(path) >> 10} KiB")


if __name__ == "__main__":
    main()
