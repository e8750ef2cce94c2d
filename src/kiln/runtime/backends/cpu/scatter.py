"""Reducing scatters, masked_scatter and embedding_bag: functional (they copy, then write)."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel

_UFUNCS = {"sum": np.add, "mean": np.add, "prod": np.multiply, "amax": np.maximum, "amin": np.minimum}


def _identity(reduce: str, dtype: np.dtype):
    """The value a scattered position starts from without include_self."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if dtype.kind == "f":
        return -np.inf if reduce == "amax" else np.inf
    return np.iinfo(dtype).min if reduce == "amax" else np.iinfo(dtype).max


@kernel("scatter_reduce")
def scatter_reduce(x: np.ndarray, index: np.ndarray, source: np.ndarray, dim: int, reduce: str,
                   include_self: bool) -> np.ndarray:
    dtype = x.dtype
    wide = np.float32 if dtype in LOW_PRECISION else dtype
    out = x.astype(wide, copy=True)
    if x.ndim == 0:  # PyTorch treats 0-d self, index and source as one element each
        return scatter_reduce(x.reshape(1), index.reshape(1), source.reshape(1), 0, reduce,
                              include_self).reshape(())
    if index.size == 0:
        return out.astype(dtype, copy=False)
    src = np.broadcast_to(source, index.shape) if source.ndim == 0 else source[tuple(slice(0, n) for n in index.shape)]
    src = src.astype(wide, copy=False)
    grid = list(np.indices(index.shape, sparse=True))
    grid[dim] = index
    key = tuple(grid)
    if not include_self:
        out[key] = _identity(reduce, np.dtype(wide))
    _UFUNCS[reduce].at(out, key, src)
    if reduce == "mean":
        count = np.full(out.shape, 1 if include_self else 0, np.int64)
        np.add.at(count, key, 1)
        count = np.maximum(count, 1)
        out = out / count if out.dtype.kind == "f" else np.floor_divide(out, count).astype(wide)
    return out.astype(dtype, copy=False)


@kernel("masked_scatter")
def masked_scatter(x: np.ndarray, mask: np.ndarray, source: np.ndarray) -> np.ndarray:
    out = np.array(x, copy=True)
    where = np.broadcast_to(mask, out.shape)
    count = int(np.count_nonzero(where))
    flat = source.reshape(-1)
    if flat.size < count:
        raise ValueError(f"masked_scatter: mask selects {count} elements but source has only {flat.size}")
    out[where] = flat[:count]
    return out


@kernel("embedding_bag")
def embedding_bag(weight: np.ndarray, indices: np.ndarray, offsets: np.ndarray, per_sample_weights: np.ndarray | None,
                  mode: str, include_last_offset: bool, padding_idx: int) -> np.ndarray:
    """Segment reductions over the kept rows: bag b covers positions offsets[b] .. offsets[b+1] (or the end)."""
    dtype = weight.dtype
    n = indices.shape[0]
    offsets = offsets.astype(np.int64).reshape(-1)
    bags = len(offsets) - 1 if include_last_offset else len(offsets)
    starts = np.clip(offsets[:bags], 0, n)
    ends = np.clip(np.append(offsets[1:bags], offsets[bags] if include_last_offset else n), 0, n) if bags else starts
    if bags and (np.any(np.diff(offsets) < 0) or offsets[0] != 0):
        raise ValueError("embedding_bag: offsets must start at 0 and be non-decreasing")
    keep = np.ones(n, bool) if padding_idx < 0 else indices != padding_idx
    before = np.concatenate([[0], np.cumsum(keep)])  # kept positions before each position
    seg_start, seg_end = before[starts], before[ends]
    last = before[ends[-1]] if bags else 0
    kept = np.nonzero(keep[:ends[-1] if bags else 0])[0]
    if kept.size and (indices[kept].min() < 0 or indices[kept].max() >= weight.shape[0]):
        raise ValueError(f"embedding_bag: index out of range for {weight.shape[0]} rows")
    rows = weight[indices[kept]].astype(np.float32 if dtype in LOW_PRECISION else dtype)[:last]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1)[kept][:last, None].astype(rows.dtype)
    counts = seg_end - seg_start
    out = np.zeros((bags,) + weight.shape[1:], rows.dtype)
    full = counts > 0
    if rows.shape[0] and full.any():
        reducer = np.maximum if mode == "max" else np.add
        out[full] = reducer.reduceat(rows, seg_start[full], axis=0)
        if mode == "mean":
            out[full] /= counts[full].reshape((-1,) + (1,) * (out.ndim - 1))
    return out.astype(dtype, copy=False)
