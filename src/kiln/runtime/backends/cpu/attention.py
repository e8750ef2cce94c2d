"""Scaled dot-product attention: one batched matmul pair with a stable softmax, GQA by head grouping."""

from __future__ import annotations

import math

import numpy as np

from kiln.runtime.backends.cpu.registry import kernel, upcast


def _visible_keys(k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k, v and mask narrowed to the key range that some query may see.

    A static KV cache is attended as a whole (max_context slots) with a mask hiding the slots not written yet, so
    without this, attention costs as much at position 10 as at the end of the context. Keys that no query sees
    contribute exp(-inf) = 0, so dropping them changes nothing; the range is read from the mask at run time.
    """
    S = k.shape[-2]
    if mask.shape[-1] != S or S < 2:
        return k, v, mask
    seen = mask.reshape(-1, S).any(axis=0)
    if seen.all() or not seen.any():
        return k, v, mask
    lo, hi = int(np.argmax(seen)), S - int(np.argmax(seen[::-1]))
    return k[..., lo:hi, :], v[..., lo:hi, :], mask[..., lo:hi]


@kernel("sdpa")
def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, causal: bool,
         scale: float | None) -> np.ndarray:
    dtype = q.dtype
    q, k, v, mask = upcast(q, k, v, mask)
    if mask is not None and mask.dtype == np.bool_ and not causal:
        k, v, mask = _visible_keys(k, v, mask)
    L, S = q.shape[-2], k.shape[-2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    groups = 1
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        # GQA without repeating k/v: q heads [.., Hkv * g, L, E] viewed as [.., Hkv, g * L, E], one matmul per kv
        # head for its whole group of q heads (the mask follows the same grouping)
        heads, groups = k.shape[-3], q.shape[-3] // k.shape[-3]
        q = q.reshape(q.shape[:-3] + (heads, groups * L, q.shape[-1]))
        if mask is not None and mask.ndim >= 3 and mask.shape[-3] != 1:  # a mask per q head: regroup it too
            mask = np.broadcast_to(mask, mask.shape[:-3] + (heads * groups, L, S))
            mask = mask.reshape(mask.shape[:-3] + (heads, groups * L, S))
        elif mask is not None:  # one mask for all heads: its rows repeat once per q head of a group
            mask = np.broadcast_to(mask, mask.shape[:-2] + (L, S))
            mask = np.concatenate([mask] * groups, axis=-2)
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1])
    scores = np.matmul(q, np.swapaxes(k, -1, -2))
    scores *= scores.dtype.type(scale)
    if causal:
        keep = np.tril(np.ones((L, S), dtype=bool))
        scores = np.where(np.tile(keep, (groups, 1)), scores, -np.inf)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + mask
    scores -= np.max(scores, axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= np.sum(scores, axis=-1, keepdims=True)
    return np.matmul(scores, v).reshape(out_shape).astype(dtype, copy=False)



@kernel("rope")
def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False) -> np.ndarray:
    if interleaved:
        rotated = np.empty_like(x)
        np.negative(x[..., 1::2], out=rotated[..., 0::2])
        rotated[..., 1::2] = x[..., 0::2]
    else:
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos
    out += rotated * sin
    return out.astype(x.dtype, copy=False)
