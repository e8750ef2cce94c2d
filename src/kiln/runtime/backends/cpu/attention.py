"""Scaled dot-product attention: one batched matmul pair with a stable softmax, GQA by head grouping."""

from __future__ import annotations

import math

import numpy as np

from kiln.runtime.backends.cpu.registry import kernel, upcast


@kernel("sdpa")
def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, causal: bool,
         scale: float | None) -> np.ndarray:
    dtype = q.dtype
    q, k, v, mask = upcast(q, k, v, mask)
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1])
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    L, S = q.shape[-2], k.shape[-2]
    if causal:
        scores = np.where(np.tril(np.ones((L, S), dtype=bool)), scores, -np.inf)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + mask
    scores = scores - np.max(scores, axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= np.sum(scores, axis=-1, keepdims=True)
    return np.matmul(scores, v).astype(dtype, copy=False)
