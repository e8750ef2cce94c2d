"""The CPU's sum and mean: float32 reductions over an array's trailing dims (a global average pool, a pooling sum)
by one compiled call (kiln_sum_rows_f32), the portable NumPy reductions for everything else. NumPy's `mean` over a
7x7 map cost ~25 us a call, almost all of it per-call overhead; the native executor runs the same helper, so the
two paths agree to the bit."""

from __future__ import annotations

import math

import numpy as np

from kiln.runtime.backends.array_api import PORTABLE
from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.registry import kernel


def _axes(rank: int, dims: tuple[int, ...]) -> list[int]:
    """The reduced axes, sorted (empty dims: all)."""
    return sorted({d % rank for d in dims}) if dims and rank else list(range(rank))


def trailing_rows(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, int] | None:
    """(rows, n) when reducing `dims` of `shape` (empty: all) sums the last dims of a C-contiguous array, rows of n
    elements each; None when the dims are not a trailing run."""
    rank = len(shape)
    axes = _axes(rank, dims)
    if axes != list(range(rank - len(axes), rank)):
        return None
    n = math.prod(shape[rank - len(axes):])
    return math.prod(shape) // n if n else 0, n


def reduced_shape(shape: tuple[int, ...], dims: tuple[int, ...], keepdim: bool) -> tuple[int, ...]:
    axes = set(_axes(len(shape), dims))
    return tuple(1 if i in axes else s for i, s in enumerate(shape) if keepdim or i not in axes)


def _reduction(name: str, mean: bool):
    portable = PORTABLE.kernels[name]

    def run(x: np.ndarray, dims: tuple[int, ...], keepdim: bool) -> np.ndarray:
        lib = native.library()
        shape = trailing_rows(x.shape, tuple(dims)) if lib is not None and x.dtype == np.float32 else None
        if shape is None or shape[1] == 0:
            return portable(np, x, dims, keepdim)
        rows, n = shape
        x = np.ascontiguousarray(x)
        out = np.empty(reduced_shape(x.shape, tuple(dims), keepdim), np.float32)
        lib.kiln_sum_rows_f32(x.ctypes.data, out.ctypes.data, rows, n, float(n) if mean else 1.0)
        return out
    run.__name__ = name
    return run


for _name in ("sum", "mean"):
    kernel(_name)(_reduction(_name, _name == "mean"))
