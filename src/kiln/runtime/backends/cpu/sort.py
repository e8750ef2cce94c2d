"""Sorting and searching kernels: sort, topk, searchsorted, nonzero_static.

Orders follow PyTorch: stable, NaN above +inf, ties broken by position.
"""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel

TOPK_PARTITION_MIN = 4096
"""From this many elements along dim (and k at most 1/16 of them), topk partitions before it sorts."""


def _comparable(x: np.ndarray) -> np.ndarray:
    """x in a dtype NumPy sorts natively with the same order (float16/bfloat16 widen exactly to float32)."""
    return x.astype(np.float32) if x.dtype in LOW_PRECISION else x


def order(x: np.ndarray, dim: int, descending: bool) -> np.ndarray:
    """Stable argsort along dim; descending keeps equal elements in their original order and puts NaN first."""
    x = _comparable(x)
    if not descending:
        return np.argsort(x, axis=dim, kind="stable")
    idx = np.argsort(np.flip(x, axis=dim), axis=dim, kind="stable")
    return np.flip(x.shape[dim] - 1 - idx, axis=dim)


@kernel("sort")
def sort(x: np.ndarray, dim: int, descending: bool) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim == 0:
        return x.copy(), np.zeros((), np.int64)
    idx = order(x, dim, descending)
    return np.take_along_axis(x, idx, axis=dim), idx.astype(np.int64, copy=False)


def _is_nan(a: np.ndarray) -> np.ndarray:
    return np.isnan(a) if a.dtype.kind == "f" else np.zeros(a.shape, bool)


def _top_candidates(rows: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """[R, k] indices, ascending per row, of the k elements that a stable sort would put first: an O(n) partition
    finds the k-th value, then ties with it are taken from the lowest positions."""
    n = rows.shape[1]
    if largest:
        kth = np.partition(rows, n - k, axis=1)[:, n - k:n - k + 1]
        nan_row, nan_kth = _is_nan(rows), _is_nan(kth)
        before = (rows > kth) | (nan_row & ~nan_kth)
    else:
        kth = np.partition(rows, k - 1, axis=1)[:, k - 1:k]
        nan_row, nan_kth = _is_nan(rows), _is_nan(kth)
        before = (rows < kth) | (~nan_row & nan_kth)
    tie = (rows == kth) | (nan_row & nan_kth)
    need = k - before.sum(axis=1, keepdims=True)
    chosen = before | (tie & (np.cumsum(tie, axis=1) <= need))
    return np.nonzero(chosen)[1].reshape(rows.shape[0], k)


@kernel("topk")
def topk(x: np.ndarray, k: int, dim: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim == 0:
        return x.copy(), np.zeros((), np.int64)
    n = x.shape[dim]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} is outside [0, {n}] for dim {dim} of shape {list(x.shape)}")
    if n < TOPK_PARTITION_MIN or k * 16 > n or k == 0:
        idx = order(x, dim, largest)[(slice(None),) * dim + (slice(0, k),)]
    else:
        moved = np.moveaxis(_comparable(x), dim, -1)
        rows = moved.reshape(-1, n)
        cand = _top_candidates(rows, k, largest)
        picked = np.take_along_axis(rows, cand, axis=1)
        cand = np.take_along_axis(cand, order(picked, 1, largest), axis=1)
        idx = np.moveaxis(cand.reshape(moved.shape[:-1] + (k,)), -1, dim)
    return np.take_along_axis(x, idx, axis=dim), idx.astype(np.int64, copy=False)


def _binary_search(seq: np.ndarray, values: np.ndarray, right: bool) -> np.ndarray:
    """PyTorch's lower/upper bound loop, vectorized: exact even where NaN makes seq unordered."""
    lo = np.zeros(values.shape, np.int64)
    hi = np.full(values.shape, seq.shape[-1], np.int64)
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi) >> 1
        mid = np.minimum(mid, seq.shape[-1] - 1)
        mid_val = seq[mid] if seq.ndim == 1 else np.take_along_axis(seq, mid, axis=-1)
        go_right = ~(mid_val > values) if right else ~(mid_val >= values)
        lo = np.where(active & go_right, mid + 1, lo)  # (mid is only clipped where lo == hi, inactive)
        hi = np.where(active & ~go_right, mid, hi)


@kernel("searchsorted")
def searchsorted(sorted: np.ndarray, values: np.ndarray, right: bool, dtype) -> np.ndarray:  # noqa: A002
    seq, vals = _comparable(sorted), _comparable(values)
    side = "right" if right else "left"
    if seq.ndim == 1 and not _is_nan(seq).any():
        out = np.searchsorted(seq, vals, side=side)
    elif seq.shape[-1] == 0:
        out = np.zeros(vals.shape, np.int64)
    else:
        out = _binary_search(seq, vals, right)
    return np.asarray(out).astype(dtype.numpy)


@kernel("nonzero_static")
def nonzero_static(x: np.ndarray, size: int, fill_value: int) -> np.ndarray:
    found = np.argwhere(x)[:size]
    out = np.full((size, x.ndim), fill_value, np.int64)
    out[:len(found)] = found
    return out
