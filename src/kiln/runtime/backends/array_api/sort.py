"""Sorting and searching kernels for both backends: sort, topk, searchsorted, nonzero_static.

Orders follow PyTorch: stable, NaN above +inf, ties broken by position. Nothing here reads values back to the host
(fixed iteration counts, no data-dependent shapes), so a GPU method that sorts can still be captured.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import LOW_PRECISION, portable

TOPK_PARTITION_MIN = 4096
"""From this many elements along dim (and k at most 1/16 of them), topk partitions before it sorts."""


def _comparable(x: Any) -> Any:
    """x in a dtype the array module sorts natively with the same order (float16/bfloat16 widen exactly)."""
    return x.astype(np.float32) if x.dtype in LOW_PRECISION else x


def order(xp: Any, x: Any, dim: int, descending: bool) -> Any:
    """Stable argsort along dim; descending keeps equal elements in their original order and puts NaN first."""
    x = _comparable(x)
    if not descending:
        return xp.argsort(x, axis=dim, kind="stable")
    idx = xp.argsort(xp.flip(x, axis=dim), axis=dim, kind="stable")
    return xp.flip(x.shape[dim] - 1 - idx, axis=dim)


@portable("sort")
def sort(xp: Any, x: Any, dim: int, descending: bool) -> tuple[Any, Any]:
    if x.ndim == 0:
        return x.copy(), xp.zeros((), np.int64)
    idx = order(xp, x, dim, descending)
    return xp.take_along_axis(x, idx, axis=dim), idx.astype(np.int64, copy=False)


def _is_nan(xp: Any, a: Any) -> Any:
    return xp.isnan(a) if a.dtype.kind == "f" else xp.zeros(a.shape, bool)


def _first_true(xp: Any, chosen: Any, k: int) -> Any:
    """[R, k] column indices, ascending, of the k true elements in each row of chosen [R, n] (each row has k):
    each true element goes to the slot its running count names; the rest to a spare column that is dropped."""
    rows, n = chosen.shape
    slot = xp.where(chosen, xp.cumsum(chosen, axis=1) - 1, k)
    flat = xp.arange(rows).reshape(rows, 1) * (k + 1) + slot
    out = xp.zeros(rows * (k + 1), np.int64)
    out[flat.reshape(-1)] = xp.broadcast_to(xp.arange(n), (rows, n)).reshape(-1)
    return out.reshape(rows, k + 1)[:, :k]


def _top_candidates(xp: Any, rows: Any, k: int, largest: bool) -> Any:
    """[R, k] indices, ascending per row, of the k elements that a stable sort would put first: an O(n) partition
    finds the k-th value, then ties with it are taken from the lowest positions."""
    n = rows.shape[1]
    if largest:
        kth = xp.partition(rows, n - k, axis=1)[:, n - k:n - k + 1]
        nan_row, nan_kth = _is_nan(xp, rows), _is_nan(xp, kth)
        before = (rows > kth) | (nan_row & ~nan_kth)
    else:
        kth = xp.partition(rows, k - 1, axis=1)[:, k - 1:k]
        nan_row, nan_kth = _is_nan(xp, rows), _is_nan(xp, kth)
        before = (rows < kth) | (~nan_row & nan_kth)
    tie = (rows == kth) | (nan_row & nan_kth)
    need = k - before.sum(axis=1, keepdims=True)
    chosen = before | (tie & (xp.cumsum(tie, axis=1) <= need))
    return _first_true(xp, chosen, k)


@portable("topk")
def topk(xp: Any, x: Any, k: int, dim: int, largest: bool) -> tuple[Any, Any]:
    if x.ndim == 0:
        return x.copy(), xp.zeros((), np.int64)
    n = x.shape[dim]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} is outside [0, {n}] for dim {dim} of shape {list(x.shape)}")
    if n < TOPK_PARTITION_MIN or k * 16 > n or k == 0:
        idx = order(xp, x, dim, largest)[(slice(None),) * dim + (slice(0, k),)]
    else:
        moved = xp.moveaxis(_comparable(x), dim, -1)
        rows = moved.reshape(-1, n)
        cand = _top_candidates(xp, rows, k, largest)
        picked = xp.take_along_axis(rows, cand, axis=1)
        cand = xp.take_along_axis(cand, order(xp, picked, 1, largest), axis=1)
        idx = xp.moveaxis(cand.reshape(moved.shape[:-1] + (k,)), -1, dim)
    return xp.take_along_axis(x, idx, axis=dim), idx.astype(np.int64, copy=False)


def binary_search(xp: Any, seq: Any, values: Any, right: bool) -> Any:
    """PyTorch's lower/upper bound loop, vectorized: exact even where NaN makes seq unordered. It runs the fixed
    number of halvings a search over seq's length needs (finished searches stay put), so nothing is read back."""
    n = seq.shape[-1]
    lo = xp.zeros(values.shape, np.int64)
    hi = xp.full(values.shape, n, np.int64)
    for _ in range(n.bit_length() + 1):
        active = lo < hi
        mid = xp.minimum((lo + hi) >> 1, n - 1)  # (mid is only clipped where lo == hi, inactive)
        mid_val = seq[mid] if seq.ndim == 1 else xp.take_along_axis(seq, mid, axis=-1)
        go_right = ~(mid_val > values) if right else ~(mid_val >= values)
        lo = xp.where(active & go_right, mid + 1, lo)
        hi = xp.where(active & ~go_right, mid, hi)
    return lo


@portable("searchsorted")
def searchsorted(xp: Any, sorted: Any, values: Any, right: bool, dtype: Any) -> Any:  # noqa: A002
    seq, vals = _comparable(sorted), _comparable(values)
    if seq.shape[-1] == 0:
        return xp.zeros(vals.shape, dtype.numpy)
    return binary_search(xp, seq, vals, right).astype(dtype.numpy)


@portable("nonzero_static")
def nonzero_static(xp: Any, x: Any, size: int, fill_value: int) -> Any:
    """The coordinates of the first `size` nonzero elements (row-major), padded with fill_value: each nonzero
    element's coordinates go to the row its running count names, without a data-dependent shape."""
    if x.ndim == 0:
        return xp.full((size, 0), fill_value, np.int64)
    found = (x != 0).reshape(-1)
    row = xp.where(found, xp.cumsum(found) - 1, size)
    row = xp.where(row < size, row, size)  # found past `size`, and not found: the spare row, dropped
    coords = xp.empty((x.size, x.ndim), np.int64)
    flat = xp.arange(x.size)
    for d in reversed(range(x.ndim)):  # (CuPy's unravel_index checks its input's range on the host)
        coords[:, d] = flat % x.shape[d]
        flat = flat // x.shape[d]
    out = xp.full((size + 1, x.ndim), fill_value, np.int64)
    out[row] = coords
    return out[:size]
