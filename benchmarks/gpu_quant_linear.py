"""Weight-only quantized linear layers of a decode step on the GPU: kiln's few-row kernels against the bf16 GEMV.

    PYTHONPATH=src python3 benchmarks/gpu_quant_linear.py [--shape llama-3.2-1b] [--rows 1] [--markdown]

For each linear layer of one decode step (q/k/v and gate/up stacked, as kiln's export stacks them) and each weight
format (int4 in groups of 32 with offsets: GGUF's Q4_1/Q4_K; int4 in groups of 64 with zero points: kiln's own
default; int8 in groups of 32, symmetric: Q8_0; int8 per output channel), the GPU time per call of each of
quant.cu's few-row kernels (`--kernels`: qgemv_dot "dot", qgemv_staged "staged", qgemv "direct", qlinear_rows "rows"),
and of kiln's bf16 GEMV on the same layer, each reading weights that are not in L2 (copies over twice its size, in
turn, as a model's layers do). Bandwidth is what a call must read (codes, scales, zero points or offsets) per
second, against the copy bandwidth measured in the same run. Every result is checked against the float64 product
of the dequantized weight. GPU time is taken with the calls queued behind a spinning kernel (gpu_harness.gpu_time).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_compare import LLAMA_SIZES  # noqa: E402
from gpu_harness import (  # noqa: E402
    check_quant_kernels,
    copy_bandwidth,
    device_line,
    gpu_time,
    print_table,
    select_quant_kernel,
)

FORMATS = {"int4 g32 +offset": (4, 32, "offset"), "int4 g64 zero pt": (4, 64, "zero"),
           "int4 g32 sym": (4, 32, "symmetric"), "int8 g32 sym": (8, 32, "symmetric"),
           "int8 channel": (8, None, "zero")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES), default="llama-3.2-1b", help="decoder shape")
    parser.add_argument("--rows", type=int, default=1,
                        help="input rows (default 1): 1-8 the few-row kernels, 9-64 quant.cu's gemm_rows (or, with the "
                             "-dequant variant, dequantize + cuBLAS; e.g. --rows 64 --kernels dot,dot-dequant)")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed run (default 50)")
    parser.add_argument("--kernels", default="dot,staged,direct,rows",
                        help="quant.cu kernels to time (gpu_harness.QUANT_KERNELS, each with any of "
                             "gpu_harness.QUANT_VARIANTS after it, e.g. dot-interleaved; default "
                             "dot,staged,direct,rows)")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"weight formats (default all: {', '.join(FORMATS)})")
    parser.add_argument("--layers", default="q/k/v,o,gate/up,down,lm head", help="layers (default all)")
    parser.add_argument("--weight-rows", type=int, choices=(1, 2, 4), help="qgemv_staged's rows a warp (default: "
                        "by the layer, quant_linear._staged_weight_rows)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    check_quant_kernels(parser, args.kernels.split(","))

    import cupy as cp
    import numpy as np
    import torch

    from kiln.export.quantize import quantize_rows
    from kiln.runtime.backends.array_api import BFLOAT16
    from kiln.runtime.backends.array_api.quant import dequantize
    from kiln.runtime.backends.cuda.kernels import CUDA_KERNELS, quant_linear

    kernels = [k for k in args.kernels.split(",") if k]
    quant_linear.QGEMV_WEIGHT_ROWS = args.weight_rows
    size = LLAMA_SIZES[args.shape]
    d, inter, heads = size["hidden_size"], size["intermediate_size"], size["num_attention_heads"]
    kv_heads, vocab = size["num_key_value_heads"], size["vocab_size"]
    e = d // heads
    shapes = {"q/k/v": (d + 2 * kv_heads * e, d), "o": (d, d), "gate/up": (2 * inter, d), "down": (d, inter),
              "lm head": (vocab, d)}
    bandwidth = copy_bandwidth(cp)
    l2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    linear, qlinear = CUDA_KERNELS.kernels["linear"], CUDA_KERNELS.kernels["quantized_linear"]
    print(f"{args.shape}, {args.rows} input row(s), bfloat16 activations, on {device_line(cp, torch)} (copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s); GPU us per call, median of 5 runs of {args.calls} queued calls; "
          f"% = bytes read / time / copy bandwidth")
    rng = np.random.default_rng(0)
    body = []
    formats = {f: FORMATS[f] for f in args.formats.split(",") if f}
    shapes = {name: shapes[name] for name in args.layers.split(",") if name}
    for (name, (n, k)), (label, (bits, group, kind)) in itertools.product(shapes.items(), formats.items()):
        group = group or k
        w = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
        q, scale, zero = quantize_rows(w, bits, group, kind == "symmetric")
        offset = kind == "offset"
        if offset:
            zero = -zero * scale
        scale, zero = scale.astype(BFLOAT16), None if zero is None else zero.astype(BFLOAT16)
        x = rng.standard_normal((args.rows, k), dtype=np.float32).astype(BFLOAT16)
        f32 = [None if a is None else a.astype(np.float32) for a in (x, scale, zero)]
        want = f32[0].astype(np.float64) @ dequantize(np, q, f32[1], f32[2], bits, group, offset).T.astype(np.float64)
        x_d = cp.asarray(x)
        nbytes = q.nbytes + scale.size * 2 * (1 if zero is None else 2)
        copies = [(cp.asarray(q), cp.asarray(scale), None if zero is None else cp.asarray(zero))]
        copies += [(c[0].copy(), c[1].copy(), None if c[2] is None else c[2].copy())
                   for c in [copies[0]] * -(-2 * l2 // nbytes)]
        times, errors = {}, {}
        for kernel_name in kernels:
            select_quant_kernel(kernel_name)
            got = cp.asnumpy(qlinear(x_d, *copies[0], None, bits, group, offset)).astype(np.float64)
            errors[kernel_name] = np.abs(got - want).max() / np.abs(want).max()
            turns = itertools.cycle(copies)
            call = (x_d, bits, group, offset)
            times[kernel_name] = gpu_time(
                cp, lambda t=turns, c=call: qlinear(c[0], *next(t), None, c[1], c[2], c[3]), args.calls)
        select_quant_kernel("")
        if label == next(iter(formats)):  # the bf16 GEMV once per layer
            w_bf = cp.asarray(w.astype(BFLOAT16))
            bf_copies = itertools.cycle([w_bf] + [w_bf.copy() for _ in range(-(-2 * l2 // w_bf.nbytes))])
            bf16 = gpu_time(cp, lambda t=bf_copies, x_d=x_d: linear(x_d, next(t), None), args.calls)
            bf16_cell = f"{bf16 * 1e6:.1f} ({100 * w_bf.nbytes / bf16 / bandwidth:.0f}%)"
        else:
            bf16_cell = ""
        body.append([f"{name} [{n}, {k}]", label]
                    + [f"{times[c] * 1e6:.1f} ({100 * nbytes / times[c] / bandwidth:.0f}%)" for c in times]
                    + [bf16_cell, " ".join(f"{errors[c]:.1e}" for c in kernels)])
    print_table(body, ["layer", "format", *[f"{c} us" for c in kernels], "bf16 GEMV us", "rel err"], args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
