"""RMSNorm (alone or after a residual add) and LayerNorm on the GPU: fused kernels over the normalized dims
(fused.cu; LayerNorm gives rows of up to ROW_WARP_MAX elements a warp each, longer rows a block) where x and the
affine parameters are contiguous in one storage type; the portable kernels otherwise. The other normalizations
are portable."""

from __future__ import annotations

import math
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import norm as portable
from kiln.runtime.backends.array_api import upcast
from kiln.runtime.backends.array_api.norm import rms_norm_eps
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.registry import ROW_WARP_MAX, ROWS_PER_BLOCK, contiguous, kernel


def fused_rms_norm_applies(x: Any, residual: Any, weight: Any, axes: int) -> bool:
    """What the fused RMSNorm kernels take (fused.cu's rms_norm, gemv.cu's norm prologue): over the last dim, x,
    residual and weight contiguous in one storage type, the residual of x's shape, the weight one per element."""
    extra = tuple(a for a in (residual, weight) if a is not None)
    return bool(axes == 1 and x.ndim and x.size and contiguous(x, *extra) and nvrtc.supports(x, *extra)
                and (weight is None or weight.size == x.shape[-1]) and (residual is None or residual.shape == x.shape))


NORM_ROW_MAX = 16 * 1024
"""Bytes of a row gemv.cu's add_rms_norm_rows holds (GEMV_NORM_PIECES 16-byte pieces for each of a block's
threads): its add_rms_norm_row kernel and the norm-prologue GEMVs (linalg, experts) take rows up to this."""

NORM_ROW_THREADS = 256  # gemv.cu's GEMV_WARPS warps

ADD_RMS_NORM_ROW = True
"""Whether add_rms_norm runs gemv.cu's add_rms_norm_row where it applies (benchmarks' A/B: False keeps fused.cu's
rms_norm)."""


def _add_rms_norm_row_applies(x: Any, residual: Any, weight: Any) -> bool:
    """Whether gemv.cu's add_rms_norm_row takes these (fused_rms_norm_applies already holds): whole 16-byte pieces
    of a row of at most NORM_ROW_MAX bytes, every operand 16-byte aligned."""
    row_bytes = x.shape[-1] * x.itemsize
    return (residual is not None and row_bytes % 16 == 0 and row_bytes <= NORM_ROW_MAX
            and all(a.data.ptr % 16 == 0 for a in (x, residual, weight) if a is not None))


def _rms_norm_fused(x: Any, residual: Any, weight: Any, axes: int, eps: float | None) -> tuple[Any, Any] | None:
    """gemv.cu's add_rms_norm_row where it applies (a residual, vector rows), else fused.cu's rms_norm (a block per
    row, the residual added first when given): (sum, normalized), or None for what neither takes."""
    if not fused_rms_norm_applies(x, residual, weight, axes):
        return None
    d = x.shape[-1]
    eps = rms_norm_eps(eps, x.dtype)
    out = cp.empty_like(x)
    total = x if residual is None else cp.empty_like(x)
    if ADD_RMS_NORM_ROW and _add_rms_norm_row_applies(x, residual, weight):
        nvrtc.function("gemv", "add_rms_norm_row", x.dtype)(
            (x.size // d,), (NORM_ROW_THREADS,),
            (x, residual, x if weight is None else weight, total, out, np.int32(d), np.float32(eps),
             np.int32(weight is not None)))
        return total, out
    block = min(1024, 32 * ((d + 31) // 32))
    args = (x, x if residual is None else residual, x if weight is None else weight, total, out, np.int32(d),
            np.float32(eps), np.int32(weight is not None), np.int32(residual is not None))
    nvrtc.function("fused", "rms_norm", x.dtype)((x.size // d,), (block,), args)
    return total, out


@kernel("rms_norm")
def rms_norm(x: Any, weight: Any, axes: int, eps: float | None) -> Any:
    fused = _rms_norm_fused(x, None, weight, axes, eps)
    if fused is not None:
        return fused[1]
    dtype = x.dtype
    eps = rms_norm_eps(eps, dtype)
    xf, weight = upcast(x, weight)
    dims = tuple(range(x.ndim - axes, x.ndim))
    out = xf * (1 / cp.sqrt(cp.mean(xf * xf, axis=dims, keepdims=True) + xf.dtype.type(eps)))
    if weight is not None:
        out = out * weight
    return out.astype(dtype, copy=False)


@kernel("add_rms_norm")
def add_rms_norm(x: Any, residual: Any, weight: Any, axes: int, eps: float | None) -> tuple[Any, Any]:
    """The residual add and the RMSNorm after it in one kernel (one launch less per norm of a decode step)."""
    fused = _rms_norm_fused(x, residual, weight, axes, eps)
    if fused is not None:
        return fused
    total = x + residual
    return total, rms_norm(total, weight, axes, eps)


@kernel("layer_norm")
def layer_norm(x: Any, weight: Any, bias: Any, axes: int, eps: float) -> Any:
    d = math.prod(x.shape[x.ndim - axes:])
    affine = tuple(a for a in (weight, bias) if a is not None)
    if not (x.ndim and x.size and d and contiguous(x, *affine) and nvrtc.supports(x, *affine)
            and all(a.size == d for a in affine)):
        return portable.layer_norm(cp, x, weight, bias, axes, eps)
    out, rows = cp.empty_like(x), x.size // d
    w, b = x if weight is None else weight, x if bias is None else bias
    flags = (np.float32(eps), np.int32(weight is not None), np.int32(bias is not None))
    if d <= ROW_WARP_MAX:
        nvrtc.function("fused", "layer_norm_warp", x.dtype)(
            (-(-rows // ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,), (x, w, b, out, np.int64(rows), np.int32(d), *flags))
    else:
        nvrtc.function("fused", "layer_norm", x.dtype)(
            (rows,), (min(1024, 32 * ((d + 31) // 32)),), (x, w, b, out, np.int32(d), *flags))
    return out
