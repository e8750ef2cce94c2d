"""Resampling: separable nearest/linear upsampling and 2-d grid sampling, with PyTorch's coordinate rules. Where
the source positions depend only on the shapes (upsampling) they are computed with NumPy, in float32 as PyTorch's
CPU kernels compute them, and enter the graph as constants; grid sampling computes them from the grid."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kiln.runtime.backends.mlx.arrays import LOW_PRECISION
from kiln.runtime.backends.mlx.registry import kernel, upcast


def _scale(in_size: int, out_size: int, scales: Any, axis: int, align_corners: bool) -> np.float32:
    if align_corners:
        return np.float32((in_size - 1) / (out_size - 1) if out_size > 1 else 0.0)
    if scales and scales[axis] > 0:
        return np.float32(1.0 / scales[axis])
    return np.float32(in_size / out_size)


def _nearest(x: mx.array, axis: int, out_size: int, scale: np.float32) -> mx.array:
    in_size = x.shape[axis]
    if out_size == in_size:
        return x
    src = np.floor(np.arange(out_size, dtype=np.float32) * scale).astype(np.int32)
    return mx.take(x, mx.array(np.minimum(src, in_size - 1)), axis=axis)


def _linear(x: mx.array, axis: int, out_size: int, scale: np.float32, align_corners: bool) -> mx.array:
    in_size = x.shape[axis]
    dst = np.arange(out_size, dtype=np.float32)
    src = dst * scale if align_corners else np.maximum((dst + np.float32(0.5)) * scale - np.float32(0.5), 0)
    i0 = np.minimum(src.astype(np.int64), in_size - 1)
    i1 = np.minimum(i0 + 1, in_size - 1)
    shape = [1] * x.ndim
    shape[axis] = out_size
    lam = mx.array((src - i0).astype(np.float32).reshape(shape)).astype(x.dtype)
    a = mx.take(x, mx.array(i0.astype(np.int32)), axis=axis)
    b = mx.take(x, mx.array(i1.astype(np.int32)), axis=axis)
    return a * (1 - lam) + b * lam


@kernel("upsample")
def upsample(x: mx.array, size: Any, mode: str, align_corners: bool, scales: Any) -> mx.array:
    dtype = x.dtype
    out = upcast(x)[0] if mode == "linear" else x
    nsp = len(size)
    if 0 in out.shape or 0 in size:
        return mx.zeros(x.shape[:-nsp] + tuple(size), dtype=dtype)
    for i, out_size in enumerate(size):
        axis = x.ndim - nsp + i
        scale = _scale(x.shape[axis], out_size, scales, i, align_corners)
        if mode == "nearest":
            out = _nearest(out, axis, out_size, scale)
        else:
            out = _linear(out, axis, out_size, scale, align_corners)
    return out.astype(dtype)


def _unnormalize(coord: mx.array, size: int, align_corners: bool) -> mx.array:
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord: mx.array, twice_low: int, twice_high: int) -> mx.array:
    if twice_low == twice_high:
        return mx.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = mx.abs(coord - low)
    extra = mx.remainder(coord, span)  # coord >= 0: remainder is fmod
    flips = mx.floor(coord / span)
    return mx.where(mx.remainder(flips, 2) == 0, extra + low, span - extra + low)


def _source(coord: mx.array, size: int, padding_mode: str, align_corners: bool) -> mx.array:
    coord = _unnormalize(coord, size, align_corners)
    if padding_mode == "reflection":
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
    if padding_mode in ("border", "reflection"):
        coord = mx.clip(coord, 0, size - 1)
    return coord


@kernel("grid_sample")
def grid_sample(x: mx.array, grid: mx.array, mode: str, padding_mode: str, align_corners: bool) -> mx.array:
    dtype = x.dtype
    x, grid = upcast(x, grid)
    n, c, h, w = x.shape
    ix = _source(grid[..., 0], w, padding_mode, align_corners)
    iy = _source(grid[..., 1], h, padding_mode, align_corners)
    batch = mx.arange(n).reshape(n, 1, 1)
    out = mx.zeros((n,) + tuple(ix.shape[1:]) + (c,), dtype=x.dtype)
    if not (h and w and out.size):
        return mx.moveaxis(out, -1, 1).astype(dtype)

    def tap(yy: mx.array, xx: mx.array, weight: mx.array | None) -> mx.array:
        inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
        vals = x[batch, :, mx.clip(yy, 0, h - 1), mx.clip(xx, 0, w - 1)]  # [n, ho, wo, c]
        wgt = inside.astype(x.dtype) if weight is None else mx.where(inside, weight, 0).astype(x.dtype)
        return vals * wgt[..., None]

    if mode == "nearest":
        out = tap(mx.round(iy).astype(mx.int32), mx.round(ix).astype(mx.int32), None)
    else:
        x0, y0 = mx.floor(ix), mx.floor(iy)
        fx, fy = ix - x0, iy - y0
        x0, y0 = x0.astype(mx.int32), y0.astype(mx.int32)
        out = (tap(y0, x0, (1 - fx) * (1 - fy)) + tap(y0, x0 + 1, fx * (1 - fy)) + tap(y0 + 1, x0, (1 - fx) * fy)
               + tap(y0 + 1, x0 + 1, fx * fy))
    out = mx.moveaxis(out, -1, 1)
    return out.astype(dtype) if dtype in LOW_PRECISION else out
