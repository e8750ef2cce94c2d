"""fuse_qk_norm: the per-head RMSNorms of q and k before a rope_cache_update fold into it (Qwen3's q_norm and
k_norm), in place over several steps on every backend here; a norm read elsewhere, or of another eps, stays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from tests.conftest import BACKENDS
from tests.passes.common import nodes, ops
from tests.passes.test_fuse_rope_cache import _rope


class NormedCachedAttention(nn.Module):
    """One GQA step over a 6-slot cache: q and k [B, L, H, D] normalized per head, transposed, rotated, written."""

    def __init__(self, k_eps: float = 1e-6):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, 6, 8))
        self.register_buffer("v_cache", torch.zeros(1, 2, 6, 8))
        self.q_norm, self.k_norm = nn.RMSNorm(8, eps=1e-6), nn.RMSNorm(8, eps=k_eps)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.2, 0.6)
            self.k_norm.weight.uniform_(0.2, 0.6)

    def normed(self, q, k):
        return self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)

    def forward(self, q, k, v, cos, sin, pos):
        return self.attend(*self.normed(q, k), v, cos, sin, pos)

    def attend(self, q, k, v, cos, sin, pos):
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache[:, :, pos] = v
        visible = (torch.arange(6) <= pos[-1])[None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=visible, enable_gqa=True)


class NormedKeyAlsoReturned(NormedCachedAttention):
    """The normalized k is an output too: its norm must stay a node."""

    def forward(self, q, k, v, cos, sin, pos):
        q, k = self.normed(q, k)
        return self.attend(q, k, v, cos, sin, pos), k


def _step(gen: torch.Generator, position: int) -> tuple:
    angles = torch.randn(1, 8, generator=gen)
    return (torch.randn(1, 1, 4, 8, generator=gen), torch.randn(1, 1, 2, 8, generator=gen),
            torch.randn(1, 2, 1, 8, generator=gen), angles.cos(), angles.sin(), torch.tensor([position]))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("cpu", "mlx", "cuda")])
def test_q_and_k_norms_fold_into_the_cache_update(backend) -> None:
    gen = torch.Generator().manual_seed(0)
    model = NormedCachedAttention().eval()
    program = kiln.export(model, _step(gen, 0)).load()
    (fused,) = nodes(program, "norm_rope_cache_update")
    assert fused.attrs == {"dims": (2,), "interleaved": False, "in_place": True, "eps": pytest.approx(1e-6)}
    assert not {"rms_norm", "rope", "rope_cache_update", "index_copy"} & set(ops(program))
    session, eager = program.session(backend), NormedCachedAttention().eval()
    eager.load_state_dict(model.state_dict())
    for position in range(5):
        args = _step(gen, position)
        got = session.run("forward", *[a.numpy() for a in args])[0]
        with torch.no_grad():
            want = eager(*args)
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", [NormedKeyAlsoReturned(), NormedCachedAttention(k_eps=1e-5)],
                         ids=["norm-read-elsewhere", "other-eps"])
def test_norms_that_cannot_fold_stay(model) -> None:
    gen = torch.Generator().manual_seed(1)
    program = kiln.export(model.eval(), _step(gen, 0)).load()
    assert "rope_cache_update" in ops(program) and "norm_rope_cache_update" not in ops(program)
    assert ops(program).count("rms_norm") == 2
