"""Normalization kernels for both backends, computed in float32 for half-precision inputs.

(rms_norm is each backend's own: the CPU and GPU paths round differently, and the GPU has a fused kernel.)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import in_float32, portable, upcast


def rms_norm_eps(eps: float | None, dtype: Any) -> float:
    """RMSNorm's eps: the op's, or the machine epsilon of the input's dtype where the op leaves it unset (as
    torch.nn.functional.rms_norm does); every backend's RMSNorm kernels take it from here."""
    return float(np.finfo(dtype).eps) if eps is None else eps


@portable("layer_norm")
@in_float32
def layer_norm(xp: Any, x: Any, weight: Any, bias: Any, axes: int, eps: float) -> Any:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last `axes` dims."""
    weight, bias = upcast(weight, bias)
    dims = tuple(range(x.ndim - axes, x.ndim))
    centered = x - x.mean(axis=dims, keepdims=True)
    out = centered / xp.sqrt(xp.mean(centered * centered, axis=dims, keepdims=True) + x.dtype.type(eps))
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


@portable("batch_norm")
def batch_norm(xp: Any, x: Any, weight: Any, bias: Any, mean: Any, var: Any, eps: float) -> Any:
    """x * scale + shift with per-channel scale = weight / sqrt(var + eps) and shift = bias - mean * scale: the form
    PyTorch's CPU kernel uses too, and two passes over x instead of three."""
    dtype = x.dtype
    x, weight, bias, mean, var = upcast(x, weight, bias, mean, var)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    scale = 1 / xp.sqrt(var + var.dtype.type(eps))
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    out = x * scale.reshape(shape)
    out += shift.reshape(shape)
    return out.astype(dtype, copy=False)


@portable("group_norm")
def group_norm(xp: Any, x: Any, weight: Any = None, bias: Any = None, *, groups: int, eps: float) -> Any:
    """Statistics in float32 (float64 for float64 inputs) per (sample, group), as PyTorch's CPU kernel."""
    dtype = x.dtype
    (xf, weight, bias) = upcast(x, weight, bias)
    n, c = x.shape[:2]
    g = xf.reshape(n, groups, math.prod(x.shape[1:]) // groups)
    mean = g.mean(axis=2, keepdims=True) if g.shape[2] else xp.zeros((n, groups, 1), xf.dtype)
    centered = g - mean
    var = xp.mean(centered * centered, axis=2, keepdims=True) if g.shape[2] else mean
    out = (centered / xp.sqrt(var + xf.dtype.type(eps))).reshape(x.shape)
    channel = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(channel)
    if bias is not None:
        out = out + bias.reshape(channel)
    return out.astype(dtype, copy=False)
