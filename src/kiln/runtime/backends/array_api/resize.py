"""Resampling kernels for both backends: separable nearest/linear upsampling and 2-d grid sampling, with PyTorch's
coordinate rules (source coordinates computed in float32 as its CPU kernels do, so the same pixels are picked).
Coordinates are computed where the data lives: a host table uploaded per call would stop a GPU method from being
captured."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import LOW_PRECISION, portable, upcast


def _scale(in_size: int, out_size: int, scales: tuple, axis: int, align_corners: bool) -> np.float32:
    if align_corners:
        return np.float32((in_size - 1) / (out_size - 1) if out_size > 1 else 0.0)
    if scales and scales[axis] > 0:
        return np.float32(1.0 / scales[axis])
    return np.float32(in_size / out_size)


def _nearest(xp: Any, x: Any, axis: int, out_size: int, scale: np.float32) -> Any:
    in_size = x.shape[axis]
    if out_size == in_size:
        return x
    src = xp.floor(xp.arange(out_size, dtype=np.float32) * scale).astype(np.int64)
    return xp.take(x, xp.minimum(src, in_size - 1), axis=axis)


def _linear(xp: Any, x: Any, axis: int, out_size: int, scale: np.float32, align_corners: bool) -> Any:
    in_size = x.shape[axis]
    dst = xp.arange(out_size, dtype=np.float32)
    src = dst * scale if align_corners else xp.maximum((dst + np.float32(0.5)) * scale - np.float32(0.5), 0)
    i0 = xp.minimum(src.astype(np.int64), in_size - 1)
    i1 = xp.minimum(i0 + 1, in_size - 1)
    lam = (src - i0).astype(x.dtype)
    shape = [1] * x.ndim
    shape[axis] = out_size
    lam = lam.reshape(shape)
    a, b = xp.take(x, i0, axis=axis), xp.take(x, i1, axis=axis)
    return a * (1 - lam) + b * lam


@portable("upsample")
def upsample(xp: Any, x: Any, size: Any, mode: str, align_corners: bool, scales: Any) -> Any:
    dtype = x.dtype
    (out,) = upcast(x) if mode == "linear" else (x,)
    nsp = len(size)
    if 0 in out.shape or 0 in size:
        return xp.zeros(x.shape[:-nsp] + tuple(size), dtype=dtype)
    for i, out_size in enumerate(size):
        axis = x.ndim - nsp + i
        scale = _scale(x.shape[axis], out_size, scales, i, align_corners)
        if mode == "nearest":
            out = _nearest(xp, out, axis, out_size, scale)
        else:
            out = _linear(xp, out, axis, out_size, scale, align_corners)
    return xp.ascontiguousarray(out).astype(dtype, copy=False)


def _unnormalize(coord: Any, size: int, align_corners: bool) -> Any:
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(xp: Any, coord: Any, twice_low: int, twice_high: int) -> Any:
    if twice_low == twice_high:
        return xp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = xp.abs(coord - low)
    extra = xp.fmod(coord, span)
    flips = xp.floor(coord / span)
    return xp.where(flips % 2 == 0, extra + low, span - extra + low)


def _source(xp: Any, coord: Any, size: int, padding_mode: str, align_corners: bool) -> Any:
    coord = _unnormalize(coord, size, align_corners)
    if padding_mode == "reflection":
        coord = _reflect(xp, coord, 0, 2 * (size - 1)) if align_corners else _reflect(xp, coord, -1, 2 * size - 1)
    if padding_mode in ("border", "reflection"):
        coord = xp.clip(coord, 0, size - 1)
    return coord


@portable("grid_sample")
def grid_sample(xp: Any, x: Any, grid: Any, mode: str, padding_mode: str, align_corners: bool) -> Any:
    dtype = x.dtype
    x, grid = upcast(x, grid)
    n, c, h, w = x.shape
    ix = _source(xp, grid[..., 0], w, padding_mode, align_corners)
    iy = _source(xp, grid[..., 1], h, padding_mode, align_corners)
    batch = xp.arange(n).reshape(n, 1, 1)
    out = xp.zeros((n,) + ix.shape[1:] + (c,), dtype=x.dtype)

    def tap(yy: Any, xx: Any, weight: Any) -> None:
        inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
        vals = x[batch, :, xp.clip(yy, 0, h - 1), xp.clip(xx, 0, w - 1)]  # [n, ho, wo, c]
        wgt = inside.astype(x.dtype) if weight is None else xp.where(inside, weight, 0).astype(x.dtype)
        out[...] += vals * wgt[..., None]

    if h and w and out.size:  # (NaN coordinates cast to integers: the backend's error mode keeps that quiet)
        if mode == "nearest":
            tap(xp.rint(iy).astype(np.int64), xp.rint(ix).astype(np.int64), None)
        else:
            x0, y0 = xp.floor(ix), xp.floor(iy)
            fx, fy = ix - x0, iy - y0
            x0, y0 = x0.astype(np.int64), y0.astype(np.int64)
            tap(y0, x0, (1 - fx) * (1 - fy))
            tap(y0, x0 + 1, fx * (1 - fy))
            tap(y0 + 1, x0, (1 - fx) * fy)
            tap(y0 + 1, x0 + 1, fx * fy)
    out = xp.ascontiguousarray(xp.moveaxis(out, -1, 1))
    return out.astype(dtype, copy=False) if dtype in LOW_PRECISION else out
