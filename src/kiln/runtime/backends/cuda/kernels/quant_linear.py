"""Weight-only quantized linear layers on the GPU (quant.cu): for a few input rows a warp per output feature streams
the int8/int4 weight rows (a decode step reads 2x/4x fewer weight bytes than bfloat16; qgemv_dot multiplies in
integers, qgemv_staged in floats), their gated form with the activation folded in, 9 to 64 rows on the tensor cores a
weight tile at a time (gemm_rows.py), larger batches dequantized and multiplied on cuBLAS. Which kernel a layer
takes, and the switches the benchmarks and tests set, live here."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends import composite
from kiln.runtime.backends.array_api import upcast
from kiln.runtime.backends.array_api.quant import dequantize, integer_products_asked
from kiln.runtime.backends.cuda import constants, nvrtc
from kiln.runtime.backends.cuda.kernels import gemm_rows
from kiln.runtime.backends.cuda.kernels.linalg import addmm
from kiln.runtime.backends.cuda.kernels.registry import (
    CUDA_KERNELS,
    GATE_CODES,
    contiguous,
    grid,
    kernel,
    resident_blocks,
)

QUANT_ROWS = 8
"""Up to this many input rows the row-streaming kernels run (as quant.cu's MAX_ROWS); above, gemm_rows up to
GEMM_ROWS_MAX rows, then dequantize + cuBLAS."""
QUANT_WARPS = 8  # warps per block of qlinear_rows, as quant.cu's WARPS


@kernel("quantized_linear")
def quantized_linear(x: Any, q: Any, scale: Any, zero: Any, bias: Any, bits: int, group_size: int,
                     offset: bool = False) -> Any:
    dtype = scale.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    n = q.shape[0]
    x2 = x.reshape(-1, k)
    if not _quant_parts_apply(x2, q, scale, zero, bias):
        return _dequantized_linear(x2, q, scale, zero, bias, bits, group_size, offset).reshape(*lead, n)
    x2 = cp.ascontiguousarray(x2)
    zero_mode = quant_zero_mode(zero, offset)
    if QGEMM and scale.dtype == x2.dtype and gemm_rows.quantized_applies(x2, q, scale, zero, bits, group_size):
        return gemm_rows.gemm_rows(x2, q, scale, zero, bias, bits, group_size, zero_mode).reshape(*lead, n)
    if x2.shape[0] > QUANT_ROWS:
        weight = cp.empty((n, k), dtype=dtype)
        nvrtc.function("quant", "dequantize", dtype)(
            grid(n * k), (256,), (q, scale, zero if zero is not None else scale, weight, np.int64(n), np.int32(k),
                                  np.int32(bits), np.int32(group_size), zero_mode))
        return addmm(x2, weight.T, bias).reshape(*lead, n)
    out = cp.empty((x2.shape[0], n), dtype=dtype)
    rows = x2.shape[0]
    applies = rows and _qgemv_applies(x2, q, bits, group_size)
    rows_cap = next(r for r in (1, 2, 4, 8) if r >= rows)  # (quant.cu: the instance's ROWS)
    zero_arg, bias_arg = zero if zero is not None else scale, bias if bias is not None else scale
    if applies and (shared := _staged_shared(x2, k, bits)) is not None:
        _qgemv_staged(x2, q, scale, zero, bias, out, bits, group_size, zero_mode, shared)
    elif applies and QGEMV in ("staged", "direct"):
        nvrtc.function("quant", "qgemv", dtype, 16 * bits + rows_cap)(
            ((n + QUANT_WARPS - 1) // QUANT_WARPS,), (32 * QUANT_WARPS,),
            (x2, q, scale, zero_arg, bias_arg, out, np.int32(rows), np.int32(n), np.int32(k), np.int32(group_size),
             zero_mode, np.int32(bias is not None)))
    elif rows:
        nvrtc.function("quant", "qlinear_rows", dtype)(
            ((n + QUANT_WARPS - 1) // QUANT_WARPS,), (32 * QUANT_WARPS,),
            (x2, q, scale, zero_arg, bias_arg, out, np.int32(rows), np.int32(n), np.int32(k), np.int32(bits),
             np.int32(group_size), zero_mode, np.int32(bias is not None)))
    return out.reshape(*lead, n)


QGEMM: bool = True
"""Whether a quantized weight's 9 to GEMM_ROWS_MAX rows take gemm_rows (False: dequantize + cuBLAS, as before it;
the benchmarks' "-dequant" variant)."""


def quant_zero_mode(zero: Any, offset: bool) -> Any:
    """quant.cu's zero_mode for a quantized weight's zero array (absent, zero points or additive offsets)."""
    return np.int32((3 if zero is None else 2) if offset else (0 if zero is None else 1))


def _quant_parts_apply(x2: Any, q: Any, scale: Any, zero: Any, bias: Any) -> bool:
    """Whether quant.cu's kernels take these operands: one storage type, each part contiguous."""
    parts = (scale,) + tuple(a for a in (zero, bias) if a is not None)
    return nvrtc.supports(x2, *parts) and contiguous(q, *parts)


def _staged_shared(x2: Any, k: int, bits: int) -> int | None:
    """The staged product's shared memory for these rows (qgemv_dot's where it multiplies in integers, else
    qgemv_staged's), or None where it does not take them."""
    rows_cap = next((r for r in (1, 2, 4) if r >= x2.shape[0]), 0)
    if QGEMV != "staged" or not rows_cap:
        return None
    shared = _dot_smem(rows_cap, k, bits) if _takes_dot(k) else _staged_smem(rows_cap, k, bits)
    return shared if shared <= QGEMV_STAGED_SMEM else None


def _takes_dot(k: int) -> bool:
    """Whether the staged product of this K multiplies in integers (qgemv_dot) rather than floats."""
    return quant_dot() and k % 32 == 0


def _dot_smem(rows: int, k: int, bits: int) -> int:
    """qgemv_dot's shared memory: x's int8 codes and two 4-byte words a piece (its scale and code sum), far less
    than qgemv_staged's float32 copy, so the 8B shape's down layer (K = 14336) still stages 2 to 4 input rows."""
    return rows * (k + k // (32 if bits == 4 else 16) * 8)


def _qgemv_staged(x2: Any, q: Any, scale: Any, zero: Any, bias: Any, out: Any, bits: int, group_size: int,
                  zero_mode: Any, shared: int, activation: str = "") -> None:
    """quant.cu's qgemv_staged into out (`shared`: _staged_shared's bytes); with an activation, its gated form (q
    stacks gate rows then up rows, out takes act(gate) * up: half q's rows)."""
    rows, k, n = x2.shape[0], x2.shape[1], q.shape[0]
    rows_cap = next(r for r in (1, 2, 4) if r >= rows)
    weight_rows = _staged_weight_rows(n, rows_cap)
    if activation:
        weight_rows = max(2, weight_rows)
    dot = _takes_dot(k)
    instance = (1000 if activation else 0) + (4000 if dot and _interleaves(rows, k, n) else 0) + 10 * bits + rows_cap
    if dot:  # (int4 with 4 weight rows a warp and 2 input rows would spill: quant.cu instantiates none)
        weight_rows = 2 if bits == 4 and rows_cap == 2 and weight_rows == 4 else weight_rows
    name = "qgemv_dot" if dot else "qgemv_staged"
    function = nvrtc.function("quant", name, out.dtype, 100 * weight_rows + instance)
    if (dot and bits == 4 and weight_rows == 1 and QGEMV_WEIGHT_ROWS is None and QDOT_WAVE_ROWS
            and _waves(n, shared, function) > 1):
        weight_rows = 2
        function = nvrtc.function("quant", name, out.dtype, 200 + instance)
    constant = all(constants.is_constant(a) for a in (q, scale) + ((zero,) if zero is not None else ()))
    outputs_a_warp = weight_rows // 2 if activation else weight_rows
    function((-(-(n // 2 if activation else n) // (QUANT_WARPS * outputs_a_warp)),), (32 * QUANT_WARPS,),
             (x2, q, scale, zero if zero is not None else scale, bias if bias is not None else scale, out,
              np.int32(rows), np.int32(n), np.int32(k), np.int32(group_size), zero_mode,
              np.int32(bias is not None), np.int32(constant), np.int32(GATE_CODES.get(activation, 0))),
             shared_mem=shared)


@kernel("gated_quantized_linear")
def gated_quantized_linear(x: Any, q: Any, scale: Any, zero: Any, bias: Any, bits: int, group_size: int,
                           offset: bool, activation: str) -> Any:
    """For one or two rows, qgemv_staged's gated form: the gate/up product and the activation in one kernel (the
    same bits as quantized_linear and gated_activation after it); their composition otherwise."""
    lead, k, n = x.shape[:-1], x.shape[-1], q.shape[0]
    x2 = x.reshape(-1, k)
    if (QGEMV_GATED and activation in GATE_CODES and n % 2 == 0 and x2.shape[0] <= 2
            and _quant_parts_apply(x2, q, scale, zero, bias)
            and _qgemv_applies(x2 := cp.ascontiguousarray(x2), q, bits, group_size)
            and (shared := _staged_shared(x2, k, bits)) is not None):
        out = cp.empty((x2.shape[0], n // 2), dtype=scale.dtype)
        _qgemv_staged(x2, q, scale, zero, bias, out, bits, group_size, quant_zero_mode(zero, offset), shared,
                      activation)
        return out.reshape(*lead, n // 2)
    if (QGEMM and activation in GATE_CODES and n % 2 == 0 and _quant_parts_apply(x2, q, scale, zero, bias)
            and gemm_rows.quantized_applies(x2 := cp.ascontiguousarray(x2), q, scale, zero, bits, group_size)):
        out = gemm_rows.gemm_rows(x2, q, scale, zero, bias, bits, group_size, quant_zero_mode(zero, offset), activation)
        return out.reshape(*lead, n // 2)
    return composite.gated_quantized_linear(CUDA_KERNELS.kernels, x, q, scale, zero, bias, bits, group_size, offset,
                                            activation)


@kernel("add_rms_norm_quantized_linear")
def add_rms_norm_quantized_linear(x: Any, residual: Any, norm_weight: Any, q: Any, scale: Any, zero: Any, bias: Any,
                                  axes: int, eps: float | None, bits: int, group_size: int, offset: bool,
                                  activation: str) -> tuple[Any, Any]:
    """add_rms_norm, then the quantized product (gated_quantized_linear above where there is an activation)."""
    kernels = CUDA_KERNELS.kernels
    total, normed = kernels["add_rms_norm"](x, residual, norm_weight, axes, eps)
    if activation:
        return total, gated_quantized_linear(normed, q, scale, zero, bias, bits, group_size, offset, activation)
    return total, quantized_linear(normed, q, scale, zero, bias, bits, group_size, offset)


QUANT_DOT: bool | None = None
"""Whether the few-row quantized linears multiply in integers (quant.cu's qgemv_dot: x rounded to int8 in blocks of
32, as the CPU's native/qdot.c and llama.cpp do) or keep qgemv_staged's float products, whose only rounding is the
output's. None follows KILN_QUANT_DOT at each call (`float` for the float products), the CPU's switch; a benchmark
or test sets True or False."""


def quant_dot() -> bool:
    """QUANT_DOT's choice now: read at every launch, not at import, so that a program run after the environment
    changes (a test's monkeypatch, a second session) takes the products the environment asks for."""
    return integer_products_asked() if QUANT_DOT is None else QUANT_DOT


QDOT_INTERLEAVED: bool | None = None
"""Whether qgemv_dot stages x a turn at a time beside the rounds of products that read it (its interleaved form,
quant.cu's N + 4000) rather than all of x first; None: where staging x takes more than one turn (_interleaves).
True or False for every product: the benchmarks' "-interleaved" and "-stagefirst" kernels."""


QDOT_INTERLEAVE_ROWS = 4096
"""The fewest weight rows (outputs) a product needs for the interleaved form (_interleaves)."""


def _interleaves(rows: int, k: int, n: int) -> bool:
    """QDOT_INTERLEAVED's choice for `rows` rows of K against n weight rows: the interleaved form where staging x
    takes more than one turn (a turn stages 8 values a thread, 2048 a block), so that a product waits for one turn's
    L2 round trip, not all of them, and the layer has at least QDOT_INTERLEAVE_ROWS rows. Measured (whole decode
    steps, CUDA graphs): the 8B shape (K 4096 and 14336, 2 to 7 turns; 4096 rows and more) H100 int4 2.483 ->
    2.395 ms, int8 3.702 -> 3.554; H200 int8 2.963 -> 2.909, int4 2.167 -> 2.166. The 1B shape's down layer (K
    8192, 2048 rows) interleaved cost the int4 step 0.588 -> 0.614 ms (H200; int8 0.750 -> 0.753), and every 1B
    product interleaved 0.606 -> 0.626 (H100): with fewer rows than SMs' worth of blocks the staging is not what
    a block waits on."""
    if QDOT_INTERLEAVED is not None:
        return QDOT_INTERLEAVED
    return rows * k > 8 * 32 * QUANT_WARPS and n >= QDOT_INTERLEAVE_ROWS


QGEMV_GATED = True
"""Whether gated_quantized_linear runs qgemv_staged's gated form (benchmarks/gpu_quant_decode.py's A/B: False runs
the product and gated_activation as two kernels)."""

QGEMV = "staged"
"""The few-row quantized linear's kernel (quant.cu), for benchmarks/gpu_quant_linear.py's A/B: "staged"
(qgemv_staged: x staged in shared memory, several weight rows a warp; qgemv where its shared memory would not
fit), "direct" (qgemv: x read from L1 for every weight), "rows" (qlinear_rows: 4-byte loads, the first kernel)."""

QGEMV_STAGED_SMEM = 96 * 1024
"""Most shared memory the staged products' x may take (qgemv_staged: ROWS x K float32 and the piece sums; qgemv_dot:
ROWS x K int8 codes and 8 bytes a piece): 2 blocks of it still fit an SM of the H100 (228 KB); beyond it, and above
4 input rows, qgemv (qgemv_staged's 1 row takes 8 KB at K = 2048, 56 KB at 14336; qgemv_dot's 4 rows 72 KB at
14336)."""

QGEMV_WEIGHT_ROWS: int | None = None
"""qgemv_staged's weight rows per warp (1, 2 or 4); None: by the layer's size (_staged_weight_rows)."""


def _staged_smem(rows: int, k: int, bits: int) -> int:
    pieces = k // (32 if bits == 4 else 16)
    return rows * (k + pieces) * 4


def _staged_weight_rows(n: int, rows: int) -> int:
    """Rows a warp of qgemv_staged takes: 4 where that still gives every SM of the H100's 132 two blocks, fewer for
    narrow layers; 1 for more than 2 input rows (quant.cu instantiates no more: the registers would spill)."""
    if rows > 2:
        return 1
    if QGEMV_WEIGHT_ROWS is not None:
        return QGEMV_WEIGHT_ROWS
    return next((w for w in (4, 2) if -(-n // (QUANT_WARPS * w)) >= 264), 1)


QDOT_WAVE_ROWS = True
"""Whether int4's qgemv_dot takes 2 weight rows a warp where 1 would need a second wave of blocks (_waves). Measured
before the interleaved form was the default; beside it (the benchmarks' "-onerow" kernels, H200, 8B int4 step) 2.166
ms with the rule, 2.163 without: the interleaved form hides the staging latency the rule was made for."""


def _waves(n: int, shared: int, one_row: Any) -> int:
    """Waves of resident blocks qgemv_dot's grid at one weight row a warp needs. Where int4 needs more than one, it
    takes 2 rows a warp: every block stages all of x before its first product, and a second wave waits that latency
    again. Measured (H100, 8B shape's 4096-output layers: 512 blocks where 396 fit, 1 -> 2 rows a warp): int4 o
    7.7 -> 6.6 us, down 22.7 -> 18.1; int8 o 8.4 -> 9.2, down 25.6 -> 26.8 (its rows are twice the bytes, and one a
    warp already keeps the loads in flight), so int8 keeps one."""
    blocks = -(-n // QUANT_WARPS)
    return -(-blocks // resident_blocks(one_row, shared, 32 * QUANT_WARPS))


def _qgemv_applies(x2: Any, q: Any, bits: int, group_size: int) -> bool:
    """qgemv's layout: whole 16-byte pieces of 32 (int4) or 16 (int8) weights, each inside one group; q and x rows
    16-byte aligned."""
    per = 32 if bits == 4 else 16
    k = x2.shape[1]
    return (bits in (4, 8) and k % per == 0 and group_size % per == 0 and q.data.ptr % 16 == 0
            and x2.data.ptr % 16 == 0 and (k * x2.itemsize) % 16 == 0)


def _dequantized_linear(x2: Any, q: Any, scale: Any, zero: Any, bias: Any, bits: int, group_size: int,
                        offset: bool) -> Any:
    """The op's definition in CuPy (mixed dtypes, non-contiguous parts): float32 weight, float32 product."""
    dtype = scale.dtype
    x2, bias = upcast(x2, bias)
    weight = dequantize(cp, q, scale, zero, bits, group_size, offset)
    return addmm(x2.astype(np.float32, copy=False), weight.T, bias).astype(dtype, copy=False)
