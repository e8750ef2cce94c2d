"""Indexing kernels for both backends: gathers, advanced indexing, and the functional scatters (copy, then write;
or write in place where the program marked a state buffer's update in place and the array owns its memory).

Scatters with repeated indices: NumPy keeps the last write; a GPU scatter lets any writer win, so the CUDA backend
registers its own KV-cache writes (kiln.runtime.backends.cuda.kernels) that make the repeats agree first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import LOW_PRECISION, on_host, portable
from kiln.runtime.backends.array_api.sort import binary_search


def target(x: Any, in_place: bool) -> Any:
    """Where a write goes: into x itself when the program marked it in place (a state buffer nothing else reads)
    and x owns writable, contiguous memory (a session's state array does after its first step), else a copy."""
    if in_place and x.flags.owndata and x.flags.c_contiguous and getattr(x.flags, "writeable", True):
        return x
    return x.copy()


@portable("index_select")
def index_select(xp: Any, x: Any, index: Any, dim: int) -> Any:
    return xp.take(x, index.reshape(-1), axis=dim)


@portable("embedding")
def embedding(xp: Any, weight: Any, indices: Any) -> Any:
    return xp.take(weight, indices, axis=0)


def _crop_to(x: Any, index: Any, dim: int) -> Any:
    """x restricted to index's extent in every dim but `dim` (torch allows index to be smaller there)."""
    return x[tuple(slice(None) if d == dim else slice(0, index.shape[d]) for d in range(x.ndim))]


@portable("gather")
def gather(xp: Any, x: Any, index: Any, dim: int) -> Any:
    if x.ndim == 0:
        return x.copy()
    return xp.take_along_axis(_crop_to(x, index, dim), index, axis=dim)


def index_key(ndim: int, dims: Any, indices: Any, bool_dtype: Any = np.bool_) -> tuple:
    """An indexing key: the index at each of dims, full slices elsewhere; a bool mask (of the array library's
    bool_dtype) covers mask.ndim dims."""
    at = dict(zip(dims, indices))
    key: list = []
    d = 0
    while d < ndim:
        idx = at.get(d)
        key.append(slice(None) if idx is None else idx)
        d += idx.ndim if idx is not None and idx.dtype == bool_dtype else 1
    return tuple(key)


@portable("index")
def index(xp: Any, x: Any, *indices: Any, dims: Any) -> Any:
    return x[index_key(x.ndim, dims, indices)]


@portable("index_put")
def index_put(xp: Any, x: Any, values: Any, *indices: Any, dims: Any, accumulate: bool, in_place: bool) -> Any:
    out = target(x, in_place)
    key = index_key(x.ndim, dims, indices)
    if len(indices) == 1 and indices[0].dtype == np.bool_:
        return _put_masked(xp, out, values, dims[0], indices[0], accumulate)
    if not accumulate:
        out[key] = values
    elif out.dtype in LOW_PRECISION:  # summed in float32, rounded once
        wide = out.astype(np.float32)
        xp.add.at(wide, key, values.astype(np.float32))
        out[...] = wide
    else:
        xp.add.at(out, key, values)
    return out


def _put_masked(xp: Any, out: Any, values: Any, dim: int, mask: Any, accumulate: bool) -> Any:
    """out[..., mask, ...] = values (or +=) without the data-dependent shape of the masked positions (a GPU would
    read their count back): values' masked axis is gathered at each position's running count of the mask, then
    selected by the mask. Each position is written at most once, so accumulation needs no scatter."""
    rest = out.ndim - dim - mask.ndim
    values = values.reshape((1,) * (dim + 1 + rest - values.ndim) + values.shape)  # [lead, count or 1, rest]
    position = xp.clip(xp.cumsum(mask.reshape(-1)) - 1, 0, values.shape[dim] - 1)
    laid = xp.take(values, position, axis=dim).reshape(values.shape[:dim] + mask.shape + values.shape[dim + 1:])
    where = mask.reshape((1,) * dim + mask.shape + (1,) * rest)
    laid = xp.broadcast_to(laid.astype(out.dtype, copy=False), out.shape)
    out[...] = xp.where(where, out + laid if accumulate else laid, out)
    return out


@portable("index_copy")
def index_copy(xp: Any, x: Any, index: Any, source: Any, dim: int, in_place: bool) -> Any:
    out = target(x, in_place)
    out[(slice(None),) * dim + (index,)] = source
    return out


@portable("slice_scatter")
def slice_scatter(xp: Any, x: Any, source: Any, dim: int, start: int, end: int, step: int, in_place: bool) -> Any:
    out = target(x, in_place)
    out[(slice(None),) * dim + (slice(start, end, step),)] = source
    return out


def scatter_key(xp: Any, index: Any, dim: int) -> tuple:
    """For every position of index, its own coordinates with dim replaced by the index value (np.indices' sparse
    grid, which CuPy lacks)."""
    grid: list[Any] = [xp.arange(n).reshape((1,) * d + (n,) + (1,) * (index.ndim - d - 1))
                       for d, n in enumerate(index.shape)]
    grid[dim] = index
    return tuple(grid)


@portable("scatter")
def scatter(xp: Any, x: Any, index: Any, source: Any, dim: int, reduce: str) -> Any:
    out = x.copy()
    if source.ndim:
        source = source[tuple(slice(0, n) for n in index.shape)]
    key = scatter_key(xp, index, dim)
    if reduce == "add":
        xp.add.at(out, key, source)
    else:
        out[key] = source
    return out


_AT = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "maximum", "amin": "minimum"}


def _identity(reduce: str, dtype: np.dtype) -> Any:
    """The value a scattered position starts from without include_self."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if dtype.kind == "f":
        return -np.inf if reduce == "amax" else np.inf
    return np.iinfo(dtype).min if reduce == "amax" else np.iinfo(dtype).max


@portable("scatter_reduce")
def scatter_reduce(xp: Any, x: Any, index: Any, source: Any, dim: int, reduce: str, include_self: bool, *,
                   multiply_at: Callable[[Any, tuple, Any], None] | None = None) -> Any:
    """Unbuffered scatters (ufunc.at) for the reductions; multiply_at stands in for multiply.at where the array
    module lacks it (CuPy)."""
    dtype = x.dtype
    wide = np.dtype(np.float32) if dtype in LOW_PRECISION else dtype
    if x.ndim == 0:  # PyTorch treats 0-d self, index and source as one element each
        return scatter_reduce(xp, x.reshape(1), index.reshape(1), source.reshape(1), 0, reduce, include_self,
                              multiply_at=multiply_at).reshape(())
    out = x.astype(wide, copy=True)
    if index.size == 0:
        return out.astype(dtype, copy=False)
    if source.ndim == 0:
        src = xp.broadcast_to(source, index.shape)
    else:
        src = source[tuple(slice(0, n) for n in index.shape)]
    src = src.astype(wide, copy=False)
    key = scatter_key(xp, index, dim)
    if not include_self:
        out[key] = _identity(reduce, wide)
    if reduce == "prod" and multiply_at is not None:
        multiply_at(out, key, src)
    else:
        getattr(xp, _AT[reduce]).at(out, key, src)
    if reduce in ("amax", "amin") and wide.kind == "f" and not on_host(xp):
        # a GPU's atomic max/min skips NaN, which PyTorch (and NumPy's maximum.at) propagate
        nan = xp.zeros(out.shape, np.int32)
        xp.add.at(nan, key, xp.isnan(src).astype(np.int32))
        out = xp.where(nan > 0, wide.type(np.nan), out)
    if reduce == "mean":
        count = xp.full(out.shape, 1 if include_self else 0, np.int64)
        xp.add.at(count, key, 1)
        count = xp.maximum(count, 1)
        out = out / count if out.dtype.kind == "f" else xp.floor_divide(out, count).astype(wide)
    return out.astype(dtype, copy=False)


@portable("masked_scatter")
def masked_scatter(xp: Any, x: Any, mask: Any, source: Any) -> Any:
    """Source's leading elements, in order, where mask is true: element j of the masked positions takes source's
    element j (a running count of the mask, no data-dependent shape)."""
    where = xp.broadcast_to(mask, x.shape)
    flat = source.reshape(-1)
    position = xp.cumsum(where.reshape(-1)).reshape(x.shape) - 1
    if on_host(xp) and x.size and flat.size < position.reshape(-1)[-1] + 1:
        raise ValueError(f"masked_scatter: mask selects {position.reshape(-1)[-1] + 1} elements but source has "
                         f"only {flat.size}")
    if flat.size == 0:
        return x.copy()
    return xp.where(where, xp.take(flat, xp.clip(position, 0, flat.size - 1)), x).astype(x.dtype, copy=False)


@portable("embedding_bag")
def embedding_bag(xp: Any, weight: Any, indices: Any, offsets: Any, per_sample_weights: Any, mode: str,
                  include_last_offset: bool, padding_idx: int) -> Any:
    """Bag b covers positions offsets[b] .. offsets[b+1] (or the end). Each position finds its bag by binary search
    over the offsets (empty bags share a start with the next and are skipped), and its row is summed (or maxed)
    into the bag by an unbuffered scatter; dropped positions go to a spare bag. Nothing is read back, so a GPU
    method stays capturable; offsets and indices are checked where they live on the host."""
    dtype = weight.dtype
    idx, offsets = indices.reshape(-1), offsets.reshape(-1).astype(np.int64)
    n, rows_in = idx.shape[0], weight.shape[0]
    bags = len(offsets) - 1 if include_last_offset else len(offsets)
    wide = np.dtype(np.float32) if dtype in LOW_PRECISION else dtype
    if on_host(xp):
        _check_bags(offsets, idx, bags, padding_idx, rows_in)
    if bags == 0:
        return xp.zeros((0,) + tuple(weight.shape[1:]), dtype)
    position = xp.arange(n)
    bag = binary_search(xp, offsets[:bags], position, right=True) - 1
    keep = bag >= 0
    if include_last_offset and bags:
        keep &= position < offsets[bags]
    if padding_idx >= 0:
        keep &= idx != padding_idx
    slot = xp.where(keep, bag, bags)
    rows = xp.take(weight, xp.clip(idx, 0, rows_in - 1), axis=0).astype(wide, copy=False)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape((-1,) + (1,) * (rows.ndim - 1)).astype(wide)
    shape = (bags + 1,) + tuple(weight.shape[1:])
    if mode == "max":
        out = xp.full(shape, -np.inf if wide.kind == "f" else np.iinfo(wide).min, wide)
        xp.maximum.at(out, slot, rows)
    else:
        out = xp.zeros(shape, wide)
        xp.add.at(out, slot, rows)
    out = out[:bags]
    if mode != "sum":  # empty bags: 0 for max, and the divisor of mean
        counts = xp.zeros(bags + 1, np.int64)
        xp.add.at(counts, slot, 1)
        counts = counts[:bags].reshape((-1,) + (1,) * (rows.ndim - 1))
        out = xp.where(counts == 0, wide.type(0), out) if mode == "max" else out / xp.maximum(counts, 1).astype(wide)
    return out.astype(dtype, copy=False)


def _check_bags(offsets: np.ndarray, idx: np.ndarray, bags: int, padding_idx: int, rows: int) -> None:
    if bags and (np.any(np.diff(offsets) < 0) or offsets[0] != 0):
        raise ValueError("embedding_bag: offsets must start at 0 and be non-decreasing")
    used = idx[idx != padding_idx] if padding_idx >= 0 else idx
    if used.size and (used.min() < 0 or used.max() >= rows):
        raise ValueError(f"embedding_bag: index out of range for {rows} rows")
