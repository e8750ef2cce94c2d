"""Resampling kernels: separable nearest/linear upsampling and 2-d grid sampling, with PyTorch's coordinate rules
(source coordinates computed in float32 as its CPU kernels do, so the same pixels are picked)."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel, upcast


def _scale(in_size: int, out_size: int, scales: tuple, axis: int, align_corners: bool) -> np.float32:
    if align_corners:
        return np.float32((in_size - 1) / (out_size - 1) if out_size > 1 else 0.0)
    if scales and scales[axis] > 0:
        return np.float32(1.0 / scales[axis])
    return np.float32(in_size / out_size)


def _nearest(x: np.ndarray, axis: int, out_size: int, scale: np.float32) -> np.ndarray:
    in_size = x.shape[axis]
    if out_size == in_size:
        return x
    src = np.floor(np.arange(out_size, dtype=np.float32) * scale).astype(np.int64)
    return np.take(x, np.minimum(src, in_size - 1), axis=axis)


def _linear(x: np.ndarray, axis: int, out_size: int, scale: np.float32, align_corners: bool) -> np.ndarray:
    in_size = x.shape[axis]
    dst = np.arange(out_size, dtype=np.float32)
    src = dst * scale if align_corners else np.maximum((dst + np.float32(0.5)) * scale - np.float32(0.5), 0)
    i0 = np.minimum(src.astype(np.int64), in_size - 1)
    i1 = np.minimum(i0 + 1, in_size - 1)
    lam = (src - i0).astype(x.dtype)
    shape = [1] * x.ndim
    shape[axis] = out_size
    lam = lam.reshape(shape)
    a, b = np.take(x, i0, axis=axis), np.take(x, i1, axis=axis)
    return a * (1 - lam) + b * lam


@kernel("upsample")
def upsample(x: np.ndarray, size, mode: str, align_corners: bool, scales) -> np.ndarray:
    dtype = x.dtype
    (out,) = upcast(x) if mode == "linear" else (x,)
    nsp = len(size)
    if 0 in out.shape or 0 in size:
        return np.zeros(x.shape[:-nsp] + tuple(size), dtype=dtype)
    for i, out_size in enumerate(size):
        axis = x.ndim - nsp + i
        scale = _scale(x.shape[axis], out_size, scales, i, align_corners)
        if mode == "nearest":
            out = _nearest(out, axis, out_size, scale)
        else:
            out = _linear(out, axis, out_size, scale, align_corners)
    return np.ascontiguousarray(out).astype(dtype, copy=False)


def _unnormalize(coord: np.ndarray, size: int, align_corners: bool) -> np.ndarray:
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord: np.ndarray, twice_low: int, twice_high: int) -> np.ndarray:
    if twice_low == twice_high:
        return np.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = np.abs(coord - low)
    extra = np.fmod(coord, span)
    flips = np.floor(coord / span)
    return np.where(flips % 2 == 0, extra + low, span - extra + low)


def _source(coord: np.ndarray, size: int, padding_mode: str, align_corners: bool) -> np.ndarray:
    coord = _unnormalize(coord, size, align_corners)
    if padding_mode == "reflection":
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
    if padding_mode in ("border", "reflection"):
        coord = np.clip(coord, 0, size - 1)
    return coord


@kernel("grid_sample")
def grid_sample(x: np.ndarray, grid: np.ndarray, mode: str, padding_mode: str, align_corners: bool) -> np.ndarray:
    dtype = x.dtype
    x, grid = upcast(x, grid)
    n, c, h, w = x.shape
    ix = _source(grid[..., 0], w, padding_mode, align_corners)
    iy = _source(grid[..., 1], h, padding_mode, align_corners)
    batch = np.arange(n).reshape(n, 1, 1)
    out = np.zeros((n,) + ix.shape[1:] + (c,), dtype=x.dtype)

    def tap(yy: np.ndarray, xx: np.ndarray, weight: np.ndarray | None) -> None:
        inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
        vals = x[batch, :, np.clip(yy, 0, h - 1), np.clip(xx, 0, w - 1)]  # [n, ho, wo, c]
        wgt = inside.astype(x.dtype) if weight is None else np.where(inside, weight, 0).astype(x.dtype)
        out[...] += vals * wgt[..., None]

    if h and w and out.size:
        with np.errstate(invalid="ignore"):
            if mode == "nearest":
                tap(np.rint(iy).astype(np.int64), np.rint(ix).astype(np.int64), None)
            else:
                x0, y0 = np.floor(ix), np.floor(iy)
                fx, fy = ix - x0, iy - y0
                x0, y0 = x0.astype(np.int64), y0.astype(np.int64)
                tap(y0, x0, (1 - fx) * (1 - fy))
                tap(y0, x0 + 1, fx * (1 - fy))
                tap(y0 + 1, x0, (1 - fx) * fy)
                tap(y0 + 1, x0 + 1, fx * fy)
    out = np.moveaxis(out, -1, 1)
    return np.ascontiguousarray(out).astype(dtype, copy=False) if dtype in LOW_PRECISION else np.ascontiguousarray(out)
