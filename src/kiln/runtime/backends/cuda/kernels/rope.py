"""Rotary position embeddings on the GPU: RoPE in one kernel over q/k in any layout (fused.cu), and for a decode
step RoPE together with the KV-cache writes in one kernel (rope_cache_update; with the q/k RMSNorm before it,
norm_rope_cache_update): one sequence at its position, or a serving step's sequences each at its own slot and
position."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends import composite
from kiln.runtime.backends.array_api import rotate, upcast
from kiln.runtime.backends.array_api.index import target
from kiln.runtime.backends.array_api.norm import rms_norm_eps
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.index import index_put
from kiln.runtime.backends.cuda.kernels.registry import CUDA_KERNELS, elements, grid, kernel


@kernel("rope")
def rope(x: Any, cos: Any, sin: Any, interleaved: bool = False) -> Any:
    if 1 <= x.ndim <= 4 and x.size and x.shape[-1] % 2 == 0 and cos.shape == sin.shape and cos.ndim <= x.ndim \
            and nvrtc.supports(x, cos, sin):
        return _rope_fused(x, cos, sin, interleaved)
    dtype = x.dtype
    xf, cos, sin = upcast(x, cos, sin)
    return (xf * cos + rotate(cp, xf, interleaved) * sin).astype(dtype, copy=False)


def _rope_fused(x: Any, cos: Any, sin: Any, interleaved: bool) -> Any:
    """One kernel reading x in any layout (q and k arrive as transposed views) and cos/sin broadcast in place."""
    shape = (1,) * (4 - x.ndim) + x.shape
    cos_b, sin_b = cp.broadcast_to(cos, x.shape), cp.broadcast_to(sin, x.shape)
    if cos_b.strides != sin_b.strides:
        sin_b = cp.ascontiguousarray(sin_b)
        cos_b = cp.ascontiguousarray(cos_b)
    out = cp.empty(x.shape, dtype=x.dtype)
    args = (x, cos_b, sin_b, out, np.int32(shape[1]), np.int32(shape[2]), np.int32(shape[3]),
            *elements(x.strides, x.itemsize), *elements(cos_b.strides, cos_b.itemsize),
            np.int64(x.size), np.int32(bool(interleaved)))
    nvrtc.function("fused", "rope", x.dtype)(grid(x.size), (256,), args)
    return out


@kernel("rope_cache_update")
def rope_cache_update(q: Any, k: Any, v: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any, *indices: Any,
                      dims: list[int], interleaved: bool, in_place: bool) -> tuple[Any, Any, Any]:
    """A decode step's (one position; or one token of each sequence of a serving program's slotted cache) in one
    kernel; otherwise the rope and index_put kernels it stands for."""
    k_out, v_out = target(k_cache, in_place), target(v_cache, in_place)
    slotted = _slot_step_cos_sin(q, k, v, cos, sin, k_out, v_out, indices, dims)
    if slotted is not None:
        return _rope_slot_update(q, k, v, *slotted, k_out, v_out, indices, interleaved)
    shared = _one_position_cos_sin(q, k, v, cos, sin, k_out, v_out, indices, dims)
    if shared is None:
        return (rope(q, cos, sin, interleaved), index_put(k_out, rope(k, cos, sin, interleaved), *indices, dims=dims,
                                                          accumulate=False, in_place=True),
                index_put(v_out, v, *indices, dims=dims, accumulate=False, in_place=True))
    cos_b, sin_b = shared
    (b, hq, _, d), hkv = q.shape, k.shape[1]
    q_out = cp.empty(q.shape, dtype=q.dtype)
    qs, ks, vs, cs = (elements(a.strides, a.itemsize) for a in (q, k, v, cos_b))
    total = b * (hq + 2 * hkv) * d
    nvrtc.function("fused", "rope_cache_update", q.dtype)(
        grid(total), (256,), (q, k, v, cos_b, sin_b, q_out, k_out, v_out, indices[0], np.int32(hq), np.int32(hkv),
                              np.int32(d), np.int32(k_out.shape[2]), qs[0], qs[1], qs[3], ks[0], ks[1], ks[3],
                              vs[0], vs[1], vs[3], cs[0], cs[3], np.int64(total), np.int32(bool(interleaved))))
    return q_out, k_out, v_out


NORM_ROPE_WARPS, NORM_ROPE_WIDTH = 8, 256  # fused.cu's norm_rope_cache_update


@kernel("norm_rope_cache_update")
def norm_rope_cache_update(q: Any, k: Any, v: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any, q_weight: Any,
                           k_weight: Any, *indices: Any, dims: list[int], interleaved: bool, eps: float | None,
                           in_place: bool) -> tuple[Any, Any, Any]:
    """A decode step's (one position, rope_cache_update's fused form) in one kernel: fused.cu's
    norm_rope_cache_update, a warp per row; otherwise the rms_norm and rope_cache_update kernels it stands for."""
    shared = _one_position_cos_sin(q, k, v, cos, sin, k_cache, v_cache, indices, dims)
    d = q.shape[-1]
    if shared is None or d > NORM_ROPE_WIDTH or any(
            w.shape != (d,) or w.dtype != q.dtype or not w.flags.c_contiguous for w in (q_weight, k_weight)):
        return composite.norm_rope_cache_update(CUDA_KERNELS.kernels, q, k, v, cos, sin, k_cache, v_cache, q_weight,
                                                k_weight, *indices, dims=dims, interleaved=interleaved, eps=eps,
                                                in_place=in_place)
    k_out, v_out = target(k_cache, in_place), target(v_cache, in_place)
    cos_b, sin_b = shared
    (b, hq, _, _), hkv = q.shape, k.shape[1]
    q_out = cp.empty(q.shape, dtype=q.dtype)
    qs, ks, vs, cs = (elements(a.strides, a.itemsize) for a in (q, k, v, cos_b))
    rows = b * (hq + 2 * hkv)
    nvrtc.function("fused", "norm_rope_cache_update", q.dtype)(
        (-(-rows // NORM_ROPE_WARPS),), (32 * NORM_ROPE_WARPS,),
        (q, k, v, cos_b, sin_b, q_weight, k_weight, q_out, k_out, v_out, indices[0], np.int32(b), np.int32(hq),
         np.int32(hkv), np.int32(d), np.int32(k_out.shape[2]), qs[0], qs[1], qs[3], ks[0], ks[1], ks[3], vs[0], vs[1],
         vs[3], cs[0], cs[3], np.float32(rms_norm_eps(eps, q.dtype)), np.int32(bool(interleaved))))
    return q_out, k_out, v_out


def _slot_step_cos_sin(q: Any, k: Any, v: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any,
                       indices: tuple[Any, ...], dims: list[int]) -> tuple[Any, Any] | None:
    """cos and sin as [B, 1, 1, D] views when rope_slot_update takes the update: a serving program's decode step,
    one token of each of B sequences written at (slot, position) of contiguous [slots, S, Hkv, D] caches from k/v
    [B, 1, Hkv, D] and q [B, Hq, 1, D] of one storage type, the slots and positions one int64 each per sequence;
    else None."""
    if len(indices) != 2 or list(dims) != [0, 1] or any(a.ndim != 4 for a in (q, k, v, k_cache, v_cache)):
        return None
    if not nvrtc.supports(q, k, v, cos, sin, k_cache, v_cache):
        return None
    _, _, hkv, d = k_cache.shape
    b = q.shape[0]
    if k.shape != (b, 1, hkv, d) or v.shape != k.shape or v_cache.shape != k_cache.shape or d % 2:
        return None
    if q.shape[2:] != (1, d) or not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return None
    if any(i.dtype != cp.int64 or i.shape not in ((b,), (b, 1)) for i in indices):
        return None
    return _per_sequence_cos_sin(cos, sin, b, d)


def _per_sequence_cos_sin(cos: Any, sin: Any, b: int, d: int) -> tuple[Any, Any] | None:
    """cos and sin as [B, 1, 1, D] views laid out alike (what the fused kernels read: one row per sequence, the
    same for every head), or None (cos/sin per head or per query: not theirs)."""
    try:
        cos_b, sin_b = cp.broadcast_to(cos, (b, 1, 1, d)), cp.broadcast_to(sin, (b, 1, 1, d))
    except ValueError:
        return None
    return (cos_b, sin_b) if cos_b.strides == sin_b.strides else None


def _rope_slot_update(q: Any, k: Any, v: Any, cos_b: Any, sin_b: Any, k_out: Any, v_out: Any,
                      indices: tuple[Any, ...], interleaved: bool) -> tuple[Any, Any, Any]:
    """fused.cu's rope_slot_update: the rotated q, and k and v written into their sequences' slots."""
    (b, hq, _, d), (slot_count, size, hkv, _) = q.shape, k_out.shape
    q_out = cp.empty(q.shape, dtype=q.dtype)
    qs, ks, vs, cs = (elements(a.strides, a.itemsize) for a in (q, k, v, cos_b))
    per_row = (hq + 2 * hkv) * d
    if b and per_row:
        slots, positions = (cp.ascontiguousarray(i.reshape(-1)) for i in indices)
        nvrtc.function("fused", "rope_slot_update", q.dtype)(
            (b, -(-per_row // 256)), (256,),
            (q, k, v, cos_b, sin_b, q_out, k_out, v_out, slots, positions, np.int32(b), np.int32(hq), np.int32(hkv),
             np.int32(d), np.int32(slot_count), np.int32(size), qs[0], qs[1], qs[3], ks[0], ks[2], ks[3], vs[0], vs[2],
             vs[3], cs[0], cs[3], np.int32(bool(interleaved))))
    return q_out, k_out, v_out


def _one_position_cos_sin(q: Any, k: Any, v: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any,
                          indices: tuple[Any, ...], dims: list[int]) -> tuple[Any, Any] | None:
    """cos and sin as [B, 1, 1, D] views when the fused kernel takes the update: one position written along dim 2
    of contiguous [B, Hkv, S, D] caches from k/v [B, Hkv, 1, D] and q [B, Hq, 1, D] of one storage type, cos/sin
    the same for every head and laid out alike; else None."""
    if len(indices) != 1 or list(dims) != [2] or indices[0].shape != (1,) or indices[0].dtype != cp.int64:
        return None
    if any(a.ndim != 4 for a in (q, k, v, k_cache, v_cache)) or not nvrtc.supports(q, k, v, cos, sin, k_cache,
                                                                                   v_cache):
        return None
    b, hkv, _, d = k_cache.shape
    if k.shape != (b, hkv, 1, d) or v.shape != k.shape or v_cache.shape != k_cache.shape or d % 2:
        return None
    if q.shape[0] != b or q.shape[2:] != (1, d) or not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return None
    return _per_sequence_cos_sin(cos, sin, b, d)
