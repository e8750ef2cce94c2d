"""RMSNorm on the CPU, alone and after a residual add, and LayerNorm: float32 rows in one compiled call (the other
normalizations, and other dtypes, are portable: kiln.runtime.backends.array_api.norm)."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.array_api import norm as portable
from kiln.runtime.backends.array_api.norm import rms_norm_eps
from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.registry import kernel, upcast


@kernel("rms_norm")
def rms_norm(x: np.ndarray, weight, axes: int, eps: float | None) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) in float32 for half inputs (the GPU's fused kernel multiplies by the reciprocal
    instead, so the two are separate). float32 rows go to the compiled helpers in one call."""
    dtype = x.dtype
    eps = rms_norm_eps(eps, dtype)
    done = native.add_rms_norm(x, None, weight, axes, eps)
    if done is not None:
        return done[1]
    (xf, weight) = upcast(x, weight)
    dims = tuple(range(x.ndim - axes, x.ndim))
    out = xf / np.sqrt(np.mean(xf * xf, axis=dims, keepdims=True) + xf.dtype.type(eps))
    if weight is not None:
        out = out * weight
    return out.astype(dtype, copy=False)


@kernel("add_rms_norm")
def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight, axes: int, eps: float | None) -> tuple:
    """x + residual (in x's dtype, as the add kernel computes it), and its RMSNorm; float32 in one compiled call."""
    done = native.add_rms_norm(x, residual, weight, axes, rms_norm_eps(eps, x.dtype))
    if done is not None:
        return done
    total = x + residual
    return total, rms_norm(total, weight, axes, eps)


@kernel("layer_norm")
def layer_norm(x: np.ndarray, weight, bias, axes: int, eps: float) -> np.ndarray:
    done = native.layer_norm(x, weight, bias, axes, eps)
    return portable.layer_norm(np, x, weight, bias, axes, eps) if done is None else done
