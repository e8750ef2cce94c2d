"""Scaled dot-product attention: compiled for a few queries (native.attention); otherwise one batched matmul pair
with a stable softmax, GQA by head grouping."""

from __future__ import annotations

import functools
import math

import numpy as np

from kiln.runtime.backends import array_api
from kiln.runtime.backends.cpu import native
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
def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, sinks: np.ndarray | None = None, *,
         causal: bool, scale: float | None) -> np.ndarray:
    dtype = q.dtype
    q, k, v, mask, sinks = upcast(q, k, v, mask, sinks)
    compiled = native.attention(q, k, v, mask, causal, 1 / math.sqrt(q.shape[-1]) if scale is None else scale, sinks)
    if compiled is not None:
        return compiled.astype(dtype, copy=False)
    if mask is not None and mask.dtype == np.bool_ and not causal:
        k, v, mask = _visible_keys(k, v, mask)
    return array_api.sdpa(np, q, k, v, mask, causal, scale, sinks=sinks).astype(dtype, copy=False)



@kernel("rope")
def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False) -> np.ndarray:
    out = x * cos
    out += array_api.rotate(np, x, interleaved) * sin
    return out.astype(x.dtype, copy=False)


@kernel("rope_cache_update")
def rope_cache_update(q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                      k_cache: np.ndarray, v_cache: np.ndarray, *indices: np.ndarray, dims: list[int],
                      interleaved: bool, in_place: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """In one compiled call for one index along the positions (a decode step; native.rope_cache_update), else the
    nodes it replaces, one after another."""
    if in_place and len(indices) == 1 and list(dims) == [2]:
        q_out = native.rope_cache_update(q, k, v, cos, sin, k_cache, v_cache, indices[0], interleaved)
        if q_out is not None:
            return q_out, k_cache, v_cache
    if in_place and len(indices) == 2 and list(dims) == [0, 1]:  # a serving program's step: (slot, position)
        q_out = native.rope_slot_update(q, k, v, cos, sin, k_cache, v_cache, *indices, interleaved)
        if q_out is not None:
            return q_out, k_cache, v_cache
    write = functools.partial(array_api.index.index_put, np, dims=dims, accumulate=False, in_place=in_place)
    return (rope(q, cos, sin, interleaved), write(k_cache, rope(k, cos, sin, interleaved), *indices),
            write(v_cache, v, *indices))


def check_slots(slots: np.ndarray, positions: np.ndarray, slot_count: int, length: int) -> None:
    """Slots and positions inside the cache (a gather past its end would read another slot's keys or fail)."""
    if slots.size and not (0 <= slots.min() and slots.max() < slot_count):
        raise IndexError(f"slot_attention: slots must be in [0, {slot_count}), got {slots.tolist()}")
    if positions.size and not (0 <= positions.min() and positions.max() < length):
        raise IndexError(f"slot_attention: positions must be in [0, {length}), got min {positions.min()} "
                         f"max {positions.max()}")


@kernel("slot_attention")
def slot_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                   sinks: np.ndarray | None = None, *, scale: float, window: int = 0) -> np.ndarray:
    """A few queries a sequence: compiled, each query reading only the keys it sees (native.slot_attention).
    Otherwise gathers only the keys some query of the batch sees (from the earliest any window starts to the
    latest position), so a step costs what its positions reach, not the cache's length."""
    check_slots(slots, positions, k_cache.shape[0], k_cache.shape[1])
    if q.size == 0:
        return np.zeros(q.shape[:-1] + v_cache.shape[-1:], q.dtype)
    sinks = upcast(sinks)[0]
    compiled = native.slot_attention(q, k_cache, v_cache, slots, positions, scale, window, sinks)  # few queries each
    if compiled is not None:
        return compiled.astype(q.dtype, copy=False)
    last = int(positions.max()) + 1
    first = max(0, int(positions.min()) - window + 1) if window > 0 else 0
    prompt = _prompt_slot_attention(q, k_cache, v_cache, slots, positions, first, last, scale, window, sinks)
    if prompt is not None:
        return prompt
    dtype = q.dtype
    q, keys, values = upcast(q, k_cache[slots, first:last], v_cache[slots, first:last])
    return array_api.slot_attention(np, q, keys, values, positions, first, scale, window,
                                    sinks=sinks).astype(dtype, copy=False)


def _prompt_slot_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
                           positions: np.ndarray, first: int, last: int, scale: float, window: int,
                           sinks: np.ndarray | None) -> np.ndarray | None:
    """Many queries a sequence (a prompt's chunk prefilled into its slot) by the compiled attention over the pool
    (native.attention's query tiles), the slot's keys read in place and slot_visibility as its mask. NumPy's
    batched matmuls here ran on OpenBLAS's threads, which then busy-wait and took the cores the pool's products
    next to them needed (the int4 SmolLM2's 32-token prefill: 113 ms where it took 71 with BLAS on one thread).
    None where the helpers cannot take it (the caller's portable path runs)."""
    if q.dtype != np.float32 or k_cache.dtype != np.float32 or v_cache.dtype != np.float32:
        return None
    if slots.size == 1:  # (a view of the slot's rows; a gather copies)
        keys, values = k_cache[int(slots[0]), first:last][None], v_cache[int(slots[0]), first:last][None]
    else:
        keys, values = k_cache[slots, first:last], v_cache[slots, first:last]
    visible = array_api.slot_visibility(np.arange(first, last), positions, window)
    return native.attention(q, keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3), visible, False, scale,
                            sinks)
