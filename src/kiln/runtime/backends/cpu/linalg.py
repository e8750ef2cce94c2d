"""Matrix products. BLAS does the work for many rows; a compiled helper streams the weight once for few rows (a
decode step); weights are read transposed in place, never copied."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu import forms, native
from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel, upcast


@kernel("matmul")
def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype in LOW_PRECISION:
        return np.matmul(*upcast(a, b)).astype(a.dtype)
    return np.matmul(a, b)


FEW_ROWS = 8
"""Up to this many rows the compiled helper runs (kiln_linear_rows_f32: the weight read from memory once for all
rows, a chunk of it kept in L2 while blocks of 8 rows read it; split over threads); above, the GEMM with the weight
packed once. SmolLM2's layers on a 2-core AVX-512 machine: 4 rows of its LM head in 5.6 ms where OpenBLAS's SGEMM
takes 9.6 (it packs the whole weight per call). MiniLM's and SmolLM2's layers with weights from DRAM, 1 thread:
the helper ahead at 8 rows (198-343 us against 258-380), even at 12, the packed GEMM 15-40% ahead at 16 rows
(252-374 us against 295-525)."""


@kernel("linear")
def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x @ W^T + b. Few rows: the compiled helper, whose sums do not depend on the batch (a sequence decodes the
    same alone and batched). Many rows: (W x^T)^T by the GEMM with W packed once (gemm.c: 8-20% faster than
    OpenBLAS's W @ x^T on SmolLM2's and MiniLM's layers at 32-128 rows, which packs W on every call; OpenBLAS's
    x @ W^T is 10-60% slower still), writing x's rows of outputs with the bias added from its registers."""
    dtype = x.dtype
    x, weight, bias = upcast(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape[0], weight.shape[0]
    lib = native.library()
    compiled = lib is not None and native.float32_contiguous(weight, bias) and x2.dtype == np.float32
    if compiled and rows <= FEW_ROWS:
        x2 = np.ascontiguousarray(x2)
        out = np.empty((rows, cols), dtype=np.float32)
        lib.kiln_linear_rows_f32(x2.ctypes.data, weight.ctypes.data, native.address(bias), out.ctypes.data, rows,
                                 cols, x2.shape[1], native.threads())
    elif compiled and rows > 1:
        x2 = x2 if x2.strides[-1] == 4 else np.ascontiguousarray(x2)
        out = np.empty((rows, cols), dtype=np.float32)
        native.gemm_packed(forms.packed_gemm_weight(weight), cols, x2, out, bias, b_rows=True, out_rows=True)
    else:
        out = np.matmul(x2, weight.T)
        if bias is not None:
            out += bias
    return out.reshape(*lead, cols).astype(dtype, copy=False)
