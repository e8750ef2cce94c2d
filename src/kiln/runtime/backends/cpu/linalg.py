"""Matrix products. BLAS does the work; weights are read transposed in place, never copied."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel, upcast


@kernel("matmul")
def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype in LOW_PRECISION:
        return np.matmul(*upcast(a, b)).astype(a.dtype)
    return np.matmul(a, b)


@kernel("linear")
def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    dtype = x.dtype
    x, weight, bias = upcast(x, weight, bias)
    lead = x.shape[:-1]
    out = np.matmul(x.reshape(-1, x.shape[-1]), weight.T) if x.ndim > 2 else np.matmul(x, weight.T)
    if bias is not None:
        out += bias
    return out.reshape(*lead, weight.shape[0]).astype(dtype, copy=False)
