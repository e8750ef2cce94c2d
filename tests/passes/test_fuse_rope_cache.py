"""fuse_rope_cache_update: the RoPE of q and k and the KV-cache writes an attention reads become one node, written in
place into state buffers over several steps, and only when q, k and v are one attention's."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from tests.passes.common import export_checked, nodes, ops


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class CachedAttention(nn.Module):
    """One GQA attention step over a 6-slot cache held in buffers (k by index_copy_, v by index assignment)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, 6, 8))
        self.register_buffer("v_cache", torch.zeros(1, 2, 6, 8))

    def forward(self, q, k, v, cos, sin, pos):
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache[:, :, pos] = v
        visible = (torch.arange(6) <= pos[-1])[None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=visible, enable_gqa=True)


def _step(gen: torch.Generator, position: int) -> tuple:
    angles = torch.randn(1, 8, generator=gen)
    return (torch.randn(1, 4, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen),
            torch.randn(1, 2, 1, 8, generator=gen), angles.cos(), angles.sin(), torch.tensor([position]))


def test_rope_and_cache_writes_fuse_in_place_over_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    program = kiln.export(CachedAttention(), _step(gen, 0)).load()
    (fused,) = nodes(program, "rope_cache_update")
    assert fused.attrs == {"dims": (2,), "interleaved": False, "in_place": True}
    assert not {"rope", "index_put", "index_copy"} & set(ops(program))
    session, eager = program.session(), CachedAttention()
    for position in range(5):
        args = _step(gen, position)
        got = session.run("forward", *[a.numpy() for a in args])[0]
        with torch.no_grad():
            want = eager(*args)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


class RotatedKeyAlsoReturned(nn.Module):
    """The rotated k is read beside its cache write, so the rotation must stay a node of its own."""

    def forward(self, q, k, v, cos, sin, k_cache, v_cache, pos):
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache, v_cache = k_cache.index_copy(2, pos, k), v_cache.index_copy(2, pos, v)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True), k


class OtherRotations(nn.Module):
    """q and k rotated by different angles: not one rotation."""

    def forward(self, q, k, v, cos, sin, k_cache, v_cache, pos):
        q, k = _rope(q, cos, sin), _rope(k, sin, cos)
        k_cache, v_cache = k_cache.index_copy(2, pos, k), v_cache.index_copy(2, pos, v)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)


def test_declines_what_is_not_one_attentions_update() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, cos, sin, pos = _step(gen, 3)
    caches = (torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen))
    for model in (RotatedKeyAlsoReturned(), OtherRotations()):
        program = export_checked(model, (q, k, v, cos, sin, *caches, pos))
        assert "rope_cache_update" not in ops(program) and ops(program).count("rope") == 2, type(model).__name__
