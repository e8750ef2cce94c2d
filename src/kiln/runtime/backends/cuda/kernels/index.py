"""Writes on the GPU where the portable kernels would race: a scatter with repeated indices lets any writer win on
a GPU, while PyTorch (and the CPU) keep the last. KV-cache writes make the repeats agree first. scatter_reduce's
product, which CuPy has no multiply.at for, multiplies in place through a compare-and-swap loop."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import index as portable
from kiln.runtime.backends.array_api.index import target
from kiln.runtime.backends.cuda.kernels.registry import OnHost, kernel


def _last_writer(index: Any, size: int) -> Any:
    """For each position j of a 1-d index into `size` slots, the last position k with index[k] == index[j].

    A GPU scatter with repeated indices lets any of the writers win; PyTorch (and the CPU backend) keep the last.
    Giving every writer of a slot the last writer's value makes the race harmless, without a host round trip to
    drop the repeats: an atomic max of the positions per slot, then each position reads its slot's winner.
    """
    n = index.shape[0]
    slot = cp.where(index < 0, index + size, index)
    winner = cp.full(size, -1, dtype=cp.int64)
    cp.maximum.at(winner, slot, cp.arange(n, dtype=cp.int64))
    return winner[slot]


def _write(out: Any, dim: int, index: Any, source: Any) -> Any:
    if index.ndim == 1 and index.shape[0] > 1:
        source = cp.broadcast_to(source, out[(slice(None),) * dim + (index,)].shape)
        source = cp.take(source, _last_writer(index, out.shape[dim]), axis=dim)
    out[(slice(None),) * dim + (index,)] = source
    return out


@kernel("index_copy")
def index_copy(x: Any, index: Any, source: Any, dim: int, in_place: bool) -> Any:
    return _write(target(x, in_place), dim, index, source)


@kernel("index_put")
def index_put(x: Any, values: Any, *indices: Any, dims: Any, accumulate: bool, in_place: bool) -> Any:
    """The KV-cache form (one 1-d integer index, no accumulation) with repeats made harmless; the rest portable
    (accumulation is atomic, so repeats add up)."""
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
