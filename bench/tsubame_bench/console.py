"""The guest's console lines (guest/README.md): progress lines
`tsb ops=<u64> pass=<u64> gap_us=<u64>` (the guest's own largest stall
since its previous line; disk workloads append more `key=value` fields),
its banner and its error lines; and the figures read off their timeline. Pure functions, tested in bench/test_bench_lib.py and
bench/test_compare.py."""
import re
import threading
import time

PROGRESS_RE = re.compile(r"^tsb ops=(\d+) pass=(\d+)(?:\s+\w+=\S+)*\s*$")
GUEST_ERROR_RE = re.compile(r"^tsubame-guest: (error|exception)")
TSC_KHZ_RE = re.compile(r"tsc_khz=(\d+)")


def parse_progress(text):
    """A progress line -> {"ops": int, "pass": int, and any further key=value fields as ints}; None otherwise."""
    m = PROGRESS_RE.match(text.strip())
    if not m:
        return None
    fields = {"ops": int(m.group(1)), "pass": int(m.group(2))}
    for token in text.split()[3:]:
        key, _, value = token.partition("=")
        fields[key] = int(value) if value.isdigit() else value
    return fields


def progress_points(lines):
    """[(t, text)] -> [(t, ops)] for the guest's `tsb ops=N pass=M` lines."""
    points = []
    for t, text in lines:
        fields = parse_progress(text)
        if fields:
            points.append((t, fields["ops"]))
    return points


def guest_errors(lines):
    """The guest's error and exception lines."""
    return [text.strip() for _, text in lines if GUEST_ERROR_RE.match(text.strip())]


def ops_rate(points, t0, t1):
    """Ops per second over the progress points with t0 <= t <= t1 (None if fewer than two)."""
    inside = [(t, ops) for t, ops in points if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def ops_done_rate(src, dst, t0, t1, counted_from=None):
    """Ops per second the guest completed between t0 and t1, wherever it ran: the last count
    either copy printed by t1 minus the last printed by t0. A guest that printed nothing in
    between made (almost) no progress and counts as 0; None when nothing was printed by t0.
    With `counted_from` only what was printed after it counts, still over the whole window:
    the first line after a switch carries what the guest did before its last line there."""
    def count_by(t):
        seen = [ops for when, ops in list(src) + list(dst) if when <= t]
        return max(seen) if seen else None
    start = t0 if counted_from is None else min(max(counted_from, t0), t1)
    first, last = count_by(start), count_by(t1)
    if first is None or last is None or t1 <= t0:
        return None
    return (last - first) / (t1 - t0)


def max_gap_ms(points, t0, t1):
    """Largest gap between consecutive progress points inside [t0, t1], in ms (None if fewer than two)."""
    times = [t for t, _ in points if t0 <= t <= t1]
    if len(times) < 2:
        return None
    return max(b - a for a, b in zip(times, times[1:])) * 1e3


def switchover(src_points, dst_points, t_start):
    """Guest-observed downtime around the switch-over.

    Returns (last source progress time, first destination progress time, gap in ms):
    the last source line at or after migration start and the first destination
    line after it. (None, None, None) if either side has no line."""
    src = [t for t, _ in src_points if t >= t_start]
    if not src or not dst_points:
        return None, None, None
    t_src_last = src[-1]
    dst = [t for t, _ in dst_points if t >= t_src_last]
    if not dst:
        return t_src_last, None, None
    return t_src_last, dst[0], (dst[0] - t_src_last) * 1e3


def guest_downtime_ms(src_points, dst_points, t_src_last, t_dst_first, around_s=1.0):
    """Largest gap between consecutive progress lines around the switch-over, in ms.

    The source's lines up to its last one, then the destination's lines, taken within around_s
    before the source's last line and after the destination's first line; so a stall just before
    the pause or just after the resume counts too. At least the switch-over gap itself."""
    if t_src_last is None or t_dst_first is None:
        return None
    times = [t for t, _ in src_points if t_src_last - around_s <= t <= t_src_last]
    times += [t for t, _ in dst_points if t_dst_first <= t <= t_dst_first + around_s]
    return max(b - a for a, b in zip(times, times[1:])) * 1e3


def stall_ms(text):
    """The guest's own largest stall since its previous progress line (`gap_us`), in ms; None for any
    other line, or a guest too old to report it."""
    fields = parse_progress(text)
    gap = fields.get("gap_us") if fields else None
    return gap / 1e3 if isinstance(gap, int) else None


def guest_stall(src_lines, dst_lines, t_start, t_src_end, t_dst_end):
    """The guest-measured downtime: the largest stall the guest itself reported (`gap_us`, timed by its
    TSC) in the source's lines from migration start to t_src_end and the destination's up to t_dst_end.

    A stop lands in the gap that ends at the guest's first checkpoint after it ran again, so the
    destination's first line carries the switch-over. [(t, text)] logs -> (ms, "source" or
    "destination", t of the line that reported it); (None, None, None) without such lines."""
    best = (None, None, None)
    for side, lines, t_end in (("source", src_lines, t_src_end), ("destination", dst_lines, t_dst_end)):
        for t, text in lines:
            gap = stall_ms(text) if t_start <= t <= t_end else None
            if gap is not None and (best[0] is None or gap > best[0]):
                best = (gap, side, t)
    return best


def ops_continuous(src_points, dst_points):
    """True when the destination's ops counter carries on from the source's (the guest's state moved)."""
    if not src_points or not dst_points:
        return False
    return dst_points[0][1] >= src_points[-1][1]




class LineLog:
    """Lines of text with the harness's time.monotonic() of arrival; filled by a reader thread."""

    def __init__(self):
        self.lines = []
        self.lock = threading.Lock()

    def add(self, text):
        t = time.monotonic()
        with self.lock:
            self.lines.append((t, text.rstrip("\r\n")))

    def snapshot(self):
        with self.lock:
            return list(self.lines)

    def follow(self, stream):
        """Reads a binary stream line by line until EOF (run in a thread)."""
        def loop():
            try:
                for raw in iter(stream.readline, b""):
                    self.add(raw.decode("utf-8", "replace"))
            except (OSError, ValueError):
                pass
        threading.Thread(target=loop, daemon=True).start()
