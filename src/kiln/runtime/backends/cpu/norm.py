"""Normalization kernels, computed in float32 for half-precision inputs."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends import array_api
from kiln.runtime.backends.cpu.registry import in_float32, kernel, upcast


@kernel("layer_norm")
@in_float32
def layer_norm(x: np.ndarray, weight, bias, axes: int, eps: float) -> np.ndarray:
    weight, bias = upcast(weight, bias)
    return array_api.layer_norm(np, x, weight, bias, axes, eps)


@kernel("rms_norm")
def rms_norm(x: np.ndarray, weight, axes: int, eps: float | None) -> np.ndarray:
    dtype = x.dtype
    if eps is None:
        eps = float(np.finfo(dtype).eps)
    (xf, weight) = upcast(x, weight)
    dims = tuple(range(x.ndim - axes, x.ndim))
    out = xf / np.sqrt(np.mean(xf * xf, axis=dims, keepdims=True) + xf.dtype.type(eps))
    if weight is not None:
        out = out * weight
    return out.astype(dtype, copy=False)


@kernel("batch_norm")
def batch_norm(x: np.ndarray, weight, bias, mean, var, eps: float) -> np.ndarray:
    """x * scale + shift with per-channel scale = weight / sqrt(var + eps) and shift = bias - mean * scale: the form
    PyTorch's CPU kernel uses too, and two passes over x instead of three."""
    dtype = x.dtype
    x, weight, bias, mean, var = upcast(x, weight, bias, mean, var)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    scale = 1 / np.sqrt(var + var.dtype.type(eps))
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    out = x * scale.reshape(shape)
    out += shift.reshape(shape)
    return out.astype(dtype, copy=False)


@kernel("group_norm")
def group_norm(x: np.ndarray, weight=None, bias=None, *, groups: int, eps: float) -> np.ndarray:
    """Statistics in float32 (float64 for float64 inputs) per (sample, group), as PyTorch's CPU kernel."""
    dtype = x.dtype
    (xf, weight, bias) = upcast(x, weight, bias)
    n, c = x.shape[:2]
    g = xf.reshape(n, groups, int(np.prod(x.shape[1:])) // groups)
    mean = g.mean(axis=2, keepdims=True) if g.shape[2] else np.zeros((n, groups, 1), xf.dtype)
    centered = g - mean
    var = np.mean(centered * centered, axis=2, keepdims=True) if g.shape[2] else mean
    out = (centered / np.sqrt(var + xf.dtype.type(eps))).reshape(x.shape)
    channel = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(channel)
    if bias is not None:
        out = out + bias.reshape(channel)
    return out.astype(dtype, copy=False)
