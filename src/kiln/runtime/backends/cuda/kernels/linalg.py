"""Matrix products on cuBLAS (capturable, bfloat16 included: kiln.runtime.backends.cuda.cublas), and linear layers
over a few input rows (every linear of a decode step) by a matrix-vector kernel of our own (gemv.cu), which also
runs gated_linear and add_rms_norm_linear with the activation and the norm folded in. The weight-only quantized
linear layers are quant_linear.py's."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends import composite
from kiln.runtime.backends.array_api.norm import rms_norm_eps
from kiln.runtime.backends.cuda import constants, cublas, nvrtc
from kiln.runtime.backends.cuda.kernels import gemm_rows
from kiln.runtime.backends.cuda.kernels.norm import NORM_ROW_MAX, fused_rms_norm_applies
from kiln.runtime.backends.cuda.kernels.registry import (
    CUDA_KERNELS,
    GATE_CODES,
    kernel,
    resident_blocks,
)


def matmul_cublas(a: Any, b: Any) -> Any:
    """a @ b on cuBLAS; 1-d operands as one-row / one-column matrices; integer products through CuPy (cuBLAS has
    none)."""
    if not (a.dtype == b.dtype and cublas.supports(a.dtype)):
        return cp.matmul(a, b)
    if a.ndim == 1:
        return matmul_cublas(a[None], b)[..., 0, :]
    if b.ndim == 1:
        return matmul_cublas(a, b[:, None])[..., 0]
    return cublas.matmul(a, b)


@kernel("matmul")
def matmul(a: Any, b: Any) -> Any:
    return matmul_cublas(a, b)


GEMV_ROWS, GEMV_WARPS = 4, 8
"""Up to GEMV_ROWS input rows the matrix-vector kernel runs (gemv.cu's GEMV_ROWS), GEMV_WARPS warps per block;
cuBLAS from GEMV_ROWS + 1 rows on.

Measured on an H100 (benchmarks/gpu_kernels.py: one bfloat16 row, Llama-3.2-1B's shapes, calls back to back, each
reading a weight not in L2): LM head [128256, 2048] 169.1 us against cuBLAS's 189.6, gate/up [16384, 2048] 25.2
against 26.6; q/k/v [3072, 2048] and o [2048, 2048] tie with cuBLAS, and the wide down projection [2048, 8192]
was not measured cold. It first ran only on weights at least 4x taller than wide; a whole decode step measured
with every one-row linear on it instead (H200, gpu_llm.py, same run) went 1.198 -> 1.150 ms at context 128 and
1.226 -> 1.183 at 1024, so it takes them all."""


GEMV_LOADS, GEMV_SPLIT_BELOW, GEMV_SHARE_ROUNDS = 2, 8192, 2
"""gemv.cu's 16-byte loads per lane in flight; a layer of fewer outputs than GEMV_SPLIT_BELOW (whose one warp per
row would leave the memory idle: Llama-3.2-1B's q/k/v, o and down projections) has each row shared by up to
GEMV_WARPS warps (gemv.cu's split), as many as keep GEMV_SHARE_ROUNDS rounds of those loads for each lane.

Measured on the H100, whole decode steps at context 128 (docs/benchmarks.md, fifth stop), warps a row for q/k/v,
o and down: 1, 1, 1 took 1.228-1.232 ms; 2, 2, 2 1.176; 4, 4, 4 1.190; 2, 2, 8 (this rule, two rounds a share)
1.176, 1.176; 4, 4, 8 (one round a share) 1.179, 1.174, 1.173: within the noise of this rule, which the CUDA suite
ran."""


def _gemv_split(n: int, k: int, itemsize: int) -> int:
    """log2 of the warps per output row (gemv.cu's MODE >> 3)."""
    pieces, log2 = k * itemsize // 16, 0
    if n < GEMV_SPLIT_BELOW:
        while (1 << log2) < GEMV_WARPS and pieces >> (log2 + 1) >= GEMV_SHARE_ROUNDS * 32 * GEMV_LOADS:
            log2 += 1
    return log2


def _gemv_applies(x2: Any, weight: Any, bias: Any) -> bool:
    """What gemv.cu reads 16 bytes at a time: one storage type, K a multiple of 16 bytes, rows aligned."""
    if not (1 <= x2.shape[0] <= GEMV_ROWS and weight.ndim == 2 and weight.size and nvrtc.supports(
            x2, weight, *(() if bias is None else (bias,)))):
        return False
    if weight.shape[1] % (16 // weight.itemsize) or not weight.flags.c_contiguous or weight.data.ptr % 16:
        return False
    return x2.strides[1] == x2.itemsize and x2.strides[0] % 16 == 0 and x2.data.ptr % 16 == 0 and (
        bias is None or bias.flags.c_contiguous)


GEMV_SHARED_MAX = 48 * 1024
"""Bytes of normalized rows a block of the norm-prologue GEMV may keep in shared memory (the default limit); one row
may take norm.NORM_ROW_MAX."""


def _gemv(x2: Any, weight: Any, bias: Any, activation: str = "", norm: tuple | None = None) -> Any:
    """x2 [M <= GEMV_ROWS, K] @ weight [N, K]^T + bias, the weight streamed once; with an activation, weight stacks
    gate and up rows and the result is act(gate) * up [M, N / 2]; with norm = (residual, norm_weight, eps, total),
    x2 + residual (written to total) is RMS-normalized on the way in (gemv.cu's MODE)."""
    n, k = weight.shape
    n //= 2 if activation else 1
    out = cp.empty((x2.shape[0], n), dtype=x2.dtype)
    log2_split = 0 if activation else _gemv_split(n, k, x2.itemsize)
    blocks, shared = -(-n // (GEMV_WARPS >> log2_split)), 0
    residual, norm_weight, eps, total = norm if norm is not None else (x2, None, 0.0, x2)
    mode = (GATE_CODES[activation] if activation else 0) | (4 if norm is not None else 0) | log2_split << 3
    function = nvrtc.function("gemv", "gemv", x2.dtype, mode)
    if norm is not None:
        shared = x2.size * x2.itemsize
        blocks = min(blocks, resident_blocks(function, shared, 32 * GEMV_WARPS))
    function(
        (blocks,), (32 * GEMV_WARPS,),
        (x2, np.int64(x2.strides[0] // x2.itemsize), residual, x2 if norm_weight is None else norm_weight, total,
         weight, weight if bias is None else bias, out, np.int32(x2.shape[0]), np.int32(n), np.int32(k),
         np.int32(bias is not None), np.int32(norm_weight is not None), np.float32(eps),
         np.int32(constants.is_constant(weight))), shared_mem=shared)
    return out


TUNED_PRODUCTS = False
"""Whether the linear layers' cuBLAS products (5+ rows, float16/bfloat16) run the algorithm measured fastest for
their shape on first use (cublaslt.py: cuBLASLt's candidates and cublasGemmEx timed on the real operands) rather
than GemmEx's heuristic pick. For the skinny products of a batched decode step: H200, 64 rows, cuBLAS read the 1B
shape's o projection at 27% of the copy bandwidth, q/k/v at 38%, down at 54%, because 16-24 output tiles leave
most of 132 SMs idle; split-K candidates can fill them. Predicted: q/k/v 7.8 -> ~5 us, o 7.3 -> ~4, down 14.7 ->
~11, the 64-slot bf16 step 1.61 -> ~1.45 ms. Measured on an H200 (2026-11-28): GemmEx's own pick was fastest for
q/k/v, o, gate/up and down at 64 rows (cuBLASLt's 16 heuristic candidates 9.0-27.4 us with L2 flushed, none
ahead), only the LM head took a cuBLASLt algorithm (140.3 us); the 64-row step 1.629 -> 1.617 ms at position 400,
1.493 -> 1.481 at 150, 16 rows -0.2% / +0.5%: missed (the heuristics offer no split-K candidate that fills the SMs
at these shapes), left off: ~0.7% does not pay the first call's tuning."""


def addmm(x2: Any, weight_t: Any, bias: Any) -> Any:
    """x2 [M, K] @ weight_t [K, N] + bias with the bias added inside the product (beta = 1), rounded once, as
    PyTorch's addmm does."""
    if _gemv_applies(x2, weight_t.T, bias):
        return _gemv(x2, weight_t.T, bias)
    if gemm_rows.dense_applies(x2, weight_t.T, bias):
        return gemm_rows.gemm_rows(x2, weight_t.T, None, None, bias, 16, 32, np.int32(0))
    if not (x2.dtype == weight_t.dtype and cublas.supports(x2.dtype)):
        out = cp.matmul(x2, weight_t)
        if bias is not None:
            out += bias
        return out
    out = None
    if bias is not None:
        out = cp.empty((x2.shape[0], weight_t.shape[1]), dtype=x2.dtype)
        out[...] = bias
    return cublas.matmul(x2, weight_t, out=out, accumulate=bias is not None, tuned=TUNED_PRODUCTS)


@kernel("linear")
def linear(x: Any, weight: Any, bias: Any) -> Any:
    """x @ W^T with W^T as a transposed view: cuBLAS reads the [out, in] weight as it is, no copy per call."""
    lead = x.shape[:-1]
    out = addmm(x.reshape(-1, x.shape[-1]), weight.T, bias)  # 2-d: one gemm, not a batch of them
    return out.reshape(*lead, weight.shape[0])


@kernel("gated_linear")
def gated_linear(x: Any, weight: Any, bias: Any, activation: str) -> Any:
    """One GEMV with the gated activation as its epilogue for a few rows; linear + gated_activation otherwise."""
    x2 = x.reshape(-1, x.shape[-1])
    if activation in GATE_CODES and weight.shape[0] % 2 == 0 and _gemv_applies(x2, weight, bias):
        return _gemv(x2, weight, bias, activation).reshape(*x.shape[:-1], weight.shape[0] // 2)
    if activation in GATE_CODES and weight.shape[0] % 2 == 0 and gemm_rows.dense_applies(x2, weight, bias):
        out = gemm_rows.gemm_rows(x2, weight, None, None, bias, 16, 32, np.int32(0), activation)
        return out.reshape(*x.shape[:-1], weight.shape[0] // 2)
    return composite.gated_linear(CUDA_KERNELS.kernels, x, weight, bias, activation)


@kernel("add_rms_norm_linear")
def add_rms_norm_linear(x: Any, residual: Any, norm_weight: Any, weight: Any, bias: Any, axes: int,
                        eps: float | None, activation: str) -> tuple[Any, Any]:
    """One GEMV that adds and normalizes its few input rows in each block before the product (gemv.cu's MODE & 4);
    add_rms_norm + linear (or gated_linear) otherwise."""
    if (fused_rms_norm_applies(x, residual, norm_weight, axes) and x.size * x.itemsize <= GEMV_SHARED_MAX
            and x.shape[-1] * x.itemsize <= NORM_ROW_MAX and (not activation or activation in GATE_CODES)
            and weight.shape[0] % (2 if activation else 1) == 0
            and _gemv_applies(x2 := x.reshape(-1, x.shape[-1]), weight, bias)):
        total = cp.empty_like(x)
        out = _gemv(x2, weight, bias, activation, (residual, norm_weight, rms_norm_eps(eps, x.dtype), total))
        return total, out.reshape(*x.shape[:-1], out.shape[-1])
    return composite.add_rms_norm_linear(CUDA_KERNELS.kernels, x, residual, norm_weight, weight, bias, axes, eps,
                                         activation)
