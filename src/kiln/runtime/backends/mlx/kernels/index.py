"""Indexing: gathers, advanced indexing, and the scatters. A write produces the updated array as a new value: it
is written on a new array object (an index_put on MLX rebinds the object it is applied to), and MLX does it in
the old buffer's memory when nothing else holds that buffer, which is how a KV cache, marked in place by the
program, is updated without a copy. Repeated write positions keep the last write, as on the CPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kiln.runtime.backends.array_api.index import index_key as portable_index_key
from kiln.runtime.backends.mlx.arrays import FLOATS, LOW_PRECISION, is_float
from kiln.runtime.backends.mlx.registry import kernel


def index_key(ndim: int, dims: Any, indices: Any) -> tuple:
    """array_api's indexing key, with MLX's bool type for masks."""
    return portable_index_key(ndim, dims, indices, mx.bool_)


def write_at(x: mx.array, values: mx.array, dims: Any, indices: Any) -> mx.array:
    """x with x[indices at dims] = values (integer indices)."""
    out = mx.array(x)
    out[index_key(x.ndim, dims, indices)] = values.astype(x.dtype)
    return out


@kernel("index_select")
def index_select(x: mx.array, index: mx.array, dim: int) -> mx.array:
    return mx.take(x, index.reshape(-1), axis=dim)


@kernel("embedding")
def embedding(weight: mx.array, indices: mx.array) -> mx.array:
    return mx.take(weight, indices, axis=0)


def crop_to(x: mx.array, index: mx.array, dim: int) -> mx.array:
    """x restricted to index's extent in every dim but `dim` (torch allows index to be smaller there)."""
    return x[tuple(slice(None) if d == dim else slice(0, index.shape[d]) for d in range(x.ndim))]


@kernel("gather")
def gather(x: mx.array, index: mx.array, dim: int) -> mx.array:
    if x.ndim == 0:
        return mx.array(x)
    return mx.take_along_axis(crop_to(x, index, dim), index, axis=dim)


@kernel("index")
def index(x: mx.array, *indices: mx.array, dims: Any) -> mx.array:
    return x[index_key(x.ndim, dims, indices)]


@kernel("index_put")
def index_put(x: mx.array, values: mx.array, *indices: mx.array, dims: Any, accumulate: bool,
              in_place: bool) -> mx.array:
    if len(indices) == 1 and indices[0].dtype == mx.bool_:
        return _put_masked(x, values, dims[0], indices[0], accumulate)
    if not accumulate:
        return write_at(x, values, dims, indices)
    key = index_key(x.ndim, dims, indices)
    if x.dtype in LOW_PRECISION:  # summed in float32, rounded once
        return x.astype(mx.float32).at[key].add(values.astype(mx.float32)).astype(x.dtype)
    return x.at[key].add(values.astype(x.dtype))


def _put_masked(x: mx.array, values: mx.array, dim: int, mask: mx.array, accumulate: bool) -> mx.array:
    """x[..., mask, ...] = values (or +=) without the data-dependent shape of the masked positions: values' masked
    axis is gathered at each position's running count of the mask, then selected by the mask."""
    rest = x.ndim - dim - mask.ndim
    values = values.reshape((1,) * (dim + 1 + rest - values.ndim) + values.shape)  # [lead, count or 1, rest]
    position = mx.clip(mx.cumsum(mask.reshape(-1).astype(mx.int32)) - 1, 0, values.shape[dim] - 1)
    laid = mx.take(values, position, axis=dim).reshape(values.shape[:dim] + mask.shape + values.shape[dim + 1:])
    where = mask.reshape((1,) * dim + mask.shape + (1,) * rest)
    laid = mx.broadcast_to(laid.astype(x.dtype), x.shape)
    return mx.where(where, x + laid if accumulate else laid, x)


@kernel("index_copy")
def index_copy(x: mx.array, index: mx.array, source: mx.array, dim: int, in_place: bool) -> mx.array:
    return write_at(x, source, (dim,), (index,))


@kernel("slice_scatter")
def slice_scatter(x: mx.array, source: mx.array, dim: int, start: int, end: int, step: int,
                  in_place: bool) -> mx.array:
    out = mx.array(x)
    out[(slice(None),) * dim + (slice(start, end, step),)] = source.astype(x.dtype)
    return out


def scatter_key(index: mx.array, dim: int) -> tuple:
    """For every position of index, its own coordinates with dim replaced by the index value."""
    grid: list[Any] = [mx.arange(n).reshape((1,) * d + (n,) + (1,) * (index.ndim - d - 1))
                       for d, n in enumerate(index.shape)]
    grid[dim] = index
    return tuple(grid)


def _source_for(source: mx.array, index: mx.array) -> mx.array:
    """source cut to index's extent (torch allows it to be larger), or broadcast where it is 0-d."""
    if source.ndim == 0:
        return mx.broadcast_to(source, index.shape)
    return source[tuple(slice(0, n) for n in index.shape)]


@kernel("scatter")
def scatter(x: mx.array, index: mx.array, source: mx.array, dim: int, reduce: str) -> mx.array:
    if x.ndim == 0:
        return scatter(x.reshape(1), index.reshape(1), source.reshape(1), 0, reduce).reshape(())
    src = _source_for(source, index).astype(x.dtype)
    key = scatter_key(index, dim)
    if reduce == "add":
        return x.at[key].add(src)
    out = mx.array(x)
    out[key] = src
    return out


def _identity(reduce: str, dtype: Any) -> Any:
    """The value a scattered position starts from without include_self."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if dtype in FLOATS:
        return -np.inf if reduce == "amax" else np.inf
    info = mx.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


_AT = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "maximum", "amin": "minimum"}


@kernel("scatter_reduce")
def scatter_reduce(x: mx.array, index: mx.array, source: mx.array, dim: int, reduce: str,
                   include_self: bool) -> mx.array:
    dtype = x.dtype
    if x.ndim == 0:  # PyTorch treats 0-d self, index and source as one element each
        return scatter_reduce(x.reshape(1), index.reshape(1), source.reshape(1), 0, reduce,
                              include_self).reshape(())
    wide = mx.float32 if dtype in LOW_PRECISION else dtype
    out = x.astype(wide)
    if index.size == 0:
        return x
    src = _source_for(source, index).astype(wide)
    key = scatter_key(index, dim)
    if not include_self:
        out[key] = mx.array(_identity(reduce, wide), dtype=wide)
    out = getattr(out.at[key], _AT[reduce])(src)
    if reduce in ("amax", "amin") and is_float(out):  # NaN propagates, as in PyTorch
        nan = mx.zeros(out.shape, dtype=mx.int32).at[key].add(mx.isnan(src).astype(mx.int32))
        out = mx.where(nan > 0, mx.array(np.nan, dtype=wide), out)
    if reduce == "mean":
        count = mx.full(out.shape, 1 if include_self else 0, dtype=mx.int32).at[key].add(1)
        count = mx.maximum(count, 1)
        out = out / count.astype(wide) if is_float(out) else mx.floor_divide(out, count.astype(wide))
    return out.astype(dtype)


@kernel("masked_scatter")
def masked_scatter(x: mx.array, mask: mx.array, source: mx.array) -> mx.array:
    """Source's leading elements, in order, where mask is true (a running count of the mask)."""
    where = mx.broadcast_to(mask, x.shape)
    flat = source.reshape(-1)
    if flat.size == 0:
        return x
    position = mx.cumsum(where.reshape(-1).astype(mx.int32)).reshape(x.shape) - 1
    return mx.where(where, mx.take(flat, mx.clip(position, 0, flat.size - 1)).astype(x.dtype), x)


@kernel("embedding_bag")
def embedding_bag(weight: mx.array, indices: mx.array, offsets: mx.array,
                  per_sample_weights: mx.array | None = None, *, mode: str, include_last_offset: bool,
                  padding_idx: int) -> mx.array:
    """Bag b covers positions offsets[b] .. offsets[b+1] (or the end): each position finds its bag by binary search
    over the offsets, and its row is summed (or maxed) into the bag by a scatter; dropped positions go to a spare
    bag."""
    from kiln.runtime.backends.mlx.kernels.sort import binary_search

    dtype = weight.dtype
    idx, offsets = indices.reshape(-1), offsets.reshape(-1).astype(mx.int64)
    n, rows_in = idx.shape[0], weight.shape[0]
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    wide = mx.float32 if dtype in LOW_PRECISION else dtype
    if bags == 0:
        return mx.zeros((0,) + tuple(weight.shape[1:]), dtype=dtype)
    position = mx.arange(n, dtype=mx.int64)
    bag = binary_search(offsets[:bags], position, right=True) - 1
    keep = bag >= 0
    if include_last_offset:
        keep = keep & (position < offsets[bags])
    if padding_idx >= 0:
        keep = keep & (idx != padding_idx)
    slot = mx.where(keep, bag, bags)
    rows = mx.take(weight, mx.clip(idx, 0, rows_in - 1), axis=0).astype(wide)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape((-1,) + (1,) * (rows.ndim - 1)).astype(wide)
    shape = (bags + 1,) + tuple(weight.shape[1:])
    if mode == "max":
        lowest = -np.inf if wide in FLOATS else mx.iinfo(wide).min
        out = mx.full(shape, lowest, dtype=wide).at[slot].maximum(rows)
    else:
        out = mx.zeros(shape, dtype=wide).at[slot].add(rows)
    out = out[:bags]
    if mode != "sum":  # empty bags: 0 for max, and the divisor of mean
        counts = mx.zeros((bags + 1,), dtype=mx.int32).at[slot].add(1)[:bags]
        counts = counts.reshape((-1,) + (1,) * (rows.ndim - 1))
        if mode == "max":
            out = mx.where(counts == 0, mx.zeros((), dtype=wide), out)
        else:
            out = out / mx.maximum(counts, 1).astype(wide)
    return out.astype(dtype)
