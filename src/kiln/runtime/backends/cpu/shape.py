"""Shape and view kernels. They return NumPy views where NumPy can; nothing downstream writes in place."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.cpu.registry import kernel


@kernel("reshape")
def reshape(x: np.ndarray, shape) -> np.ndarray:
    return x.reshape(shape)


@kernel("permute")
def permute(x: np.ndarray, perm) -> np.ndarray:
    return x.transpose(perm)


@kernel("expand")
def expand(x: np.ndarray, shape) -> np.ndarray:
    return np.broadcast_to(x, shape)


@kernel("slice")
def slice_(x: np.ndarray, dim: int, start: int, end: int, step: int) -> np.ndarray:
    return x[(slice(None),) * dim + (slice(start, end, step),)]


@kernel("cat")
def cat(*xs: np.ndarray, dim: int) -> np.ndarray:
    return np.concatenate(xs, axis=dim)


@kernel("flip")
def flip(x: np.ndarray, dims) -> np.ndarray:
    return np.flip(x, axis=tuple(dims))


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


@kernel("pad")
def pad(x: np.ndarray, pads, mode: str, value: float) -> np.ndarray:
    widths = [(0, 0)] * x.ndim
    for i in range(len(pads) // 2):
        widths[x.ndim - 1 - i] = (pads[2 * i], pads[2 * i + 1])
    crop = tuple(slice(max(-b, 0), x.shape[d] - max(-a, 0)) for d, (b, a) in enumerate(widths))
    x = x[crop]
    widths = [(max(b, 0), max(a, 0)) for b, a in widths]
    if mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=x.dtype.type(value))
    return np.pad(x, widths, mode=_PAD_MODES[mode])


@kernel("tril")
def tril(x: np.ndarray, diagonal: int) -> np.ndarray:
    return np.tril(x, diagonal)


@kernel("triu")
def triu(x: np.ndarray, diagonal: int) -> np.ndarray:
    return np.triu(x, diagonal)


@kernel("copy")
def copy(x: np.ndarray) -> np.ndarray:
    return np.array(x, copy=True)
