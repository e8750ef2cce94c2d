"""The benchmark harness: thread settings that every contestant shares, and comparison tables with ratios.

The timing core (warm-up, interleaved round-robin repeats, medians, peak memory) is `kiln.runtime.bench`, which
`kiln bench` uses too; this module adds what only peer comparisons need. Call `configure_threads` before NumPy,
torch or ONNX Runtime are imported: BLAS libraries read their thread count from the environment once, at load.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                    "NUMEXPR_NUM_THREADS", "KILN_THREADS")
"""KILN_THREADS: kiln's own pool (the compiled few-row linears), which otherwise takes every core."""


def configure_threads(threads: int) -> None:
    """Give NumPy's BLAS, OpenMP (torch) and the rest the same thread count, through the environment."""
    late = [m for m in ("numpy", "torch", "onnxruntime") if m in sys.modules]
    if late:
        raise RuntimeError(f"configure_threads must run before importing {late}: their thread pools are sized at load")
    for var in THREAD_VARIABLES:
        os.environ[var] = str(threads)
    if threads > 1:
        # torch's OpenMP workers otherwise spin after each eager run and take the cores of the contestant after it
        # (as ORT's do: quiet_ort_options); kiln's own pool spins ~100 us, then sleeps
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # kiln before NumPy, as its command line loads them: kiln sets how long NumPy's OpenBLAS threads spin after a
    # call (OPENBLAS_THREAD_TIMEOUT), which decides whether they take the cores of kiln's own pool right after
    import kiln  # noqa: F401


def quiet_ort_options(options, threads: int):
    """ONNX Runtime's session options with its pool's spin-waiting off when it has threads to spare: left on, its
    workers spin for a long while after each run (measured: kiln's float32 decode at 2 threads 22.9 ms a step with
    ORT idle in the process, 37.4 ms with ORT's run 20 ms before, 27.6 ms 300 ms before) and take the cores of
    whichever contestant runs next. With 1 thread there is no pool to spin."""
    if threads > 1:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def start_torch(threads: int):
    """Import torch (after configure_threads) with `threads` intra-op threads and one inter-op thread."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    return torch


def library_versions() -> dict[str, str]:
    """numpy, torch and onnxruntime versions (or "not installed") for a results table."""
    import numpy as np
    import torch

    versions = {"numpy": np.__version__, "torch": torch.__version__}
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        versions["onnxruntime"] = "not installed"
    return versions


def quantize_spec(spec: str):
    """kiln.export.Quantize of MODE[-gGROUP][-sym] (int4, int8-sym, int4-g32-sym), the benchmarks' --quantize."""
    from kiln.export import Quantize

    mode, *rest = spec.split("-")
    group = next((int(p[1:]) for p in rest if p.startswith("g")), None)
    return Quantize(mode, group, "sym" in rest)


def stderr_log(line: str) -> None:
    """Progress goes to stderr, so that stdout holds only the results."""
    print(line, file=sys.stderr, flush=True)


def functional_decode(lm):
    """(module, example caches) for ONNX: the decode step of a kiln.models.llm.StaticCacheLM (full-attention layers)
    with the KV caches as inputs and outputs, since ONNX has no state buffers. Each call clones its caches."""
    import torch

    from kiln.models.llm import _BufferCache

    class FunctionalDecode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, token, pos, *caches):
            n = self.lm.num_layers
            keys = [c.clone() for c in caches[:n]]
            values = [c.clone() for c in caches[n:]]
            mask = (torch.arange(self.lm.max_context)[None, :] <= pos[:, None])[None, None]
            out = self.lm.model(input_ids=token, attention_mask=mask, position_ids=pos[None, :],
                                past_key_values=_BufferCache(keys, values, [pos] * n), use_cache=True,
                                logits_to_keep=1)
            return (out.logits[:, -1, :], *keys, *values)

    caches = tuple(torch.zeros_like(getattr(lm, f"{kind}_cache_{i}"))
                   for kind in ("key", "value") for i in range(lm.num_layers))
    return FunctionalDecode().eval(), caches


def thread_report() -> str:
    """One line with every thread setting in force, so a results table says how it was measured."""
    parts = [f"{v}={os.environ.get(v, 'unset')}" for v in THREAD_VARIABLES[:3]]
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        parts.append(f"torch.get_num_threads()={torch.get_num_threads()}")
    return " ".join(parts)


def machine_report() -> dict[str, str]:
    """CPU model, core count and memory (Linux /proc), OS and Python: the machine line of a results table."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = "unknown"
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
            mem = f"{kib / (1 << 20):.1f} GiB"
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": str(os.cpu_count()), "memory": mem, "os": platform.platform(),
            "python": platform.python_version()}


@dataclass
class Row:
    """One model's result in a comparison: median seconds per contestant, and notes (accuracy, skips)."""

    model: str
    medians: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def comparison_table(rows: Sequence[Row], contestants: Sequence[str], subject: str,
                     baselines: Sequence[str], markdown: bool = False) -> str:
    """Medians (ms) per model and contestant, then `subject`/baseline ratios; '-' where one did not run."""
    header = ["model"] + [f"{c} ms" for c in contestants] + [f"{subject}/{b}" for b in baselines]
    body = []
    for r in rows:
        cells = [r.model] + [f"{r.medians[c] * 1e3:.2f}" if c in r.medians else "-" for c in contestants]
        for b in baselines:
            ok = subject in r.medians and b in r.medians
            cells.append(f"{r.medians[subject] / r.medians[b]:.2f}" if ok else "-")
        body.append(cells)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    from kiln.runtime.bench import format_table

    return format_table(body, header)

def time_round_robin(cases: dict[str, Callable[[], None]], repeat: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each case, the cases interleaved round by round, each round starting at the next
    case: a fixed order favoured one place in it (a gpt-oss decode A/B on this 2-core machine: the first of two
    identical-cost contestants measured ~7% faster than the second, whichever it was)."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            t0 = time.perf_counter()
            cases[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def print_table(body: Sequence[Sequence[str]], header: Sequence[str], markdown: bool) -> None:
    """The table on stdout, as Markdown (for docs/benchmarks.md) or aligned text."""
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
        for cells in body:
            print("| " + " | ".join(cells) + " |")
    else:
        from kiln.runtime.bench import format_table

        print(format_table([list(c) for c in body], list(header)))



__all__ = ["Row", "comparison_table", "configure_threads", "machine_report", "print_table", "thread_report",
           "time_round_robin"]
