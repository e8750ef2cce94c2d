"""Writes on the GPU where the portable kernels would race: a scatter with repeated indices lets any writer win on
a GPU, while PyTorch (and the CPU) keep the last: KV-cache writes keep each slot's last writer (index.cu).
scatter_reduce's product, which CuPy has no multiply.at for, multiplies in place through a compare-and-swap
loop."""

from __future__ import annotations

import math
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import index as portable
from kiln.runtime.backends.array_api.index import target
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.registry import OnHost, elements, grid, kernel


def _write(out: Any, dim: int, index: Any, source: Any) -> Any:
    """out[..., index, ...] = source along dim, the last of repeated slots winning: each slot's last writer found
    by an atomic max of the positions, then one pass writing only those (index.cu); for the types index.cu does
    not take, every writer of a slot is given the last one's value and CuPy assigns."""
    if index.ndim != 1 or out.size == 0 or index.shape[0] == 0:
        out[(slice(None),) * dim + (index,)] = source
        return out
    n, size = index.shape[0], out.shape[dim]
    inner = math.prod(out.shape[dim + 1:])
    src = cp.broadcast_to(source, out.shape[:dim] + (n,) + out.shape[dim + 1:]).reshape(-1, n, inner)
    if not (nvrtc.supports(out, src) and out.flags.c_contiguous and index.dtype == cp.int64):
        slot = cp.where(index < 0, index + size, index)
        last = cp.full(size, -1, dtype=cp.int64)
        cp.maximum.at(last, slot, cp.arange(n, dtype=cp.int64))
        out[(slice(None),) * dim + (index,)] = cp.take(src, last[slot], axis=1).reshape(
            out.shape[:dim] + (n,) + out.shape[dim + 1:])
        return out
    winner: Any = np.uint64(0)  # a null pointer: one slot written once, nothing to decide
    if n > 1:
        winner = cp.full(size, -1, dtype=cp.int32)
        nvrtc.function("index", "last_writer", out.dtype)(grid(n), (256,), (index, winner, np.int32(n),
                                                                             np.int32(size)))
    total = src.size
    nvrtc.function("index", "write_slots", out.dtype)(
        grid(total), (256,), (out, src, index, winner, np.int32(n), np.int32(size), np.int64(inner),
                              *elements(src.strides, src.itemsize, 3), np.int64(total)))
    return out


@kernel("index_copy")
def index_copy(x: Any, index: Any, source: Any, dim: int, in_place: bool) -> Any:
    return _write(target(x, in_place), dim, index, source)


_PLACE = cp.ElementwiseKernel(
    "int64 row, int64 at, int64 rows, int64 size", "int64 place",
    "place = ((row % rows + rows) % rows) * size + (at % size + size) % size", "kiln_slot_place")
"""The flat place (row, at) of a [rows, size, ...] array, each index wrapped into its dim as CuPy's fancy
assignment wraps it (the portable path's behaviour: a graph cannot raise, and nothing is written outside)."""


def _write_two(out: Any, values: Any, rows: Any, at: Any) -> Any:
    """out[rows, at] = values for a contiguous out (a serving program's slotted KV cache [slots, S, Hkv, D]
    written at each token's (slot, position)): the two indices as one flat index into out viewed as [slots * S,
    ...], then _write's last-writer scatter."""
    shape = np.broadcast_shapes(rows.shape, at.shape)
    place = _PLACE(rows, at, np.int64(out.shape[0]), np.int64(out.shape[1])).reshape(-1)
    rest = out.shape[2:]
    source = cp.broadcast_to(values, shape + rest).reshape((-1,) + rest)
    _write(out.reshape((-1,) + rest), 0, place, source)
    return out


@kernel("index_put")
def index_put(x: Any, values: Any, *indices: Any, dims: Any, accumulate: bool, in_place: bool) -> Any:
    """The KV-cache forms (one 1-d integer index, or int64 indices at dims 0 and 1 of a contiguous cache; no
    accumulation) with repeats made harmless; the rest portable (accumulation is atomic, so repeats add up)."""
    if not accumulate and list(dims) == [0, 1] and x.flags.c_contiguous and x.ndim >= 2 and x.size \
            and all(i.dtype == cp.int64 for i in indices):
        return _write_two(target(x, in_place), values, *indices)
    if accumulate or len(indices) != 1 or len(dims) != 1 or indices[0].dtype == cp.bool_ or indices[0].ndim != 1:
        return portable.index_put(cp, x, values, *indices, dims=dims, accumulate=accumulate, in_place=in_place)
    return _write(target(x, in_place), dims[0], indices[0], values)


_MULTIPLY_AT = cp.ElementwiseKernel(
    "int64 slot, T value", "raw T out", "kiln_multiply_at(&out[slot], value)", "kiln_multiply_at",
    preamble=r"""
template <class T, class Bits> __device__ void kiln_cas_multiply(T* at, T value) {
    Bits* word = reinterpret_cast<Bits*>(at);
    Bits seen = *word, expected;
    do {
        expected = seen;
        T product = *reinterpret_cast<T*>(&expected) * value;
        seen = atomicCAS(word, expected, *reinterpret_cast<Bits*>(&product));
    } while (seen != expected);
}
__device__ void kiln_multiply_at(float* at, float v) { kiln_cas_multiply<float, unsigned int>(at, v); }
__device__ void kiln_multiply_at(double* at, double v) { kiln_cas_multiply<double, unsigned long long>(at, v); }
__device__ void kiln_multiply_at(int* at, int v) { kiln_cas_multiply<int, unsigned int>(at, v); }
__device__ void kiln_multiply_at(long long* at, long long v) {
    kiln_cas_multiply<long long, unsigned long long>(at, v);
}
""")
_MULTIPLIABLE = {np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64)}


def _multiply_at(out: Any, key: tuple, source: Any) -> None:
    """out[key] *= source with repeated positions all applied (out is a fresh contiguous array)."""
    if out.dtype not in _MULTIPLIABLE:
        raise OnHost
    slot = sum(k * (stride // out.itemsize) for k, stride in zip(key, out.strides, strict=True))
    _MULTIPLY_AT(*cp.broadcast_arrays(cp.asarray(slot, np.int64), source), out)


@kernel("scatter_reduce")
def scatter_reduce(x: Any, index: Any, source: Any, dim: int, reduce: str, include_self: bool) -> Any:
    return portable.scatter_reduce(cp, x, index, source, dim, reduce, include_self, multiply_at=_multiply_at)
