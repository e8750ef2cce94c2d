"""A mixture-of-experts layer on the GPU: the router's pick (route_experts: topk.cu's route_rows, a warp per token;
add_rms_norm_route_experts: gemv.cu's add_rms_norm_route, the block's norm, router GEMV and pick in one kernel)
and the experts (gathered_linear, gated_gathered_linear and gathered_quantized_linear): each row of x through the
linear layer its router picked from a stack of E, reading only the picked experts' weights, with the index kept on
the GPU (no copy to the host, so a decode step is still one captured graph).

- A few rows (a decode step's top-k, GATHERED_GEMV_ROWS at most): gemv.cu's gathered_gemv and quant.cu's
  gathered_qgemv, a warp per output row of the expert each input row picked, streamed as the dense GEMV streams a
  weight. A picked expert is read once per row that picks it; at decode that is once. gated_gathered_linear's
  gate/up experts take their activation in the same kernel (a warp per gate row and its up row).
- More rows (a prompt) in float16/bfloat16: experts.cu groups the rows by expert on the GPU and multiplies each
  group by its expert on the tensor cores, each picked expert read once per 64 of its rows. A quantized stack is
  dequantized whole first (quant.cu's dequantize: a prompt's rows pick most experts anyway).
- Anything else (float32 prompts, layouts the kernels do not take) runs the GEMV over every row: each row reads its
  expert's weight, slower but never the [rows, N, K] copy of the picked weights the portable path makes.
- With combine (the weighted sum of each token's k rows, folded into the down projection at export), a decode
  step's rows run gemv.cu's gathered_combine: a block per few outputs of a token, a warp per expert row, the sum in
  the block, so the [k, N] rows never reach memory; a prompt's rows are summed by experts.cu's combine_rows.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.ir.dtypes import DType
from kiln.runtime.backends import composite
from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.array_api.experts import combine_rows as portable_combine_rows
from kiln.runtime.backends.array_api.experts import gathered_linear as portable_gathered_linear
from kiln.runtime.backends.array_api.experts import gathered_quantized_linear as portable_gathered_quantized
from kiln.runtime.backends.array_api.norm import rms_norm_eps
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.linalg import GEMV_ROWS, GEMV_SHARED_MAX, GEMV_WARPS, _gemv_applies, _gemv_split
from kiln.runtime.backends.cuda.kernels.norm import NORM_ROW_MAX, fused_rms_norm_applies
from kiln.runtime.backends.cuda.kernels.quant_linear import QUANT_WARPS, _qgemv_applies, quant_zero_mode
from kiln.runtime.backends.cuda.kernels.registry import (
    CUDA_KERNELS,
    GATE_CODES,
    contiguous,
    grid,
    kernel,
    resident_blocks,
)
from kiln.runtime.backends.cuda.kernels.sort import TOPK_HELD, TOPK_WARPS
from kiln.runtime.backends.cuda.zeroed import zeroed

GATHERED_GEMV_ROWS = 16
"""Rows up to which the gathered GEMV runs (two tokens' top-8); from here on the rows are grouped by expert and
multiplied on the tensor cores (float16/bfloat16), where a 64-row tile of one expert reads its weight once."""

GATHERED_ROW_PIECES = 512
"""A warp of the gathered GEMV takes up to 4 consecutive output rows while they hold at most this many 16-byte
pieces together (gemv.cu's WR: an expert's down projection at K = 768 bfloat16 is 96 pieces a row, so 4 rows), where
the layer's rows are not already shared by several warps."""

EXPERT_TILE_M, EXPERT_TILE_N, EXPERT_TILE_K, EXPERT_MAX = 64, 64, 32, 1024
"""experts.cu's tile sizes and the most experts its plan counts."""

_TENSOR_CORE_TYPES = (np.dtype(np.float16), BFLOAT16)


ROUTE_K_MAX = 32
"""Most experts route_rows picks a token (each lane of the warp keeps one pick)."""


@kernel("route_experts")
def route_experts(logits: Any, k: int, normalize: bool, dtype: DType) -> tuple[Any, Any]:
    """One kernel for the router's softmax, top-k and renormalization; the op's chain of kernels otherwise."""
    n = logits.shape[-1] if logits.ndim else 0
    out_dtype = np.dtype(dtype.numpy)
    if not (logits.ndim and 0 < k <= min(n, ROUTE_K_MAX) and n <= 32 * TOPK_HELD and logits.size
            and contiguous(logits) and nvrtc.supports(logits) and out_dtype in (logits.dtype, np.float32)):
        return composite.route_experts(CUDA_KERNELS.kernels, logits, k, normalize, dtype)
    rows = logits.size // n
    weights = cp.empty(logits.shape[:-1] + (k,), dtype=out_dtype)
    indices = cp.empty(logits.shape[:-1] + (k,), dtype=np.int64)
    nvrtc.function("topk", "route_rows", logits.dtype, TOPK_HELD)(
        (-(-rows // TOPK_WARPS),), (32 * TOPK_WARPS,),
        (logits, weights, indices, np.int64(rows), np.int32(n), np.int32(k), np.int32(normalize),
         np.int32(out_dtype == np.float32)))
    return weights, indices


ROUTE_HELD = 8
"""Logits a lane of gemv.cu's add_rms_norm_route holds in its pick: routers of up to 32 * ROUTE_HELD experts."""


@kernel("add_rms_norm_route_experts")
def add_rms_norm_route_experts(x: Any, residual: Any, norm_weight: Any, weight: Any, bias: Any, axes: int,
                               eps: float | None, k: int, normalize: bool, dtype: DType) -> tuple[Any, Any, Any, Any]:
    """A decode step's MoE norm, router GEMV and pick as gemv.cu's add_rms_norm_route (one kernel); the op's
    composition (add_rms_norm, linear, route_experts) for a prompt's rows and what that kernel does not take."""
    experts, out_dtype = weight.shape[0] if weight.ndim else 0, np.dtype(dtype.numpy)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim else x
    if not (fused_rms_norm_applies(x, residual, norm_weight, axes) and x.size * x.itemsize <= GEMV_SHARED_MAX
            and x.shape[-1] * x.itemsize <= NORM_ROW_MAX and x2.shape[0] <= GEMV_ROWS
            and _gemv_applies(x2, weight, bias) and 0 < k <= min(experts, ROUTE_K_MAX)
            and experts <= 32 * ROUTE_HELD and out_dtype in (x.dtype, np.float32)):
        return composite.add_rms_norm_route_experts(CUDA_KERNELS.kernels, x, residual, norm_weight, weight, bias,
                                                    axes, eps, k, normalize, dtype)
    rows, width = x2.shape
    total, normed = cp.empty_like(x), cp.empty_like(x)
    weights = cp.empty((rows, k), dtype=out_dtype)
    indices = cp.empty((rows, k), dtype=np.int64)
    rounds = -(-width * x.itemsize // (16 * 32 * 2))  # (gemv.cu's GEMV_LOADS = 2 pieces a lane a round)
    nvrtc.function("gemv", "add_rms_norm_route", x.dtype, min(4, 1 << max(0, rounds - 1).bit_length()))(
        (-(-experts // GEMV_WARPS),), (32 * GEMV_WARPS,),
        (x2, residual, x2 if norm_weight is None else norm_weight, total, normed, weight,
         weight if bias is None else bias, cp.empty((rows, experts), dtype=np.float32), weights, indices,
         zeroed(cp, (1,), np.uint32), np.int32(rows), np.int32(experts), np.int32(width), np.int32(k),
         np.int32(normalize), np.int32(out_dtype == np.float32), np.int32(bias is not None),
         np.int32(norm_weight is not None), np.float32(rms_norm_eps(eps, x.dtype))),
        shared_mem=x.size * x.itemsize)
    return total, normed, weights, indices


def _rows(x: Any) -> Any | None:
    """x [S, K] with unit stride along K and 16-byte aligned rows (a view when x is one already, else a copy)."""
    if x.ndim != 2:
        return None
    if not (x.strides[1] == x.itemsize and x.strides[0] % 16 == 0 and x.data.ptr % 16 == 0):
        x = cp.ascontiguousarray(x)
    return x if x.data.ptr % 16 == 0 and (x.shape[1] * x.itemsize) % 16 == 0 else None


def _index(index: Any) -> Any:
    return cp.ascontiguousarray(index.reshape(-1), dtype=np.int64)


def _plan(index: Any, experts: int) -> tuple[Any, Any, int]:
    """(order, tiles, tile count) of experts.cu's expert_plan: the rows grouped by expert, 64 at a time."""
    rows = index.shape[0]
    max_tiles = -(-rows // EXPERT_TILE_M) + min(experts + 1, rows)
    order = cp.empty(rows, dtype=np.int32)
    tiles = cp.empty((max_tiles, 3), dtype=np.int32)
    nvrtc.function("experts", "expert_plan", np.float32)(
        (1,), (1024,), (index, np.int32(rows), np.int32(experts), order, tiles, np.int32(max_tiles)))
    return order, tiles, max_tiles


def _grouped(x2: Any, weight: Any, index: Any, bias: Any) -> Any:
    """x2 [S, K] through its rows' experts, grouped on the tensor cores (experts.cu)."""
    experts, n, k = weight.shape
    order, tiles, max_tiles = _plan(index, experts)
    out = cp.empty((x2.shape[0], n), dtype=x2.dtype)
    nvrtc.function("experts", "expert_gemm", x2.dtype)(
        (-(-n // EXPERT_TILE_N), max_tiles), (128,),
        (x2, np.int64(x2.strides[0] // x2.itemsize), weight, weight if bias is None else bias, order, tiles, out,
         np.int32(n), np.int32(k), np.int32(experts), np.int32(bias is not None)))
    return out


def _grouped_applies(x2: Any, weight: Any) -> bool:
    return (x2.dtype in _TENSOR_CORE_TYPES and weight.shape[0] <= EXPERT_MAX
            and weight.shape[2] % EXPERT_TILE_K == 0 and weight.data.ptr % 16 == 0)


def _log2_rows_per_warp(n: int, k: int, itemsize: int) -> int:
    """log2 of the consecutive output rows a warp of the gathered GEMV takes (gemv.cu's WR: up to 4, while they hold
    at most GATHERED_ROW_PIECES 16-byte pieces together and divide N)."""
    pieces, log2 = k * itemsize // 16, 0
    while log2 < 2 and n % (2 << log2) == 0 and (2 << log2) * pieces <= GATHERED_ROW_PIECES:
        log2 += 1
    return log2


def _capped(blocks: int, rows: int, function: Any) -> int:
    """The gathered GEMVs' blocks per input row: all `blocks` where the GPU holds them at once with the other rows',
    else as many as it holds (each warp then loops over outputs, its next loads issued before it finishes one: a
    last partial wave of blocks would start its weight stream only when the wave before it ended)."""
    return max(1, min(blocks, resident_blocks(function, 0, 32 * GEMV_WARPS) // rows))


def _gathered_gemv(x2: Any, weight: Any, index: Any, bias: Any, activation: str = "") -> Any:
    """Each row of x2 through its expert by gemv.cu's gathered_gemv (a warp per output row of the picked expert);
    with an activation the gated form (a warp per gate row and its up row, act(gate) * up out: [rows, N / 2])."""
    experts, n, k = weight.shape
    if activation:
        n //= 2
        mode, outputs_per_block = GATE_CODES[activation] << 4, GEMV_WARPS
    else:
        log2_split = _gemv_split(n, k, x2.itemsize)
        log2_rows = 0 if log2_split else _log2_rows_per_warp(n, k, x2.itemsize)
        mode, outputs_per_block = log2_split | log2_rows << 2, (GEMV_WARPS >> log2_split) << log2_rows
    out = cp.empty((x2.shape[0], n), dtype=x2.dtype)
    function = nvrtc.function("gemv", "gathered_gemv", x2.dtype, mode)
    function(
        (_capped(-(-n // outputs_per_block), x2.shape[0], function), x2.shape[0]), (32 * GEMV_WARPS,),
        (x2, np.int64(x2.strides[0] // x2.itemsize), index, weight, weight if bias is None else bias, out,
         np.int32(n), np.int32(k), np.int32(experts), np.int32(bias is not None)))
    return out


def _combine(rows: Any, combine: Any) -> Any:
    """experts.cu's combine_rows: each token's k rows weighted and summed (the op's combine)."""
    if combine is None:
        return rows
    tokens, k = combine.shape
    n = rows.shape[1]
    if not (nvrtc.supports(rows, combine) and contiguous(rows, combine) and (n * rows.itemsize) % 16 == 0
            and rows.data.ptr % 16 == 0):
        return portable_combine_rows(cp, rows, combine)
    out = cp.empty((tokens, n), dtype=rows.dtype)
    pieces = tokens * (n * rows.itemsize // 16)
    nvrtc.function("experts", "combine_rows", rows.dtype)(
        grid(pieces), (256,), (rows, combine, out, np.int64(tokens), np.int32(n), np.int32(k)))
    return out


def _gathered_combine(x2: Any, weight: Any, index: Any, bias: Any, combine: Any) -> Any | None:
    """gemv.cu's gathered_combine for a few tokens' rows, or None where it does not apply."""
    experts, n, k = weight.shape
    tokens, topk = combine.shape
    if not (topk <= ROUTE_K_MAX and nvrtc.supports(x2, combine) and contiguous(combine)):
        return None
    log2_rows = _log2_rows_per_warp(n, k, x2.itemsize)
    out = cp.empty((tokens, n), dtype=x2.dtype)
    function = nvrtc.function("gemv", "gathered_combine", x2.dtype, log2_rows)
    function(
        (_capped(n >> log2_rows, tokens, function), tokens), (32 * GEMV_WARPS,),
        (x2, np.int64(x2.strides[0] // x2.itemsize), index, weight, weight if bias is None else bias, combine, out,
         np.int32(n), np.int32(k), np.int32(experts), np.int32(topk), np.int32(bias is not None)))
    return out


def _gemv_takes(x2: Any | None, weight: Any, index: Any, bias: Any) -> bool:
    """What gemv.cu's gathered kernels read 16 bytes at a time: rows of x (_rows), an index per row, a contiguous
    [E, N, K] stack (and bias) of x's storage type with K a multiple of 16 bytes and the stack aligned."""
    extra = () if bias is None else (bias,)
    return bool(x2 is not None and x2.shape[0] and index.size == x2.shape[0] and weight.ndim == 3
                and nvrtc.supports(x2, weight, *extra) and contiguous(weight, *extra)
                and not weight.shape[2] % (16 // weight.itemsize) and not weight.data.ptr % 16)


@kernel("gathered_linear")
def gathered_linear(x: Any, weight: Any, index: Any, bias: Any = None, combine: Any = None) -> Any:
    x2 = _rows(x)
    if not _gemv_takes(x2, weight, index, bias):
        return portable_gathered_linear(cp, x, weight, index, bias, combine)
    index = _index(index)
    if x2.shape[0] > GATHERED_GEMV_ROWS and _grouped_applies(x2, weight):
        return _combine(_grouped(x2, weight, index, bias), combine)
    if combine is not None and (out := _gathered_combine(x2, weight, index, bias, combine)) is not None:
        return out
    return _combine(_gathered_gemv(x2, weight, index, bias), combine)


@kernel("gated_gathered_linear")
def gated_gathered_linear(x: Any, weight: Any, index: Any, bias: Any = None, *, activation: str) -> Any:
    """A decode step's gate/up experts and their activation by the gated gathered GEMV; the composition (gathered
    linear, then gated_activation) for a prompt's rows and whatever the GEMV does not take."""
    x2 = _rows(x)
    if not (_gemv_takes(x2, weight, index, bias) and x2.shape[0] <= GATHERED_GEMV_ROWS
            and weight.shape[1] % 2 == 0 and activation in GATE_CODES):
        return composite.gated_gathered_linear(CUDA_KERNELS.kernels, x, weight, index, bias, activation)
    return _gathered_gemv(x2, weight, _index(index), bias, activation)


@kernel("gathered_quantized_linear")
def gathered_quantized_linear(x: Any, q: Any, scale: Any, zero: Any, index: Any, bias: Any = None,
                              combine: Any = None, *, bits: int, group_size: int, offset: bool = False) -> Any:
    experts, n = q.shape[:2]
    k = x.shape[-1]
    parts = (scale,) + tuple(a for a in (zero, bias) if a is not None)
    x2 = _rows(x)
    if (x2 is None or not x2.shape[0] or index.size != x2.shape[0] or not nvrtc.supports(x2, *parts)
            or not contiguous(q, *parts) or not _qgemv_applies(x2, q, bits, group_size)):
        return portable_gathered_quantized(cp, x, q, scale, zero, index, bias, combine, bits=bits,
                                           group_size=group_size, offset=offset)
    x2, index = cp.ascontiguousarray(x2), _index(index)  # (gathered_qgemv reads rows K apart)
    zero_mode = quant_zero_mode(zero, offset)
    if x2.shape[0] > GATHERED_GEMV_ROWS and x2.dtype in _TENSOR_CORE_TYPES and experts <= EXPERT_MAX \
            and k % EXPERT_TILE_K == 0:
        weight = cp.empty((experts, n, k), dtype=x2.dtype)  # every expert: a prompt's rows pick most of them
        nvrtc.function("quant", "dequantize", x2.dtype)(
            grid(experts * n * k), (256,), (q, scale, zero if zero is not None else scale, weight,
                                            np.int64(experts * n), np.int32(k), np.int32(bits),
                                            np.int32(group_size), zero_mode))
        return _combine(_grouped(x2, weight, index, bias), combine)
    out = cp.empty((x2.shape[0], n), dtype=x2.dtype)
    nvrtc.function("quant", "gathered_qgemv", x2.dtype, bits)(
        (-(-n // QUANT_WARPS), x2.shape[0]), (32 * QUANT_WARPS,),
        (x2, index, q, scale, zero if zero is not None else scale, bias if bias is not None else scale, out,
         np.int32(n), np.int32(k), np.int32(group_size), zero_mode, np.int32(bias is not None),
         np.int32(experts)))
    return _combine(out, combine)
