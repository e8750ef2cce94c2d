"""Scan kernels beyond cumsum: cumprod, cummax/cummin with indices, logcumsumexp."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import LOW_PRECISION, in_float32, kernel


@kernel("cumprod")
@in_float32
def cumprod(x: np.ndarray, dim: int) -> np.ndarray:
    if x.ndim == 0:
        return x.copy()
    return np.cumprod(x, axis=dim, dtype=x.dtype)


def _running(x: np.ndarray, dim: int, ufunc: np.ufunc) -> tuple[np.ndarray, np.ndarray]:
    """Running extreme, and the index of the latest element equal to it (or the latest NaN), as PyTorch's
    `x >= best || isnan(x)` update rule gives."""
    if x.ndim == 0:
        return x.copy(), np.zeros((), np.int64)
    wide = x.astype(np.float32) if x.dtype in LOW_PRECISION else x
    values = ufunc.accumulate(wide, axis=dim)
    update = wide == values
    if wide.dtype.kind == "f":
        update |= np.isnan(wide)
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    positions = np.arange(x.shape[dim], dtype=np.int64).reshape(shape)
    indices = np.maximum.accumulate(np.where(update, positions, 0), axis=dim)
    return values.astype(x.dtype, copy=False), indices


@kernel("cummax")
def cummax(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    return _running(x, dim, np.maximum)


@kernel("cummin")
def cummin(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    return _running(x, dim, np.minimum)


@kernel("logcumsumexp")
@in_float32
def logcumsumexp(x: np.ndarray, dim: int) -> np.ndarray:
    if x.ndim == 0:
        return x.copy()
    return np.logaddexp.accumulate(x, axis=dim)
