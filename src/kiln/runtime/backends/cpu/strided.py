"""The strided window kernel (as_strided, diagonal, unfold): a read-only NumPy view, bounds-checked first."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import kernel


@kernel("as_strided")
def as_strided(x: np.ndarray, size, stride, offset: int) -> np.ndarray:
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or min(size + stride + (offset,), default=0) < 0:
        raise ValueError(f"as_strided: bad window size={list(size)} stride={list(stride)} offset={offset}")
    if 0 in size:
        return np.empty(size, x.dtype)
    flat = np.ascontiguousarray(x).reshape(-1)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= flat.size:
        raise ValueError(f"as_strided: window reaches element {last} of an input of {flat.size}")
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=[s * flat.itemsize for s in stride],
                                           writeable=False)
