"""Attention: scaled dot-product attention on MLX's fused kernel (mx.fast.scaled_dot_product_attention, which
takes GQA's fewer k/v heads as they are), and RoPE composed from its definition; prepare.py maps RoPE whose cos
and sin come from a rotary table onto mx.fast.rope.

kiln's causal mask is top-left aligned, MLX's "causal" bottom-right: they agree for square scores only, so other
shapes get the mask spelled out. A query whose keys are all masked gets NaN, as PyTorch gives it (MLX's fused
kernel returns a finite value there). On the CPU device MLX runs attention as a composition that rounds the scores
to the input's type, so float16/bfloat16 attention is computed in float32 there, as PyTorch computes it; Apple
GPUs run MLX's fused kernel, which accumulates in float32 itself.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from kiln.runtime.backends.array_api.attention import slot_visibility
from kiln.runtime.backends.mlx.kernels.index import write_at
from kiln.runtime.backends.mlx.registry import kernel, on_cpu, upcast


def _as4(x: mx.array) -> mx.array:
    """[*lead, H, N, E] (or [N, E], [H, N, E]) as MLX's rank-4 [B, H, N, E]."""
    if x.ndim == 2:
        return x[None, None]
    if x.ndim == 3:
        return x[None]
    return x.reshape((-1,) + x.shape[-3:]) if x.ndim > 4 else x


def _mask4(mask: mx.array, q: mx.array, S: int) -> mx.array:
    if q.ndim <= 4 and mask.ndim <= 4:
        return mask
    full = mx.broadcast_to(mask, q.shape[:-1] + (S,))
    return full.reshape((-1,) + full.shape[-3:]) if full.ndim > 4 else full


@kernel("sdpa")
def sdpa(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None = None, sinks: mx.array | None = None, *,
         causal: bool, scale: float | None, every_row_sees: bool = False) -> mx.array:
    """every_row_sees: the mask is known to leave every query a key (no NaN rows to make). sinks: MLX's own (its
    fused kernel takes a sink logit per q head); a query that sees no key then gets zeros, as kiln's op defines."""
    dtype = q.dtype
    if on_cpu():
        q, k, v = upcast(q, k, v)
    if sinks is not None:
        sinks = sinks.astype(mx.float32 if on_cpu() else q.dtype)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(E) if scale is None else scale
    lead = q.shape[:-3]
    if k.shape[:-3] != lead or v.shape[:-3] != lead:  # batch dims that broadcast: MLX wants them equal
        k = mx.broadcast_to(k, lead + k.shape[-3:])
        v = mx.broadcast_to(v, lead + v.shape[-3:])
    fused_mask: Any = None
    if mask is not None:
        fused_mask = _mask4(mask if mask.dtype == mx.bool_ else mask.astype(q.dtype), q, S)
    if causal:
        if fused_mask is None and L == S:
            fused_mask = "causal"
        else:
            keep = mx.array(np.tri(L, S, 0, dtype=bool))
            if fused_mask is None:
                fused_mask = keep
            elif fused_mask.dtype == mx.bool_:
                fused_mask = fused_mask & keep
            else:
                fused_mask = mx.where(keep, fused_mask, mx.array(-math.inf, dtype=fused_mask.dtype))
    out = mx.fast.scaled_dot_product_attention(_as4(q), _as4(k), _as4(v), scale=scale,
                                               mask=fused_mask, sinks=sinks)
    if isinstance(fused_mask, mx.array) and fused_mask.dtype == mx.bool_ and not every_row_sees:
        dead = ~mx.any(fused_mask, axis=-1, keepdims=True)
        out = mx.where(dead, mx.array(math.nan if sinks is None else 0.0, dtype=out.dtype), out)
    return out.reshape(q.shape[:-1] + v.shape[-1:]).astype(dtype)


def rotate(x: mx.array, interleaved: bool) -> mx.array:
    """RoPE's partner values: cat(-x[..., D/2:], x[..., :D/2]), or (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    if interleaved:
        return mx.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


@kernel("rope")
def rope(x: mx.array, cos: mx.array, sin: mx.array, interleaved: bool = False) -> mx.array:
    return (x * cos + rotate(x, interleaved) * sin).astype(x.dtype)


@kernel("rope_cache_update")
def rope_cache_update(q: mx.array, k: mx.array, v: mx.array, cos: mx.array, sin: mx.array, k_cache: mx.array,
                      v_cache: mx.array, *indices: mx.array, dims: Any, interleaved: bool,
                      in_place: bool) -> tuple[mx.array, mx.array, mx.array]:
    return (rope(q, cos, sin, interleaved), write_at(k_cache, rope(k, cos, sin, interleaved), dims, indices),
            write_at(v_cache, v, dims, indices))


@kernel("slot_attention")
def slot_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, slots: mx.array, positions: mx.array,
                   sinks: mx.array | None = None, *, scale: float, window: int = 0,
                   visible_keys: int | None = None) -> mx.array:
    """Each sequence's slot gathered ([B, S, Hkv, E], as many keys as the plan hint says some position reaches:
    visible_keys, else the whole cache) and attended by MLX's fused kernel with the mask from the positions (and
    the sinks as its own). Every query sees at least its own key, so there are no empty rows to guard."""
    dtype = q.dtype
    length = k_cache.shape[1] if visible_keys is None else min(visible_keys, k_cache.shape[1])
    keys = k_cache[slots, :length].transpose(0, 2, 1, 3)
    values = v_cache[slots, :length].transpose(0, 2, 1, 3)
    if on_cpu():
        q, keys, values = upcast(q, keys, values)
    if sinks is not None:
        sinks = sinks.astype(q.dtype)
    visible = slot_visibility(mx.arange(length), positions, window)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=visible, sinks=sinks)
    return out.astype(dtype)
