"""Sorting and searching: sort, topk, searchsorted, nonzero_static. Orders follow PyTorch: stable, NaN above
+inf, ties broken by position (MLX's argsort is stable and puts NaN last). Nothing reads values back to the host
(fixed iteration counts, no data-dependent shapes), so a method that sorts still compiles."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kiln.runtime.backends.mlx.arrays import is_float, mx_dtype
from kiln.runtime.backends.mlx.kernels.shape import along
from kiln.runtime.backends.mlx.registry import kernel, upcast


def order(x: mx.array, dim: int, descending: bool) -> mx.array:
    """Stable argsort along dim (int64); descending keeps equal elements in their original order, NaN first."""
    (x,) = upcast(x)  # float16/bfloat16 widen exactly
    if not descending:
        return mx.argsort(x, axis=dim).astype(mx.int64)
    idx = mx.argsort(mx.flip(x, axis=dim), axis=dim).astype(mx.int64)
    return mx.flip(x.shape[dim] - 1 - idx, axis=dim)


@kernel("sort")
def sort(x: mx.array, dim: int, descending: bool) -> tuple[mx.array, mx.array]:
    if x.ndim == 0:
        return mx.array(x), mx.zeros((), dtype=mx.int64)
    idx = order(x, dim, descending)
    return mx.take_along_axis(x, idx, axis=dim), idx


@kernel("topk")
def topk(x: mx.array, k: int, dim: int, largest: bool) -> tuple[mx.array, mx.array]:
    if x.ndim == 0:
        return mx.array(x), mx.zeros((), dtype=mx.int64)
    n = x.shape[dim]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} is outside [0, {n}] for dim {dim} of shape {list(x.shape)}")
    idx = order(x, dim, largest)[along(dim, slice(0, k))]
    return mx.take_along_axis(x, idx, axis=dim), idx


def binary_search(seq: mx.array, values: mx.array, right: bool) -> mx.array:
    """PyTorch's lower/upper bound loop, vectorized over values: the fixed number of halvings a search over seq's
    length needs (finished searches stay put), exact even where NaN makes seq unordered."""
    n = seq.shape[-1]
    lo = mx.zeros(values.shape, dtype=mx.int64)
    hi = mx.full(values.shape, n, dtype=mx.int64)
    for _ in range(n.bit_length() + 1):
        active = lo < hi
        mid = mx.minimum((lo + hi) // 2, n - 1)  # (mid is only clipped where lo == hi, inactive)
        mid_val = mx.take(seq, mid) if seq.ndim == 1 else mx.take_along_axis(seq, mid, axis=-1)
        go_right = ~(mid_val > values) if right else ~(mid_val >= values)
        lo = mx.where(active & go_right, mid + 1, lo)
        hi = mx.where(active & ~go_right, mid, hi)
    return lo


@kernel("searchsorted")
def searchsorted(sorted: mx.array, values: mx.array, right: bool, dtype: Any) -> mx.array:  # noqa: A002
    seq, vals = upcast(sorted, values)
    if seq.shape[-1] == 0:
        return mx.zeros(vals.shape, dtype=mx_dtype(dtype))
    return binary_search(seq, vals, right).astype(mx_dtype(dtype))


@kernel("nonzero_static")
def nonzero_static(x: mx.array, size: int, fill_value: int) -> mx.array:
    """The coordinates of the first `size` nonzero elements (row-major), padded with fill_value: each nonzero
    element's coordinates go to the row its running count names, the rest to a spare row that is dropped."""
    if x.ndim == 0:
        return mx.full((size, 0), fill_value, dtype=mx.int64)
    found = (x != 0).reshape(-1) if is_float(x) or x.dtype != mx.bool_ else x.reshape(-1)
    row = mx.where(found, mx.cumsum(found.astype(mx.int64)) - 1, size)
    row = mx.where(row < size, row, size)
    flat = mx.arange(x.size, dtype=mx.int64)
    coords = []
    for extent in reversed(x.shape):
        coords.append(flat % extent)
        flat = flat // extent
    coords = mx.stack(coords[::-1], axis=1)
    out = mx.full((size + 1, x.ndim), fill_value, dtype=mx.int64)
    out[row] = coords
    return out[:size]
