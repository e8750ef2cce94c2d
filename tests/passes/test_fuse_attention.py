"""absorb_repeat_kv: sdpa takes the un-repeated KV heads (no cache copy), only for a true head repetition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import kiln
from kiln.models.llm import export_llama


def _ops(program, method: str = "forward") -> list[str]:
    return [n.op for n in program.ir.methods[method].nodes]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' form: insert a unit dim, expand it, merge it into the heads."""
    b, h, s, e = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, s, e).reshape(b, h * groups, s, e)


class GroupedAttention(nn.Module):
    def __init__(self, causal: bool = False, mask: str | None = None):
        super().__init__()
        self.causal, self.mask = causal, mask

    def forward(self, q, k, v):
        mask = None
        if self.mask == "bool":
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
        elif self.mask == "per_head":
            mask = torch.arange(q.shape[1] * k.shape[-2], dtype=q.dtype).reshape(1, q.shape[1], 1, -1) * -0.01
        return F.scaled_dot_product_attention(q, _repeat_kv(k, 3), _repeat_kv(v, 3), attn_mask=mask,
                                              is_causal=self.causal)


@pytest.mark.parametrize("causal,mask", [(False, None), (True, None), (False, "bool"), (False, "per_head")])
def test_absorbs_repeat_kv_and_matches_eager(causal: bool, mask: str | None) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen),
               torch.randn(2, 2, 5, 8, generator=gen))
    model = GroupedAttention(causal, mask)
    program = kiln.export(model, (q, k, v)).load()
    assert "expand" not in _ops(program)
    sdpa = next(n for n in program.ir.methods["forward"].nodes if n.op == "sdpa")
    assert [program.ir.methods["forward"].values[i].shape for i in sdpa.inputs[1:3]] == [(2, 2, 5, 8)] * 2
    got = program.session(validate=True).run("forward", q.numpy(), k.numpy(), v.numpy())[0]
    np.testing.assert_allclose(got, model(q, k, v).numpy(), rtol=1e-5, atol=1e-6)


class NotARepetition(nn.Module):
    """Expands a unit dim that is then merged with the sequence, not the heads: must stay as it is."""

    def forward(self, q, k, v):
        b, h, s, e = k.shape
        k2 = k[:, :, :, None, :].expand(b, h, s, 2, e).reshape(b, h, s * 2, e)
        v2 = v[:, :, :, None, :].expand(b, h, s, 2, e).reshape(b, h, s * 2, e)
        return F.scaled_dot_product_attention(q, k2, v2)


def test_declines_other_expansions() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 3, 4, generator=gen),
               torch.randn(1, 2, 3, 4, generator=gen))
    program = kiln.export(NotARepetition(), (q, k, v)).load()
    assert _ops(program).count("expand") == 2
    got = program.session(validate=True).run("forward", q.numpy(), k.numpy(), v.numpy())[0]
    np.testing.assert_allclose(got, NotARepetition()(q, k, v).numpy(), rtol=1e-5, atol=1e-6)


class Repetitions(nn.Module):
    """The two other ways to spell a GQA repetition: repeat_interleave (a true repetition, absorbed) and repeat
    (tiling: q head h reads kv head h % Hkv, not h // g, so it must stay a copy)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, q, k, v):
        if self.how == "repeat_interleave":
            k, v = k.repeat_interleave(3, dim=1), torch.repeat_interleave(v, 3, dim=1)
        else:
            k, v = k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("how,absorbed", [("repeat_interleave", True), ("repeat", False)])
def test_repeat_interleave_is_absorbed_but_tiling_is_not(how: str, absorbed: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 6, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen),
               torch.randn(1, 2, 5, 8, generator=gen))
    program = kiln.export(Repetitions(how), (q, k, v)).load()
    sdpa = next(n for n in program.ir.methods["forward"].nodes if n.op == "sdpa")
    heads = [program.ir.methods["forward"].values[i].shape[1] for i in sdpa.inputs[1:3]]
    assert heads == ([2, 2] if absorbed else [6, 6])
    got = program.session(validate=True).run("forward", q.numpy(), k.numpy(), v.numpy())[0]
    np.testing.assert_allclose(got, Repetitions(how)(q, k, v).numpy(), rtol=1e-5, atol=1e-6)


def test_fires_on_hf_llama_decode() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    program = export_llama(LlamaForCausalLM(config).eval(), 32, 4).load()
    for method in ("prefill", "decode"):
        assert "expand" not in _ops(program, method), method
        assert _ops(program, method).count("sdpa") == 2
