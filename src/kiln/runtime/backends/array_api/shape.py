"""Shape, view and creation kernels for both backends. Views stay views; nothing downstream writes in place
(writes that may go in place check that the array owns its memory)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import portable


@portable("reshape")
def reshape(xp: Any, x: Any, shape: Any) -> Any:
    return x.reshape(shape)


@portable("permute")
def permute(xp: Any, x: Any, perm: Any) -> Any:
    return x.transpose(perm)


@portable("expand")
def expand(xp: Any, x: Any, shape: Any) -> Any:
    return xp.broadcast_to(x, shape)


@portable("slice")
def slice_(xp: Any, x: Any, dim: int, start: int, end: int, step: int) -> Any:
    return x[(slice(None),) * dim + (slice(start, end, step),)]


@portable("cat")
def cat(xp: Any, *xs: Any, dim: int) -> Any:
    return xp.concatenate(xs, axis=dim)


@portable("flip")
def flip(xp: Any, x: Any, dims: Any) -> Any:
    return xp.flip(x, axis=tuple(dims))


@portable("copy")
def copy(xp: Any, x: Any) -> Any:
    return x.copy()


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


@portable("pad")
def pad(xp: Any, x: Any, pads: Any, mode: str, value: float) -> Any:
    widths = [(0, 0)] * x.ndim
    for i in range(len(pads) // 2):
        widths[x.ndim - 1 - i] = (pads[2 * i], pads[2 * i + 1])
    crop = tuple(slice(max(-b, 0), x.shape[d] - max(-a, 0)) for d, (b, a) in enumerate(widths))
    x = x[crop]
    widths = [(max(b, 0), max(a, 0)) for b, a in widths]
    if mode == "constant":
        return xp.pad(x, widths, mode="constant", constant_values=x.dtype.type(value))
    return xp.pad(x, widths, mode=_PAD_MODES[mode])


@portable("tril")
def tril(xp: Any, x: Any, diagonal: int) -> Any:
    return xp.tril(x, diagonal)


@portable("triu")
def triu(xp: Any, x: Any, diagonal: int) -> Any:
    return xp.triu(x, diagonal)


@portable("as_strided")
def as_strided(xp: Any, x: Any, size: Any, stride: Any, offset: int) -> Any:
    """A strided window (as_strided, diagonal, unfold) on the contiguous input, bounds-checked first."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or min(size + stride + (offset,), default=0) < 0:
        raise ValueError(f"as_strided: bad window size={list(size)} stride={list(stride)} offset={offset}")
    if 0 in size:
        return xp.empty(size, x.dtype)
    flat = xp.ascontiguousarray(x).reshape(-1)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= flat.size:
        raise ValueError(f"as_strided: window reaches element {last} of an input of {flat.size}")
    return xp.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=[s * flat.itemsize for s in stride])


# ---- creation ----
@portable("arange")
def arange(xp: Any, start: int, end: int, step: int, dtype: Any) -> Any:
    return xp.arange(start, end, step, dtype=np.int64).astype(dtype.numpy, copy=False)


@portable("arange_float")
def arange_float(xp: Any, start: float, end: float, step: float, dtype: Any, length: int) -> Any:
    return (start + xp.arange(length, dtype=np.float64) * step).astype(dtype.numpy)


@portable("full")
def full(xp: Any, shape: Any, value: float, dtype: Any) -> Any:
    return xp.full(shape, value, dtype=dtype.numpy)
