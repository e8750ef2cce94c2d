"""Attention pieces for both backends: RoPE's rotation and the general scaled dot-product attention.

Each backend registers its own sdpa and rope around these (the CPU narrows attention to the visible keys, which on
a GPU would cost a host synchronization; the GPU has fused kernels for the common shapes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def rotate(xp: Any, x: Any, interleaved: bool) -> Any:
    """RoPE's partner values: cat(-x[..., D/2:], x[..., :D/2]), or (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    if interleaved:
        rotated = xp.empty_like(x)
        xp.negative(x[..., 1::2], out=rotated[..., 0::2])
        rotated[..., 1::2] = x[..., 0::2]
        return rotated
    half = x.shape[-1] // 2
    return xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def sdpa(xp: Any, q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None,
         matmul: Callable[[Any, Any], Any] | None = None, sinks: Any = None) -> Any:
    """softmax(q k^T * scale + mask) v in q's dtype (already float32 or wider), one batched matmul pair
    (`matmul`, xp.matmul unless the backend has its own). sinks [Hq]: each q head's sink logit, one more term of
    its softmax's sum with no value (a query that sees no key then gets zeros, not NaN).

    GQA without repeating k/v: q heads [.., Hkv * g, L, E] are viewed as [.., Hkv, g * L, E], one matmul per kv
    head for its whole group of q heads, and the mask (and the sinks) follow the same grouping.
    """
    L, S = q.shape[-2], k.shape[-2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    groups = 1
    if sinks is not None:
        sinks = sinks.astype(q.dtype).reshape(-1, 1, 1)  # [Hq, 1, 1]: a row per query of its head
        sinks = xp.broadcast_to(sinks, (sinks.shape[0], L, 1))
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
        if sinks is not None:
            sinks = sinks.reshape(heads, groups * L, 1)
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
    return matmul(_softmax(xp, scores, sinks), v).reshape(out_shape)


def _softmax(xp: Any, scores: Any, sinks: Any) -> Any:
    """softmax over the last dim of the scores, in place, with each row's sink logit (sinks broadcast against the
    scores' rows, or None) one more term of its sum."""
    top = xp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        top = xp.maximum(top, sinks)
    scores -= top
    xp.exp(scores, out=scores)
    total = xp.sum(scores, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + xp.exp(sinks - top)
    scores /= total
    return scores


def slot_visibility(key: Any, positions: Any, window: int) -> Any:
    """slot_attention's mask, in any array library: bool [B, 1, T, L], whether query t of sequence b sees the
    cache position key[j] (key [L]): key[j] <= positions[b, t], and > positions[b, t] - window when window > 0."""
    key = key[None, None, None, :]
    position = positions[:, None, :, None]
    visible = key <= position
    if window > 0:
        visible = visible & (key > position - window)
    return visible


def slot_attention(xp: Any, q: Any, keys: Any, values: Any, positions: Any, first: int, scale: float, window: int,
                   matmul: Callable[[Any, Any], Any] | None = None, sinks: Any = None) -> Any:
    """slot_attention over keys and values already gathered per sequence: q [B, Hq, T, E], keys [B, L, Hkv, E]
    and values [B, L, Hkv, Ev] holding the cache positions first .. first + L - 1 of each sequence's slot,
    positions [B, T], sinks [Hq] or None (as sdpa's); out [B, Hq, T, Ev] in q's dtype (float32 or wider).

    GQA as in sdpa: the q heads of a kv head are one [g * T, E] block, so each kv head is one matmul per sequence.
    """
    B, Hq, T, E = q.shape
    L, Hkv = keys.shape[1], keys.shape[2]
    groups = Hq // Hkv
    matmul = matmul or xp.matmul
    q = q.reshape(B, Hkv, groups * T, E)
    scores = matmul(q, xp.transpose(keys, (0, 2, 3, 1)))  # [B, Hkv, g * T, L]
    scores *= scores.dtype.type(scale)
    visible = slot_visibility(xp.arange(L) + first, positions, window)  # the same for every q head of a group
    scores = scores.reshape(B, Hkv, groups, T, L)
    scores = xp.where(visible[:, :, None], scores, -xp.inf)
    if sinks is not None:
        sinks = sinks.astype(scores.dtype).reshape(Hkv, groups, 1, 1)  # a q head's, for each of its queries
    scores = _softmax(xp, scores, sinks)
    out = matmul(scores.reshape(B, Hkv, groups * T, L), xp.transpose(values, (0, 2, 1, 3)))
    return out.reshape(B, Hq, T, values.shape[-1])
