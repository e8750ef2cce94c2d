"""Indexing kernels: gathers, advanced indexing, and the functional scatters (copy, then write)."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import kernel


@kernel("index_select")
def index_select(x: np.ndarray, index: np.ndarray, dim: int) -> np.ndarray:
    return np.take(x, index.reshape(-1), axis=dim)


@kernel("embedding")
def embedding(weight: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return np.take(weight, indices, axis=0)


def _crop_to(x: np.ndarray, index: np.ndarray, dim: int) -> np.ndarray:
    """x restricted to index's extent in every dim but `dim` (torch allows index to be smaller there)."""
    return x[tuple(slice(None) if d == dim else slice(0, index.shape[d]) for d in range(x.ndim))]


@kernel("gather")
def gather(x: np.ndarray, index: np.ndarray, dim: int) -> np.ndarray:
    if x.ndim == 0:
        return x.copy()
    return np.take_along_axis(_crop_to(x, index, dim), index, axis=dim)


def _index_tuple(ndim: int, dims, indices) -> tuple:
    """A NumPy key: the index at each of dims, full slices elsewhere; a bool mask covers mask.ndim dims."""
    at = dict(zip(dims, indices))
    key: list = []
    d = 0
    while d < ndim:
        idx = at.get(d)
        key.append(slice(None) if idx is None else idx)
        d += idx.ndim if idx is not None and idx.dtype == np.bool_ else 1
    return tuple(key)


@kernel("index")
def index(x: np.ndarray, *indices: np.ndarray, dims) -> np.ndarray:
    return x[_index_tuple(x.ndim, dims, indices)]


def _target(x: np.ndarray, in_place: bool) -> np.ndarray:
    """Where a write goes: into x itself when the program marked it in_place (a state buffer nothing else reads)
    and x owns writable memory (a session's state array does after its first step), else into a copy."""
    return x if in_place and x.flags.writeable and x.flags.owndata else x.copy()


@kernel("index_put")
def index_put(x: np.ndarray, values: np.ndarray, *indices: np.ndarray, dims, accumulate: bool,
              in_place: bool) -> np.ndarray:
    out = _target(x, in_place)
    key = _index_tuple(x.ndim, dims, indices)
    if accumulate:
        np.add.at(out, key, values)
    else:
        out[key] = values
    return out


@kernel("index_copy")
def index_copy(x: np.ndarray, index: np.ndarray, source: np.ndarray, dim: int, in_place: bool) -> np.ndarray:
    out = _target(x, in_place)
    out[(slice(None),) * dim + (index,)] = source
    return out


@kernel("slice_scatter")
def slice_scatter(x: np.ndarray, source: np.ndarray, dim: int, start: int, end: int, step: int,
                  in_place: bool) -> np.ndarray:
    out = _target(x, in_place)
    out[(slice(None),) * dim + (slice(start, end, step),)] = source
    return out


@kernel("scatter")
def scatter(x: np.ndarray, index: np.ndarray, source: np.ndarray, dim: int, reduce: str) -> np.ndarray:
    out = x.copy()
    if source.ndim:
        source = source[tuple(slice(0, n) for n in index.shape)]
    grid = list(np.indices(index.shape, sparse=True))
    grid[dim] = index
    if reduce == "add":
        np.add.at(out, tuple(grid), source)
    else:
        out[tuple(grid)] = source
    return out
