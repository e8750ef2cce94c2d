"""kiln ops that PyTorch has no single op for, defined as torch custom ops (namespace `kiln`) so that a model can
call them, run eagerly, and be exported: torch.export keeps a custom op whole and the lowering maps it onto the
kiln op of the same name.

slot_attention: attention of several sequences over a KV cache with one slot per sequence (the serving recipe of
kiln.models.llm, `export_llm(slots=N)`). Written with gathers and a mask it would read every slot's whole cache;
as one op a backend reads only what the positions reach.

sdpa: attention with per-head sink logits (gpt-oss), kiln's sdpa with its sinks input. transformers writes it as
about ten ops (scores, mask, a concatenated sink column, max, softmax, the column dropped, the product); as one op
the backends' fused attention kernels take it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("kiln::sdpa", mutates_args=())
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor,
         scale: float) -> torch.Tensor:
    """kiln's sdpa op with sinks (kiln.ir.ops has its definition): q [B, Hq, L, E], k and v [B, Hkv, S, E] (Hq a
    multiple of Hkv), a bool (keep) or additive mask broadcast to [B, Hq, L, S], sinks [Hq] -> [B, Hq, L, Ev] in
    q's dtype, computed in float32."""
    groups = q.shape[1] // k.shape[1]
    keys, values = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.float() @ keys.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask.float()
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ values).to(q.dtype)


@sdpa.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor,
      scale: float) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("kiln::slot_attention", mutates_args=())
def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, scale: float, window: int = 0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """kiln's slot_attention op (kiln.ir.ops has its definition): q [B, Hq, T, E], caches [N, S, Hkv, E],
    slots [B], positions [B, T], sinks [Hq] or None -> [B, Hq, T, Ev]."""
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, S, E]
    values = v_cache[slots].transpose(1, 2)
    j = torch.arange(k_cache.shape[1], device=q.device)
    position = positions[:, None, :, None]  # [B, 1, T, 1]
    visible = j <= position
    if window > 0:
        visible = visible & (j > position - window)
    if sinks is not None:
        return sdpa(q, keys, values, visible, sinks, scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])


@slot_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
      scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))


__all__ = ["sdpa", "slot_attention"]
