"""What the GPU benchmarks share: the copy bandwidth (the roofline's denominator), interleaved timing with medians,
kiln's GPU time per op, the device line and the results table.

The GPU benchmarks run on the device machine (CuPy and a CUDA build of PyTorch), where every contestant lives in
one process: each sample ends with a synchronization, so a median is the wall time of finished GPU work.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from harness import print_table, time_round_robin  # noqa: F401 - the GPU scripts take them from here too


def copy_bandwidth(cp, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written: best of 10."""
    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    best = float("inf")
    for _ in range(11):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        cp.copyto(dst, src)
        end.record()
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
    return 2 * nbytes / best


def spin(cp, cycles: int = 600_000_000) -> None:
    """Hold the GPU with one spinning kernel (600M cycles: about 0.3 s) while Python queues work behind it, so the
    events around that work time the kernels back to back, not Python's launch rate."""
    import numpy as np

    kernel = cp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        const long long t = clock64(); while (clock64() - t < cycles) {} }""", "spin")
    kernel((1,), (1,), (np.int64(cycles),))


def gpu_time(cp, fn: Callable[[], object], calls: int = 50, repeat: int = 5) -> float:
    """GPU seconds per call of fn: `calls` calls queued behind a spinning kernel between two events; the median
    of `repeat` such runs."""
    fn()
    cp.cuda.Device().synchronize()
    runs = []
    for _ in range(repeat):
        spin(cp)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        runs.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / calls)
    return statistics.median(runs)


def gpu_op_times(program, cp, method: str, inputs: tuple, top: int) -> str:
    """GPU time per kiln op for one run of `method`, op by op: a spinning kernel holds the GPU while Python queues
    the whole run with an event after each op, so the events time the kernels back to back, as a graph runs them,
    not Python's pace."""
    from kiln.runtime.bench import format_table

    session = program.session("cuda", graphs=False)
    session.run(method, *inputs)
    events: list = []

    def timed(name: str, fn: Callable) -> Callable:
        def run(*args, **attrs):
            result = fn(*args, **attrs)
            event = cp.cuda.Event()
            event.record()
            events.append((name, event))
            return result
        return run

    session.backend.kernels = {name: timed(name, fn) for name, fn in session.backend.kernels.items()}
    session._plans.clear()
    spin(cp)
    start = cp.cuda.Event()
    start.record()
    session.run(method, *inputs)
    cp.cuda.Device().synchronize()
    totals: dict[str, list[float]] = {}
    previous = start
    for name, event in events:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += cp.cuda.get_elapsed_time(previous, event)
        previous = event
    whole = sum(t for _, t in totals.values())
    rows = [[name, str(calls), f"{ms * 1e3:.0f}", f"{100 * ms / whole:.0f}%"]
            for name, (calls, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]]
    return (f"GPU time of one {method} op by op (kernels back to back): {whole:.3f} ms in {len(events)} ops\n"
            + format_table(rows, ["op", "calls", "us", "share"]))




def device_line(cp, torch) -> str:
    """The GPU, the copy bandwidth and the library versions, for a results header."""
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return f"{name}, torch {torch.__version__}, cupy {cp.__version__}"


QUANT_KERNELS = {"dot": ("staged", True), "staged": ("staged", False), "direct": ("direct", False),
                 "rows": ("rows", False)}
"""The few-row quantized linear's kernels by a benchmark's names: (quant_linear.QGEMV, quant_linear.QUANT_DOT). "dot" is
quant.cu's qgemv_dot (x rounded to int8 per 32, integer products), "staged" qgemv_staged's float products."""


def variant_suffixes(name: str) -> str:
    """The QUANT_VARIANTS suffixes of a kernel name as they stand ("dot-interleaved-chunk" ->
    "-interleaved-chunk"): what applies to a bfloat16 program, which has no quantized kernel."""
    base = name
    while (found := next((v for v in QUANT_VARIANTS if base.endswith(v)), None)) is not None:
        base = base.removesuffix(found)
    return name[len(base):]


def quant_kernel_choice(name: str) -> dict[str, object]:
    """The settings a quantized-kernel name asks for (a QUANT_KERNELS name with any of QUANT_VARIANTS after it,
    "dot-interleaved-fusednorm"; "" the defaults): quant_linear's QGEMV, QUANT_DOT, QGEMV_GATED, QDOT_INTERLEAVED,
    QDOT_WAVE_ROWS, QGEMM, gemm_rows's GEMM_ROWS_PACKED and GEMM_ROWS_STAGES, norm's ADD_RMS_NORM_ROW and
    attention's DECODE_MMA."""
    base, variants = name, set()
    while (found := next((v for v in QUANT_VARIANTS if base.endswith(v)), None)) is not None:
        base, variants = base.removesuffix(found), variants | {found}
    if base and base not in QUANT_KERNELS:
        raise ValueError(f"{name!r}: no quantized kernel {base!r} (kernels: {', '.join(QUANT_KERNELS)}; "
                         f"after one: {', '.join(QUANT_VARIANTS)})")
    qgemv, dot = QUANT_KERNELS[base] if base else ("staged", None)
    return {"QGEMV": qgemv, "QUANT_DOT": dot, "QGEMV_GATED": "-apart" not in variants,
            "QDOT_INTERLEAVED": True if "-interleaved" in variants else False if "-stagefirst" in variants else None,
            "QDOT_WAVE_ROWS": "-onerow" not in variants, "QGEMM": "-dequant" not in variants,
            "GEMM_ROWS_PACKED": "-unpacked" not in variants,
            "GEMM_ROWS_STAGES": 3 if "-ring3" in variants else 4 if "-ring4" in variants else None,
            "GEMM_ROWS_TWO_TILES": "-twotiles" in variants,
            "ADD_RMS_NORM_ROW": "-fusednorm" not in variants, "DECODE_MMA": "-chunk" not in variants,
            "DECODE_PREFETCH_VISIBLE": "-prefetchall" not in variants}


def check_quant_kernels(parser, names: list[str]) -> None:
    """A benchmark's usage error for a kernel name quant_kernel_choice does not know, before any setup (an 8B
    export takes minutes of device time)."""
    for name in names:
        try:
            quant_kernel_choice(name)
        except ValueError as e:
            parser.error(str(e))


SETTING_MODULES = {"ADD_RMS_NORM_ROW": "norm", "GEMM_ROWS_PACKED": "gemm_rows", "GEMM_ROWS_STAGES": "gemm_rows",
                   "GEMM_ROWS_TWO_TILES": "gemm_rows", "DECODE_MMA": "attention",
                   "DECODE_PREFETCH_VISIBLE": "attention"}
"""The cuda kernels module of each quant_kernel_choice setting outside quant_linear."""


def select_quant_kernel(name: str) -> None:
    """Set kiln's CUDA quantized linear (and the norm before it, and the decode attention) as
    quant_kernel_choice(name) says: each switch on its kernels module (SETTING_MODULES, else quant_linear)."""
    import importlib

    for setting, value in quant_kernel_choice(name).items():
        module = SETTING_MODULES.get(setting, "quant_linear")
        setattr(importlib.import_module(f"kiln.runtime.backends.cuda.kernels.{module}"), setting, value)


QUANT_VARIANTS = {"-apart": "the gated gate/up product and its activation as two kernels",
                  "-interleaved": "qgemv_dot's interleaved form (x staged beside the rounds that read it) everywhere",
                  "-stagefirst": "qgemv_dot's plain form (all of x staged before the first product) everywhere",
                  "-onerow": "int4 qgemv_dot at one weight row a warp even where a second wave follows",
                  "-dequant": "9-64 rows by dequantize + cuBLAS, not quant.cu's gemm_rows",
                  "-unpacked": "gemm_rows's int4 (no zero, no offsets) dequantized one code at a time in float32",
                  "-ring3": "gemm_rows with a ring of 3 stages (4 blocks an SM) whatever the waves",
                  "-ring4": "gemm_rows with a ring of 4 stages (3 blocks an SM) whatever the waves",
                  "-twotiles": "gemm_rows dequantizing into two tiles, one barrier a stage (GEMM_ROWS_TWO_TILES)",
                  "-fusednorm": "the add + RMSNorm as fused.cu's rms_norm, not gemv.cu's add_rms_norm_row",
                  "-chunk": "decode attention by decode.cu's split-key attend_chunk, not attend_mma on the tensor "
                            "cores (attention.DECODE_MMA off)",
                  "-prefetchall": "decode attention asking L2 for its chunk's hidden slots too "
                                  "(attention.DECODE_PREFETCH_VISIBLE off)"}
"""Suffixes of a quantized-kernel name, each switching one choice away from the default."""
