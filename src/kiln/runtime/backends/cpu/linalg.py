"""Matrix products. BLAS does the work; weights are read transposed in place, never copied."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel, upcast


@kernel("matmul")
def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype in LOW_PRECISION:
        return np.matmul(*upcast(a, b)).astype(a.dtype)
    return np.matmul(a, b)


@kernel("linear")
def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x @ W^T + b, computed as (W @ x^T)^T: OpenBLAS multiplies W @ x^T as fast as PyTorch's MKL for every batch
    size here, while x @ W^T is 10-60% slower (measured on MiniLM's 16- and 128-row layers); the compiled helper
    brings the result back to row-major with the bias added in the same pass."""
    dtype = x.dtype
    x, weight, bias = upcast(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape[0], weight.shape[0]
    lib = native.library()
    if lib is not None and rows > 1 and native.float32_contiguous(weight, bias) and x2.dtype == np.float32:
        transposed = np.matmul(weight, x2.T)  # [cols, rows], C-contiguous
        out = np.empty((rows, cols), dtype=np.float32)
        lib.kiln_transpose_bias_f32(transposed.ctypes.data, native.address(bias), out.ctypes.data, rows, cols)
    else:
        out = np.matmul(x2, weight.T)
        if bias is not None:
            out += bias
    return out.reshape(*lead, cols).astype(dtype, copy=False)
