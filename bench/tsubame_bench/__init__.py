"""The bench harness's shared parts: units, the guest's console lines,
processes, the shaped link, QEMU's QMP and tsubame's control socket, and
running `tsubame demo --json`. `compare.py` and the other scripts in
bench/ import from here (run them as `python3 bench/SCRIPT.py`)."""


class HarnessError(Exception):
    """A failure that ends a benchmark with a one-line message."""
