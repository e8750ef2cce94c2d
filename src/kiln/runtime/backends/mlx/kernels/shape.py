"""Shape, view and creation kernels. MLX slices and transposes are views; creation ops whose values depend only on
their attributes are computed with NumPy while the method is traced and enter the graph as constants (exactly as
the op defines them: arange_float in float64 on every device, which Apple GPUs lack)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kiln.runtime.backends.mlx.arrays import to_mlx
from kiln.runtime.backends.mlx.registry import kernel


@kernel("reshape")
def reshape(x: mx.array, shape: Any) -> mx.array:
    return x.reshape(tuple(shape))


@kernel("permute")
def permute(x: mx.array, perm: Any) -> mx.array:
    return mx.transpose(x, tuple(perm))


@kernel("expand")
def expand(x: mx.array, shape: Any) -> mx.array:
    return mx.broadcast_to(x, tuple(shape))


def along(dim: int, key: Any) -> tuple:
    """An indexing key that applies `key` at dim and takes everything elsewhere."""
    return (slice(None),) * dim + (key,)


@kernel("slice")
def slice_(x: mx.array, dim: int, start: int, end: int, step: int) -> mx.array:
    return x[along(dim, slice(start, end, step))]


@kernel("cat")
def cat(*xs: mx.array, dim: int) -> mx.array:
    return mx.concatenate(list(xs), axis=dim)


@kernel("flip")
def flip(x: mx.array, dims: Any) -> mx.array:
    return mx.flip(x, axis=list(dims)) if len(dims) else x


@kernel("copy")
def copy(x: mx.array) -> mx.array:
    """A new array object: MLX arrays are values, so there is nothing to copy, but kernels that update in place
    (index_put) must not rebind the object they were given."""
    return mx.array(x)


@kernel("pad")
def pad(x: mx.array, pads: Any, mode: str, value: float) -> mx.array:
    widths = [(0, 0)] * x.ndim
    for i in range(len(pads) // 2):
        widths[x.ndim - 1 - i] = (pads[2 * i], pads[2 * i + 1])
    x = x[tuple(slice(max(-b, 0), x.shape[d] - max(-a, 0)) for d, (b, a) in enumerate(widths))]  # negative: crop
    widths = [(max(b, 0), max(a, 0)) for b, a in widths]
    if mode == "constant":
        return mx.pad(x, widths, constant_values=mx.array(value, dtype=x.dtype))
    if mode == "replicate":
        return mx.pad(x, widths, mode="edge")
    for d, (before, after) in enumerate(widths):  # reflect: gather the mirrored positions, axis by axis
        if before or after:
            n = x.shape[d]
            positions = np.abs(np.arange(-before, n + after))
            positions = np.where(positions >= n, 2 * (n - 1) - positions, positions)
            x = mx.take(x, mx.array(positions.astype(np.int32)), axis=d)
    return x


@kernel("tril")
def tril(x: mx.array, diagonal: int) -> mx.array:
    keep = np.tri(x.shape[-2], x.shape[-1], diagonal, dtype=bool)
    return mx.where(mx.array(keep), x, mx.zeros((), dtype=x.dtype))


@kernel("triu")
def triu(x: mx.array, diagonal: int) -> mx.array:
    keep = ~np.tri(x.shape[-2], x.shape[-1], diagonal - 1, dtype=bool)
    return mx.where(mx.array(keep), x, mx.zeros((), dtype=x.dtype))


@kernel("as_strided")
def as_strided(x: mx.array, size: Any, stride: Any, offset: int) -> mx.array:
    """A strided window over x's elements in row-major order (MLX reads a non-contiguous x as if it were), checked
    to stay inside x."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or min(size + stride + (offset,), default=0) < 0:
        raise ValueError(f"as_strided: bad window size={list(size)} stride={list(stride)} offset={offset}")
    if 0 in size:
        return mx.zeros(size, dtype=x.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= x.size:
        raise ValueError(f"as_strided: window reaches element {last} of an input of {x.size}")
    return mx.as_strided(mx.contiguous(x), size, stride, offset)


# ---- creation: values known from the attributes alone ----
@kernel("arange")
def arange(start: int, end: int, step: int, dtype: Any) -> mx.array:
    return to_mlx(np.arange(start, end, step, dtype=np.int64).astype(dtype.numpy))


@kernel("arange_float")
def arange_float(start: float, end: float, step: float, dtype: Any, length: int) -> mx.array:
    return to_mlx((start + np.arange(length, dtype=np.float64) * step).astype(dtype.numpy))


@kernel("full")
def full(shape: Any, value: float, dtype: Any) -> mx.array:
    return mx.full(tuple(shape), to_mlx(np.array(value).astype(dtype.numpy)))
