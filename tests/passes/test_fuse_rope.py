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


class Interleaved(nn.Module):
    """GPT-J's rotary embedding on [B, T, H, D], sin/cos [B, T, D/2] repeat-interleaved to D inside."""

    def forward(self, x, sin, cos):
        from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary

        return gptj_rotary(x, sin, cos)


def _interleaved_inputs(d: int = 8):
    gen = torch.Generator().manual_seed(1)
    x, angles = torch.randn(2, 5, 4, d, generator=gen), torch.randn(2, 5, d // 2, generator=gen)
    return x, angles.sin(), angles.cos()


def test_interleaved_becomes_rope() -> None:
    program = export_checked(Interleaved(), _interleaved_inputs())
    (rope,) = nodes(program, "rope")
    assert rope.attrs == {"interleaved": True}
    assert not {"neg", "cat", "slice", "mul", "add"} & set(ops(program))


class NotInterleaved(nn.Module):
    """Pairs rotated the other way, and the even half negated: neither is GPT-J's rotation."""

    def forward(self, x, cos, sin):
        inverse = torch.stack((x[..., 1::2], -x[..., ::2]), dim=-1).flatten(-2)
        swapped = torch.stack((-x[..., ::2], x[..., 1::2]), dim=-1).flatten(-2)
        return x * cos + inverse * sin, x * cos + swapped * sin


def test_declines_other_interleavings() -> None:
    x, sin, cos = _interleaved_inputs()
    full = (cos.repeat_interleave(2, -1)[:, :, None], sin.repeat_interleave(2, -1)[:, :, None])
    program = export_checked(NotInterleaved(), (x, *full))
    assert "rope" not in ops(program) and len(nodes(program, "cat")) == 2


def test_gptj_model_with_partial_rotary() -> None:
    """A random GPT-J (rotary on the first 8 of 16 head dims) keeps its logits with every layer's q and k fused."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, rotary_dim=8)
    model = GPTJForCausalLM(config).eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, tokens):
            return self.model(tokens, use_cache=False).logits

    program = export_checked(Logits(), (torch.randint(0, 64, (1, 7)),), tol=1e-4)
    assert [n.attrs for n in nodes(program, "rope")] == [{"interleaved": True}] * 4


class HalvesRotary(nn.Module):
    """gpt-oss's form (transformers' gpt_oss _apply_rotary_emb): cos/sin of half width, the halves rotated apart."""

    def forward(self, q, k, cos, sin):
        from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_rotary

        return gpt_oss_rotary(q, k, cos, sin)


class HalvesSwapped(nn.Module):
    """The halves' sin terms with the wrong signs (the inverse rotation) and a half read beside the rotation."""

    def forward(self, x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        first, second = torch.chunk(x, 2, dim=-1)
        inverse = torch.cat((first * cos + second * sin, second * cos - first * sin), dim=-1)
        first2, second2 = torch.chunk(x * 2, 2, dim=-1)
        read = torch.cat((first2 * cos - second2 * sin, second2 * cos + first2 * sin), dim=-1)
        return inverse, read, first2


def test_halves_become_rope_over_full_width_tables() -> None:
    q, k, cos, sin = _inputs()
    program = export_checked(HalvesRotary(), (q, k, cos[..., :4], sin[..., :4]))
    assert ops(program).count("rope") == 2
    tables = nodes(program, "cat")  # cos and sin repeated once each, shared by q's and k's rope
    assert len(tables) == 2 and not {"mul", "sub", "slice"} & set(ops(program))


def test_declines_other_halves() -> None:
    x, _, cos, sin = _inputs()
    program = export_checked(HalvesSwapped(), (x, cos[..., :4], sin[..., :4]))
    assert "rope" not in ops(program)
