"""The CPU helpers' few-row quantized linear (qdot.c's kiln_qlinear_dot_f32) from two or more builds, in one
process, calls interleaved: SmolLM2-135M's layer shapes with random weights, as its GGUF's export stores them
(int4 groups of 32 with offsets for the layers, int8 for the LM head, which yields logits and so rounds its inputs
twice), at 1, 2 and 4 rows.

    PYTHONPATH=src python benchmarks/cpu_qlinear_ab.py old=PATH.so new=PATH.so [--threads 1] [--calls 60]

A build's path: `PYTHONPATH=TREE/src python -c "from kiln.runtime.backends.cpu import native;
print(native.library()._name)"` compiles a tree's helpers into kiln's cache and prints where (a change to the C
sources gets a new file). A kernel change cannot be switched inside one library, and separate processes on this
kind of shared machine differ by more than the changes measured; two libraries in one process, called in turns,
see the same machine. One thread by default: each library has its own worker pool, and two pools spin against each
other. Prints min and median microseconds a call and each build's min against the first's, and whether the
outputs have the same bits as the first build's.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import numpy as np

SHAPES = (("q/k/v", 960, 576, 4), ("o", 576, 576, 4), ("gate/up", 3072, 576, 4), ("down", 576, 1536, 4),
          ("LM head", 49152, 576, 8))
"""(layer, outputs, inputs, bits): SmolLM2-135M's, gate/up fused as its export fuses them."""

QUANT_OFFSET, QUANT_REFINE = 256, 512  # kiln.runtime.backends.cpu.native's format flags (quant.h)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.kiln_qlinear_dot_f32.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6
    lib.kiln_qlinear_dot_f32.restype = ctypes.c_int64
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", metavar="NAME=PATH", help="a name and a built helper library (.so)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=60, help="calls of each build per case (a fifth for the head)")
    parser.add_argument("--rows", default="1,2,4")
    args = parser.parse_args(argv)
    libs = {name: load(path) for name, path in (b.split("=", 1) for b in args.builds)}
    rng = np.random.default_rng(0)
    names = list(libs)
    print(f"kiln_qlinear_dot_f32, {args.threads} thread(s); min / median us of {args.calls} interleaved calls")
    print("| layer | rows | " + " | ".join(f"{n} min / med" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("|---|---:|" + "---:|" * (2 * len(names) - 1))
    for layer, n, k, bits in SHAPES:
        q = rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8)
        scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
        offset = rng.uniform(-0.5, 0.0, (n, k // 32)).astype(np.float32) if bits == 4 else None
        work = np.empty(2 * 8 * (k + k // 32), np.float32)
        form = bits | (QUANT_OFFSET if bits == 4 else 0) | (QUANT_REFINE if bits == 8 else 0)
        calls = args.calls if bits == 4 else max(3, args.calls // 5)
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            outs = {name: np.empty((rows, n), np.float32) for name in names}
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(calls):
                for name, lib in libs.items():
                    t0 = time.perf_counter()
                    done = lib.kiln_qlinear_dot_f32(x.ctypes.data, q.ctypes.data, scale.ctypes.data,
                                                    None if offset is None else offset.ctypes.data, None,
                                                    outs[name].ctypes.data, work.ctypes.data, rows, n, k, form, 32,
                                                    args.threads)
                    times[name].append(time.perf_counter() - t0)
                    if not done:
                        raise SystemExit(f"{name}: the build declined the shape (no byte dot products here?)")
            best = {name: min(t) for name, t in times.items()}
            cells = " | ".join(f"{best[nm] * 1e6:.1f} / {statistics.median(times[nm]) * 1e6:.1f}" for nm in names)
            same = {nm: np.array_equal(outs[nm], outs[names[0]]) for nm in names[1:]}
            ratios = " | ".join(f"{best[nm] / best[names[0]]:.2f}{'' if same[nm] else ' (bits differ)'}"
                                for nm in names[1:])
            print(f"| {layer}{' (refined)' if bits == 8 else ''} | {rows} | {cells} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
