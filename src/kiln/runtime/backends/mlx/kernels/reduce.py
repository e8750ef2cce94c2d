"""Reductions, softmax and scans. Float16/bfloat16 reduce in float32 and round back, and integer sums and products
accumulate in int64, as PyTorch's do; MLX's argmax/argmin give uint32 indices, kiln's are int64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kiln.runtime.backends.mlx.arrays import LOW_PRECISION, is_float
from kiln.runtime.backends.mlx.registry import MLX_KERNELS, axes_of, in_float32, kernel, upcast


def _accumulating(x: mx.array) -> mx.array:
    """x as the type a sum or product accumulates in: float32 for half floats, int64 for integers and bool."""
    if x.dtype in LOW_PRECISION:
        return x.astype(mx.float32)
    if not is_float(x):
        return x.astype(mx.int64)
    return x


def _reducer(fn: Callable[..., mx.array], accumulates: bool) -> Callable[..., mx.array]:
    def run(x: mx.array, dims: Any, keepdim: bool) -> mx.array:
        wide = _accumulating(x) if accumulates else upcast(x)[0]
        out = fn(wide, axis=axes_of(dims, x.ndim), keepdims=keepdim)
        return out.astype(x.dtype) if x.dtype in LOW_PRECISION else out
    run.__name__ = fn.__name__
    return run


for _name, (_fn, _accumulates) in {"sum": (mx.sum, True), "prod": (mx.prod, True), "mean": (mx.mean, False),
                                   "amax": (mx.max, False), "amin": (mx.min, False), "any": (mx.any, False),
                                   "all": (mx.all, False)}.items():
    MLX_KERNELS.add(_name, _reducer(_fn, _accumulates))


@kernel("var")
@in_float32
def var(x: mx.array, dims: Any, keepdim: bool, correction: float) -> mx.array:
    axes = axes_of(dims, x.ndim)
    mean = mx.mean(x, axis=axes, keepdims=True)
    count = 1
    for a in axes:
        count *= x.shape[a]
    centered = x - mean
    return mx.sum(centered * centered, axis=axes, keepdims=keepdim) / max(count - correction, 0)


def _arg(fn: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def run(x: mx.array, dim: int | None, keepdim: bool) -> mx.array:
        (x,) = upcast(x)  # exact, and the order is the same
        if dim is None:
            out = fn(x.reshape(-1), axis=0)
            return (out.reshape((1,) * x.ndim) if keepdim else out).astype(mx.int64)
        return fn(x, axis=dim, keepdims=keepdim).astype(mx.int64)
    run.__name__ = fn.__name__
    return run


MLX_KERNELS.add("argmax", _arg(mx.argmax))
MLX_KERNELS.add("argmin", _arg(mx.argmin))


@kernel("softmax")
@in_float32
def softmax(x: mx.array, dim: int) -> mx.array:
    return mx.softmax(x, axis=dim)


@kernel("log_softmax")
@in_float32
def log_softmax(x: mx.array, dim: int) -> mx.array:
    return x - mx.logsumexp(x, axis=dim, keepdims=True)


# ---- scans ----
@kernel("cumsum")
def cumsum(x: mx.array, dim: int) -> mx.array:
    out = _accumulating(x)
    out = mx.cumsum(out, axis=dim) if x.ndim else out
    return out.astype(x.dtype) if x.dtype in LOW_PRECISION else out


@kernel("cumprod")
def cumprod(x: mx.array, dim: int) -> mx.array:
    """In float32 for half floats; small integers accumulate in int64 and come back in their own type."""
    if x.ndim == 0:
        return mx.array(x)
    return mx.cumprod(_accumulating(x), axis=dim).astype(x.dtype)


def _running(x: mx.array, dim: int, scan: Callable[..., mx.array]) -> tuple[mx.array, mx.array]:
    """Running extreme, and the index of the latest element equal to it (or the latest NaN), as PyTorch's
    `x >= best || isnan(x)` update rule gives."""
    if x.ndim == 0:
        return mx.array(x), mx.zeros((), dtype=mx.int64)
    (wide,) = upcast(x)
    values = scan(wide, axis=dim)
    update = wide == values
    if is_float(wide):
        update = update | mx.isnan(wide)
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    positions = mx.arange(x.shape[dim], dtype=mx.int64).reshape(shape)
    indices = mx.cummax(mx.where(update, positions, 0), axis=dim)
    return values.astype(x.dtype), indices


@kernel("cummax")
def cummax(x: mx.array, dim: int) -> tuple[mx.array, mx.array]:
    return _running(x, dim, mx.cummax)


@kernel("cummin")
def cummin(x: mx.array, dim: int) -> tuple[mx.array, mx.array]:
    return _running(x, dim, mx.cummin)


@kernel("logcumsumexp")
@in_float32
def logcumsumexp(x: mx.array, dim: int) -> mx.array:
    if x.ndim == 0:
        return mx.array(x)
    return mx.logcumsumexp(x, axis=dim)
