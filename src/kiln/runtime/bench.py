"""Timing core shared by `kiln bench` and the peer comparisons in benchmarks/: torch-free, NumPy and stdlib only.

Why a harness rather than a loop: on a shared machine one contestant timed after another sees a different machine
(other processes, CPU frequency, a warm or cold cache). So every contestant gets its warm-up first, then the timed
runs go round-robin, one run of each contestant per round, starting each round at the next contestant, and the
numbers reported are medians. Peak memory is measured in separate, untimed runs, since tracing allocations slows
a run down.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Progress = Callable[[str], None]


@dataclass
class Contestant:
    """One thing to time: `fn` is timed; `setup`, if given, runs untimed before each call (e.g. reset a KV cache)."""

    name: str
    fn: Callable[[], object]
    setup: Callable[[], object] | None = None


@dataclass
class Stats:
    """The timings of one contestant, in seconds, and its peak memory in bytes (None where not measured)."""

    name: str
    times: list[float] = field(default_factory=list)
    traced_peak: int | None = None
    """Peak bytes that Python and NumPy allocated during one run (tracemalloc); blind to torch's and ORT's heaps."""
    rss_peak: int | None = None
    """Growth of the process's peak resident set over one run (Linux VmHWM, reset before it); covers every heap."""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)


def _call(c: Contestant) -> float:
    if c.setup is not None:
        c.setup()
    t0 = time.perf_counter()
    c.fn()
    return time.perf_counter() - t0


def run_interleaved(contestants: Sequence[Contestant], warmup: int = 3, repeat: int = 20,
                    progress: Progress | None = None, progress_every: float = 2.0) -> dict[str, Stats]:
    """Warm each contestant up, then time `repeat` runs of each, round-robin with a rotating start.

    progress: called with a line of text at most every `progress_every` seconds during long runs (None: silent).
    """
    if warmup < 0 or repeat < 1:
        raise ValueError(f"warmup must be >= 0 and repeat >= 1, got warmup={warmup} repeat={repeat}")
    names = [c.name for c in contestants]
    if len(set(names)) != len(names):
        raise ValueError(f"contestant names must be unique, got {names}")
    stats = {c.name: Stats(c.name) for c in contestants}
    start = last = time.perf_counter()
    total = (warmup + repeat) * len(contestants)
    done = 0

    def tick(phase: str) -> None:
        nonlocal last
        now = time.perf_counter()
        if progress is not None and now - last >= progress_every:
            last = now
            progress(f"{phase}: {done}/{total} runs, {now - start:.1f} s")

    for c in contestants:
        for _ in range(warmup):
            _call(c)
            done += 1
            tick("warm-up")
    n = len(contestants)
    for r in range(repeat):
        for k in range(n):
            c = contestants[(r + k) % n]
            stats[c.name].times.append(_call(c))
            done += 1
            tick("timing")
    return stats


def traced_peak(fn: Callable[[], object], setup: Callable[[], object] | None = None) -> int:
    """Peak bytes allocated through Python's allocators (NumPy arrays included) during one call of `fn`."""
    if setup is not None:
        setup()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        fn()
        return max(0, tracemalloc.get_traced_memory()[1] - base)
    finally:
        if not was_tracing:
            tracemalloc.stop()


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_peak(fn: Callable[[], object], setup: Callable[[], object] | None = None) -> int | None:
    """How far one call of `fn` raises the process's peak resident set, in bytes; None where Linux's
    /proc/self/clear_refs (which resets the peak) is not available."""
    if setup is not None:
        setup()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    return None if base is None or peak is None else max(0, peak - base)


def measure_memory(contestants: Sequence[Contestant], stats: dict[str, Stats], traced: bool = True) -> None:
    """Fill in each contestant's peak memory from one untimed run each (tracemalloc if `traced`, and RSS)."""
    for c in contestants:
        s = stats[c.name]
        s.rss_peak = rss_peak(c.fn, c.setup)
        if traced:
            s.traced_peak = traced_peak(c.fn, c.setup)


def format_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain text table, columns padded; the first column left-aligned, the rest right-aligned."""
    table = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for j, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def stats_table(stats: dict[str, Stats], baseline: str | None = None) -> str:
    """Median/min/max (ms) and peak memory per contestant, with each median's ratio to the `baseline` median."""
    header = ["contestant", "median ms", "min ms", "max ms", "peak traced", "peak RSS +"]
    if baseline is not None:
        if baseline not in stats:
            raise ValueError(f"baseline {baseline!r} is not one of {list(stats)}")
        header.append(f"x {baseline}")
    rows = []
    for s in stats.values():
        row = [s.name, format_ms(s.median), format_ms(s.min), format_ms(s.max), format_bytes(s.traced_peak),
               format_bytes(s.rss_peak)]
        if baseline is not None:
            row.append(f"{s.median / stats[baseline].median:.2f}")
        rows.append(row)
    return format_table(rows, header)


__all__ = ["Contestant", "Stats", "format_bytes", "format_ms", "format_table", "measure_memory", "rss_peak",
           "run_interleaved", "stats_table", "traced_peak"]
