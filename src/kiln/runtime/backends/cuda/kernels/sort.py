"""topk on the GPU for short rows (topk.cu: a warp per row), what a mixture-of-experts router does every token of
every layer (k of E <= 1024 experts); longer rows, other dims and integer types take the portable kernel, which
sorts."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import sort as portable
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.registry import contiguous, kernel

TOPK_ROW_MAX, TOPK_WARPS, TOPK_HELD = 1024, 8, 8
"""Longest row topk.cu takes (a lane's taken-bits are one 32-bit word), its rows per block, and the keys a lane
holds in registers for rows up to 32 * TOPK_HELD elements (read once; longer rows are read again each round: at
128 elements and k = 8 on the H100 that version took 11.7 us, each round a trip to memory)."""


@kernel("topk")
def topk(x: Any, k: int, dim: int, largest: bool) -> tuple[Any, Any]:
    if not (x.ndim and dim % x.ndim == x.ndim - 1 and 0 < k <= x.shape[-1] <= TOPK_ROW_MAX and x.size
            and contiguous(x) and nvrtc.supports(x)):
        return portable.topk(cp, x, k, dim, largest)
    n = x.shape[-1]
    rows = x.size // n
    values = cp.empty(x.shape[:-1] + (k,), dtype=x.dtype)
    indices = cp.empty(x.shape[:-1] + (k,), dtype=np.int64)
    held = TOPK_HELD if n <= 32 * TOPK_HELD else 0
    nvrtc.function("topk", "topk_rows", x.dtype, held)(
        (-(-rows // TOPK_WARPS),), (32 * TOPK_WARPS,),
        (x, values, indices, np.int64(rows), np.int32(n), np.int32(k), np.int32(largest)))
    return values, indices
