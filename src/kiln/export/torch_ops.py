"""kiln ops that PyTorch has no single op for, defined as torch custom ops (namespace `kiln`) so that a model can
call them, run eagerly, and be exported: torch.export keeps a custom op whole and the lowering maps it onto the
kiln op of the same name.

slot_attention: attention of several sequences over a KV cache with one slot per sequence (the serving recipe of
kiln.models.llm, `export_llm(slots=N)`). Written with gathers and a mask it would read every slot's whole cache;
as one op a backend reads only what the positions reach.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("kiln::slot_attention", mutates_args=())
def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """kiln's slot_attention op (kiln.ir.ops has its definition): q [B, Hq, T, E], caches [N, S, Hkv, E],
    slots [B], positions [B, T] -> [B, Hq, T, Ev]."""
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, S, E]
    values = v_cache[slots].transpose(1, 2)
    j = torch.arange(k_cache.shape[1], device=q.device)
    position = positions[:, None, :, None]  # [B, 1, T, 1]
    visible = j <= position
    if window > 0:
        visible = visible & (j > position - window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])


@slot_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
      scale: float, window: int = 0) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))


__all__ = ["slot_attention"]
