"""fuse_rope: transformers' rotate-half rotary embedding becomes one rope node, only when it is exactly that."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.passes.common import export_checked, nodes, ops


class Rotary(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)  # cos/sin [B, T, D] unsqueezed at dim 1 inside


def _inputs(d: int = 8):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, d, generator=gen), torch.randn(2, 2, 5, d, generator=gen)
    angles = torch.randn(2, 5, d, generator=gen)
    return q, k, angles.cos(), angles.sin()


def test_rotate_half_becomes_rope() -> None:
    program = export_checked(Rotary(), _inputs())
    assert ops(program).count("rope") == 2
    assert not {"neg", "cat", "slice"} & set(ops(program))


class NotRotateHalf(nn.Module):
    """The halves the other way round (the inverse rotation) and an odd split: neither is rotate_half."""

    def forward(self, x, cos, sin):
        h = x.shape[-1] // 2
        inverse = x * cos + torch.cat((x[..., h:], -x[..., :h]), dim=-1) * sin
        uneven = x * cos + torch.cat((-x[..., 3:], x[..., :3]), dim=-1) * sin
        return inverse, uneven


def test_declines_other_rotations() -> None:
    q, _, cos, sin = _inputs()
    program = export_checked(NotRotateHalf(), (q, cos[:, None], sin[:, None]))
    assert "rope" not in ops(program) and len(nodes(program, "cat")) == 2
