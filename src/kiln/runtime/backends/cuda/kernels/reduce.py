"""Softmax on the GPU: one kernel over contiguous rows when it runs over the last dim (softmax.cu: a warp per row
up to ROW_WARP_MAX elements, a block per row beyond), where the portable kernel makes four passes (max, exp, sum,
divide) plus the float32 round trip of half inputs."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import reduce as portable
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.registry import ROW_WARP_MAX, ROWS_PER_BLOCK, contiguous, kernel


@kernel("softmax")
def softmax(x: Any, dim: int) -> Any:
    if not (x.ndim and x.size and dim % x.ndim == x.ndim - 1 and contiguous(x) and nvrtc.supports(x)):
        return portable.softmax(cp, x, dim)
    d = x.shape[-1]
    out, rows = cp.empty_like(x), x.size // d
    if d <= ROW_WARP_MAX:
        nvrtc.function("softmax", "softmax_warp", x.dtype)((-(-rows // ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,),
                                                            (x, out, np.int64(rows), np.int32(d)))
    else:
        nvrtc.function("softmax", "softmax_rows", x.dtype)((rows,), (min(1024, 32 * ((d + 31) // 32)),),
                                                            (x, out, np.int32(d)))
    return out
