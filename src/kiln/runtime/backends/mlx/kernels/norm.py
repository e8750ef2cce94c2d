"""Normalizations: LayerNorm and RMSNorm on MLX's fused kernels (mx.fast), over the last axis, or over the last
`axes` flattened into one; batch and group norm composed, in float32 for half floats."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from kiln.runtime.backends.array_api.norm import rms_norm_eps
from kiln.runtime.backends.mlx.arrays import NUMPY_OF_MX
from kiln.runtime.backends.mlx.registry import kernel, upcast


def _over_last(x: mx.array, weight: mx.array | None, bias: mx.array | None, axes: int):
    """x, weight and bias with the last `axes` dims as one (a view), and the shape to give the result back."""
    if axes == 1:
        return x, weight, bias
    lead = x.shape[:x.ndim - axes]
    flat = (-1,)
    return (x.reshape(lead + (math.prod(x.shape[x.ndim - axes:]),)),
            None if weight is None else weight.reshape(flat), None if bias is None else bias.reshape(flat))


@kernel("layer_norm")
def layer_norm(x: mx.array, weight: mx.array | None = None, bias: mx.array | None = None, *, axes: int,
               eps: float) -> mx.array:
    flat, w, b = _over_last(*upcast(x, weight, bias), axes)
    return mx.fast.layer_norm(flat, w, b, eps).reshape(x.shape).astype(x.dtype)


@kernel("rms_norm")
def rms_norm(x: mx.array, weight: mx.array | None = None, *, axes: int, eps: float | None) -> mx.array:
    eps = rms_norm_eps(eps, NUMPY_OF_MX[x.dtype])
    flat, w, _ = _over_last(*upcast(x, weight), None, axes)
    return mx.fast.rms_norm(flat, w, eps).reshape(x.shape).astype(x.dtype)


@kernel("add_rms_norm")
def add_rms_norm(x: mx.array, residual: mx.array, weight: mx.array | None = None, axes: int = 1,
                 eps: float | None = None) -> tuple[mx.array, mx.array]:
    total = x + residual
    return total, rms_norm(total, weight, axes=axes, eps=eps)


@kernel("batch_norm")
def batch_norm(x: mx.array, weight: Any, bias: Any, mean: mx.array, var: mx.array, eps: float) -> mx.array:
    """x * scale + shift with per-channel scale = weight / sqrt(var + eps), shift = bias - mean * scale."""
    dtype = x.dtype
    x, weight, bias, mean, var = upcast(x, weight, bias, mean, var)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    scale = mx.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    return (x * scale.reshape(shape) + shift.reshape(shape)).astype(dtype)


@kernel("group_norm")
def group_norm(x: mx.array, weight: Any = None, bias: Any = None, *, groups: int, eps: float) -> mx.array:
    dtype = x.dtype
    xf, weight, bias = upcast(x, weight, bias)
    n, c = x.shape[:2]
    g = xf.reshape(n, groups, math.prod(x.shape[1:]) // groups)
    if g.shape[2] == 0:
        return x
    centered = g - mx.mean(g, axis=2, keepdims=True)
    var = mx.mean(centered * centered, axis=2, keepdims=True)
    out = (centered / mx.sqrt(var + eps)).reshape(x.shape)
    channel = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(channel)
    if bias is not None:
        out = out + bias.reshape(channel)
    return out.astype(dtype)
