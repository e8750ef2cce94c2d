"""Reductions, softmax and scans for both backends.

Float16/bfloat16 reduce in float32 and round back, as PyTorch does. NumPy's ufuncs can accumulate any binary
operation; CuPy's only add and multiply, so the running max/min and log-sum-exp scans run as a log-step scan there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import LOW_PRECISION, PORTABLE, in_float32, portable, upcast


def _axes(dims: tuple[int, ...]) -> tuple[int, ...] | None:
    return tuple(dims) if dims else None


def _reducer(function: str) -> Callable[..., Any]:
    def run(xp: Any, x: Any, dims: tuple[int, ...], keepdim: bool) -> Any:
        wide = x.astype(np.float32) if x.dtype in LOW_PRECISION else x
        out = xp.asarray(getattr(xp, function)(wide, axis=_axes(dims), keepdims=keepdim))
        return out.astype(x.dtype) if x.dtype in LOW_PRECISION else out
    run.__name__ = function
    return run


for _name, _function in {"sum": "sum", "mean": "mean", "prod": "prod", "amax": "max", "amin": "min", "any": "any",
                         "all": "all"}.items():
    PORTABLE.add(_name, _reducer(_function))


@portable("var")
@in_float32
def var(xp: Any, x: Any, dims: tuple[int, ...], keepdim: bool, correction: float) -> Any:
    return xp.asarray(xp.var(x, axis=_axes(dims), ddof=correction, keepdims=keepdim))


@portable("argmax")
def argmax(xp: Any, x: Any, dim: int | None, keepdim: bool) -> Any:
    (x,) = upcast(x)  # exact, and the order is the same
    return xp.asarray(xp.argmax(x, axis=dim, keepdims=keepdim)).astype(np.int64, copy=False)


@portable("argmin")
def argmin(xp: Any, x: Any, dim: int | None, keepdim: bool) -> Any:
    (x,) = upcast(x)
    return xp.asarray(xp.argmin(x, axis=dim, keepdims=keepdim)).astype(np.int64, copy=False)


@portable("softmax")
@in_float32
def softmax(xp: Any, x: Any, dim: int) -> Any:
    e = xp.exp(x - xp.max(x, axis=dim, keepdims=True))
    e /= xp.sum(e, axis=dim, keepdims=True)
    return e


@portable("log_softmax")
@in_float32
def log_softmax(xp: Any, x: Any, dim: int) -> Any:
    shifted = x - xp.max(x, axis=dim, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=dim, keepdims=True))


# ---- scans ----
def accumulate(xp: Any, function: str, x: Any, axis: int) -> Any:
    """The running `function` (an associative binary ufunc) along axis: NumPy's ufunc.accumulate, or on other
    modules a Hillis-Steele scan (log2(n) whole-array steps, each combining every element with the one `step`
    before it)."""
    ufunc = getattr(xp, function)
    if xp is np:
        return ufunc.accumulate(x, axis=axis)
    out = xp.moveaxis(x, axis, 0).copy()
    step = 1
    while step < out.shape[0]:
        out[step:] = ufunc(out[step:], out[:-step])  # the right side is a new array: no element reads a new value
        step *= 2
    return xp.moveaxis(out, 0, axis)


@portable("cumsum")
def cumsum(xp: Any, x: Any, dim: int) -> Any:
    if x.dtype in LOW_PRECISION:
        return xp.cumsum(x.astype(np.float32), axis=dim).astype(x.dtype)
    if x.dtype.kind in "biu":
        return xp.cumsum(x, axis=dim, dtype=np.int64)
    return xp.cumsum(x, axis=dim)


@portable("cumprod")
@in_float32
def cumprod(xp: Any, x: Any, dim: int) -> Any:
    if x.ndim == 0:
        return x.copy()
    return xp.cumprod(x, axis=dim, dtype=x.dtype)


def _running(xp: Any, x: Any, dim: int, function: str) -> tuple[Any, Any]:
    """Running extreme, and the index of the latest element equal to it (or the latest NaN), as PyTorch's
    `x >= best || isnan(x)` update rule gives."""
    if x.ndim == 0:
        return x.copy(), xp.zeros((), np.int64)
    (wide,) = upcast(x)
    values = accumulate(xp, function, wide, dim)
    update = wide == values
    if wide.dtype.kind == "f":
        update |= xp.isnan(wide)
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    positions = xp.arange(x.shape[dim], dtype=np.int64).reshape(shape)
    indices = accumulate(xp, "maximum", xp.where(update, positions, 0), dim)
    return values.astype(x.dtype, copy=False), indices


@portable("cummax")
def cummax(xp: Any, x: Any, dim: int) -> tuple[Any, Any]:
    return _running(xp, x, dim, "maximum")


@portable("cummin")
def cummin(xp: Any, x: Any, dim: int) -> tuple[Any, Any]:
    return _running(xp, x, dim, "minimum")


@portable("logcumsumexp")
@in_float32
def logcumsumexp(xp: Any, x: Any, dim: int) -> Any:
    if x.ndim == 0:
        return x.copy()
    return accumulate(xp, "logaddexp", x, dim)
