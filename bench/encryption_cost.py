#!/usr/bin/env python3
"""Issue 8's encryption cost: `tsubame demo` over loopback TCP, plain,
PSK and mutual TLS, run in turn (plain, psk, tls, plain, psk, tls, ...) so
that the machine's drift hits all alike; medians and ratios to plain.

    python3 bench/encryption_cost.py --memory 2G --rounds 3 [--channels 2]

Makes a PSK and a throw-away CA with openssl (needs the openssl command).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from tsubame_bench import HarnessError
from tsubame_bench.demo import run_demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TSUBAME = os.path.join(ROOT, "target", "release", "tsubame")


def make_keys(d):
    with open(os.path.join(d, "psk"), "wb") as f:
        f.write(os.urandom(32))
    ext = os.path.join(d, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run = lambda *a: subprocess.run(a, check=True, cwd=d, capture_output=True)
    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=tsubame bench CA")
    for name in ("node",):
        run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=localhost")
        run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", default="2G")
    ap.add_argument("--workload", default="kv")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--channels", type=int, default=1)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="tsubame-enc-")
    make_keys(d)
    modes = {
        "plain": [],
        "psk": ["--psk-file", os.path.join(d, "psk")],
        "tls": ["--tls-cert", os.path.join(d, "node.pem"), "--tls-key", os.path.join(d, "node.key"),
                "--tls-ca", os.path.join(d, "ca.pem")],
    }
    results = {m: [] for m in modes}
    base = ["--memory", args.memory, "--workload", args.workload, "--transport", "tcp",
            "--channels", str(args.channels), "--after", "1"]
    print("command:", TSUBAME, "demo", " ".join(base), "[--psk-file KEY | --tls-cert C --tls-key K --tls-ca CA]")
    for r in range(args.rounds):
        for mode, extra in modes.items():
            out = os.path.join(d, f"{mode}-{r}.json")
            try:
                s, _ = run_demo(TSUBAME, base + extra, out)
            except HarnessError as e:
                sys.exit(f"round {r} {mode}: {e}")
            row = (s["total_time_ms"], s["cpu_seconds"]["source"], s["cpu_seconds"]["destination"],
                   s["bytes_on_wire"], s["downtime_ms"])
            results[mode].append(row)
            print(f"round {r} {mode:5}: {row[0]:8.0f} ms, CPU-s source {row[1]:.2f} destination {row[2]:.2f}, "
                  f"{row[3] / 2**30:.2f} GiB, downtime {row[4]:.0f} ms", flush=True)
    med = {m: [statistics.median(col) for col in zip(*rows)] for m, rows in results.items()}
    print("\n| mode | total ms (median) | vs plain | source CPU-s | destination CPU-s | GiB on wire |")
    print("|---|---|---|---|---|---|")
    for m, (t, cs, cd, b, _) in med.items():
        print(f"| {m} | {t:.0f} | {t / med['plain'][0]:.2f}× | {cs:.2f} | {cd:.2f} | {b / 2**30:.2f} |")
    print("\nper-round ratios to the plain run of the same round:")
    for m in ("psk", "tls"):
        print(f"  {m}: " + ", ".join(f"{a[0] / p[0]:.2f}" for a, p in zip(results[m], results["plain"])))


if __name__ == "__main__":
    main()
