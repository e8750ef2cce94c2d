"""Reductions, scans and softmax."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends import array_api
from kiln.runtime.backends.cpu.registry import LOW_PRECISION, in_float32, kernel


def _axes(dims: tuple[int, ...]) -> tuple[int, ...] | None:
    return tuple(dims) if dims else None


def _reducer(fn):
    def run(x: np.ndarray, dims: tuple[int, ...], keepdim: bool) -> np.ndarray:
        if x.dtype in LOW_PRECISION:
            return np.asarray(fn(x.astype(np.float32), axis=_axes(dims), keepdims=keepdim)).astype(x.dtype)
        return np.asarray(fn(x, axis=_axes(dims), keepdims=keepdim))
    return run


for _name, _fn in {"sum": np.sum, "mean": np.mean, "prod": np.prod, "amax": np.max, "amin": np.min,
                   "any": np.any, "all": np.all}.items():
    kernel(_name)(_reducer(_fn))


@kernel("var")
@in_float32
def var(x: np.ndarray, dims: tuple[int, ...], keepdim: bool, correction: float) -> np.ndarray:
    return np.asarray(np.var(x, axis=_axes(dims), ddof=correction, keepdims=keepdim))


@kernel("argmax")
def argmax(x: np.ndarray, dim: int | None, keepdim: bool) -> np.ndarray:
    return np.asarray(np.argmax(x, axis=dim, keepdims=keepdim), dtype=np.int64)


@kernel("argmin")
def argmin(x: np.ndarray, dim: int | None, keepdim: bool) -> np.ndarray:
    return np.asarray(np.argmin(x, axis=dim, keepdims=keepdim), dtype=np.int64)


@kernel("cumsum")
def cumsum(x: np.ndarray, dim: int) -> np.ndarray:
    if x.dtype in LOW_PRECISION:
        return np.cumsum(x.astype(np.float32), axis=dim).astype(x.dtype)
    if x.dtype.kind in "biu":
        return np.cumsum(x, axis=dim, dtype=np.int64)
    return np.cumsum(x, axis=dim)


@kernel("softmax")
@in_float32
def softmax(x: np.ndarray, dim: int) -> np.ndarray:
    return array_api.softmax(np, x, dim)


@kernel("log_softmax")
@in_float32
def log_softmax(x: np.ndarray, dim: int) -> np.ndarray:
    shifted = x - np.max(x, axis=dim, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=dim, keepdims=True))
