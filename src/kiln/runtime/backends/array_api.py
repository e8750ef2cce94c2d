"""Kernels written once against the NumPy API, for every backend whose arrays follow it (NumPy, CuPy).

Each takes the array module `xp` first. A backend registers them bound to its module and adds what only it can do
around them (the CPU narrows attention to the visible keys, which on a GPU would cost a host synchronization).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
LOW_PRECISION = (np.dtype(np.float16), BFLOAT16)
"""Float types whose math runs in float32 and is rounded back, as PyTorch computes them."""


def upcast(*arrays: Any) -> tuple[Any, ...]:
    """float16/bfloat16 arrays as float32 (for accumulation); others (and None) unchanged."""
    return tuple(a.astype(np.float32) if a is not None and a.dtype in LOW_PRECISION else a for a in arrays)


def rotate(xp: Any, x: Any, interleaved: bool) -> Any:
    """RoPE's partner values: cat(-x[..., D/2:], x[..., :D/2]), or (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    if interleaved:
        rotated = xp.empty_like(x)
        xp.negative(x[..., 1::2], out=rotated[..., 0::2])
        rotated[..., 1::2] = x[..., 0::2]
        return rotated
    half = x.shape[-1] // 2
    return xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def softmax(xp: Any, x: Any, dim: int) -> Any:
    e = xp.exp(x - xp.max(x, axis=dim, keepdims=True))
    e /= xp.sum(e, axis=dim, keepdims=True)
    return e


def layer_norm(xp: Any, x: Any, weight: Any, bias: Any, axes: int, eps: float) -> Any:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last `axes` dims, x float32 or wider."""
    dims = tuple(range(x.ndim - axes, x.ndim))
    centered = x - x.mean(axis=dims, keepdims=True)
    out = centered / xp.sqrt(xp.mean(centered * centered, axis=dims, keepdims=True) + x.dtype.type(eps))
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def sdpa(xp: Any, q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None,
         matmul: Callable[[Any, Any], Any] | None = None) -> Any:
    """softmax(q k^T * scale + mask) v in q's dtype (already float32 or wider), one batched matmul pair
    (`matmul`, xp.matmul unless the backend has its own).

    GQA without repeating k/v: q heads [.., Hkv * g, L, E] are viewed as [.., Hkv, g * L, E], one matmul per kv
    head for its whole group of q heads, and the mask follows the same grouping.
    """
    L, S = q.shape[-2], k.shape[-2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    groups = 1
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        heads, groups = k.shape[-3], q.shape[-3] // k.shape[-3]
        q = q.reshape(q.shape[:-3] + (heads, groups * L, q.shape[-1]))
        if mask is not None and mask.ndim >= 3 and mask.shape[-3] != 1:  # a mask per q head: regroup it too
            mask = xp.broadcast_to(mask, mask.shape[:-3] + (heads * groups, L, S))
            mask = mask.reshape(mask.shape[:-3] + (heads, groups * L, S))
        elif mask is not None and mask.shape[-2] != 1:  # one mask for all heads: its rows repeat per q head
            mask = xp.broadcast_to(mask, mask.shape[:-2] + (L, S))
            mask = xp.concatenate([mask] * groups, axis=-2)
        # (a mask with one row for every query, as in a decode step, broadcasts over the grouped rows as it is)
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1])
    matmul = matmul or xp.matmul
    scores = matmul(q, xp.swapaxes(k, -1, -2))
    scores *= scores.dtype.type(scale)
    if causal:
        keep = xp.tril(xp.ones((L, S), dtype=xp.bool_))
        scores = xp.where(xp.tile(keep, (groups, 1)), scores, -xp.inf)
    if mask is not None:
        scores = xp.where(mask, scores, -xp.inf) if mask.dtype == xp.bool_ else scores + mask
    scores -= xp.max(scores, axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= xp.sum(scores, axis=-1, keepdims=True)
    return matmul(scores, v).reshape(out_shape)


def div(xp: Any, a: Any, b: Any, rounding_mode: str) -> Any:
    """a / b: true division, or rounded toward -inf ("floor") or toward zero ("trunc", on integers too, where
    floor division alone would round negative quotients the wrong way)."""
    if rounding_mode == "floor":
        return xp.floor_divide(a, b)
    if rounding_mode == "trunc":
        if a.dtype.kind == "f" or xp.result_type(a, b).kind == "f":
            return xp.trunc(a / b).astype(a.dtype)
        q = xp.floor_divide(a, b)
        return q + ((xp.remainder(a, b) != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
    return xp.true_divide(a, b)
