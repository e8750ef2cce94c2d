"""The CPU kernel table, and helpers shared by the kernel families."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kiln.runtime.backends.array_api import LOW_PRECISION, upcast
from kiln.runtime.backends.base import KernelRegistry

CPU_KERNELS = KernelRegistry("cpu")
"""The CPU's own kernels (compiled fast paths, functions NumPy lacks); kiln.runtime.backends.cpu adds the portable
kernels for every other op once the families are imported."""
kernel = CPU_KERNELS.register


def in_float32(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """Run `fn` in float32 for float16/bfloat16 inputs and round the result back, as PyTorch's CPU kernels do."""
    def wrapped(x: np.ndarray, *args, **kwargs):
        if x.dtype in LOW_PRECISION:
            return np.asarray(fn(x.astype(np.float32), *args, **kwargs)).astype(x.dtype)
        return fn(x, *args, **kwargs)
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


__all__ = ["CPU_KERNELS", "LOW_PRECISION", "in_float32", "kernel", "upcast"]
