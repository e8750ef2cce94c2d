"""The CPU kernel table, and helpers shared by the kernel families."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from kiln.runtime.backends.base import KernelRegistry

CPU_KERNELS = KernelRegistry("cpu")
kernel = CPU_KERNELS.register

LOW_PRECISION = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def in_float32(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """Run `fn` in float32 for float16/bfloat16 inputs and round the result back, as PyTorch's CPU kernels do."""
    def wrapped(x: np.ndarray, *args, **kwargs):
        if x.dtype in LOW_PRECISION:
            return np.asarray(fn(x.astype(np.float32), *args, **kwargs)).astype(x.dtype)
        return fn(x, *args, **kwargs)
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def upcast(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """float16/bfloat16 arrays as float32 (for accumulation); others unchanged."""
    return tuple(a.astype(np.float32) if a is not None and a.dtype in LOW_PRECISION else a for a in arrays)
