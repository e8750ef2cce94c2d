"""RMSNorm on the GPU: one fused kernel per row for the last dim (fused.cu), CuPy otherwise. LayerNorm and the
other normalizations are portable."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import upcast
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.registry import contiguous, kernel


@kernel("rms_norm")
def rms_norm(x: Any, weight: Any, axes: int, eps: float | None) -> Any:
    dtype = x.dtype
    if eps is None:
        eps = float(np.finfo(dtype).eps)
    d = x.shape[-1] if x.ndim else 1
    extra = () if weight is None else (weight,)
    if axes == 1 and x.ndim and x.size and contiguous(x, *extra) and nvrtc.supports(x, *extra) and (
            weight is None or weight.size == d):
        out = cp.empty_like(x)
        block = min(1024, 32 * ((d + 31) // 32))
        args = (x, x if weight is None else weight, out, np.int32(d), np.float32(eps), np.int32(weight is not None))
        nvrtc.function("fused", "rms_norm", dtype)((x.size // d,), (block,), args)
        return out
    xf, weight = upcast(x, weight)
    dims = tuple(range(x.ndim - axes, x.ndim))
    out = xf * (1 / cp.sqrt(cp.mean(xf * xf, axis=dims, keepdims=True) + xf.dtype.type(eps)))
    if weight is not None:
        out = out * weight
    return out.astype(dtype, copy=False)
