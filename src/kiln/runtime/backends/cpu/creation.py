"""Creation kernels: tensors made from attributes alone."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import kernel


@kernel("arange")
def arange(start: int, end: int, step: int, dtype) -> np.ndarray:
    return np.arange(start, end, step, dtype=np.int64).astype(dtype.numpy, copy=False)


@kernel("arange_float")
def arange_float(start: float, end: float, step: float, dtype, length: int) -> np.ndarray:
    return (start + np.arange(length, dtype=np.float64) * step).astype(dtype.numpy)


@kernel("full")
def full(shape, value: float, dtype) -> np.ndarray:
    return np.full(shape, value, dtype=dtype.numpy)
