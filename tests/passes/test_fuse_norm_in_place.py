"""fuse_rms_norm on transformers' RMSNorm forms, and in-place KV-cache writes: fire, decline when wrong, same
outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import kiln
from kiln.models.llm import export_llama
from tests.passes.common import export_checked, nodes, ops


def _randomized(norm: nn.Module) -> nn.Module:
    with torch.no_grad():
        norm.weight.copy_(torch.randn_like(norm.weight))
    return norm


@pytest.mark.parametrize("make", [lambda: LlamaRMSNorm(16, eps=1e-6), lambda: GemmaRMSNorm(16, eps=1e-6)],
                         ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_rms_norms_become_one_node(make, dtype) -> None:
    norm = _randomized(make()).to(dtype)
    x = torch.randn(2, 3, 16).to(dtype)
    program = kiln.export(norm, (x,)).load()
    assert ops(program) == ["rms_norm"], ops(program)
    assert nodes(program, "rms_norm")[0].attrs["eps"] == pytest.approx(1e-6)
    x_np = x.float().numpy().astype(program.ir.methods["forward"].input_specs()[0].dtype.numpy)  # exact
    got = program.session(validate=True).run("forward", x_np)[0].astype(np.float32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: HF rounds twice (before and after the weight)
    with torch.no_grad():
        np.testing.assert_allclose(got, norm(x).float().numpy(), rtol=tol, atol=tol)


class NotQuiteRMS(nn.Module):
    """Mean over the wrong dim, and a norm whose mean square is also returned: neither may fuse."""

    def forward(self, x):
        a = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-5)
        ms = x.pow(2).mean(-1, keepdim=True)
        b = x * torch.rsqrt(ms + 1e-5)
        return a, b, ms


def test_rms_norm_declines_other_patterns() -> None:
    program = export_checked(NotQuiteRMS(), (torch.randn(4, 8),))
    assert "rms_norm" not in ops(program)


@pytest.fixture(scope="module")
def llama_program():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    return export_llama(LlamaForCausalLM(config).eval(), 32, 4).load()


def test_kv_cache_writes_are_in_place(llama_program) -> None:
    for method in ("prefill", "decode"):
        writes = nodes(llama_program, "rope_cache_update", method)  # a layer's k and v writes, with its RoPE
        assert len(writes) == 2 and all(n.attrs.get("in_place") for n in writes), method
    session = llama_program.session()
    session.run("prefill", np.array([[1, 2, 3]], np.int64), np.arange(3, dtype=np.int64))
    caches = [a.__array_interface__["data"][0] for a in session.state]
    for step in range(3, 8):
        session.run("decode", np.array([[step]], np.int64), np.array([step], np.int64))
    assert [a.__array_interface__["data"][0] for a in session.state] == caches  # written where they were


class ReadsOldCache(nn.Module):
    """The old cache contents are also read after the write: the write must copy."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x, pos):
        old = self.cache.sum(0)
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0) - old


def test_write_is_copied_when_the_old_state_is_read() -> None:
    program = kiln.export(ReadsOldCache(), (torch.randn(1, 3), torch.tensor([1]))).load()
    assert not any(n.attrs.get("in_place") for n in nodes(program, "index_put"))
    session = program.session()
    eager = ReadsOldCache()
    for step in range(4):
        x, pos = torch.randn(1, 3), torch.tensor([step])
        np.testing.assert_allclose(session.run("forward", x.numpy(), pos.numpy())[0], eager(x, pos).numpy(),
                                   rtol=1e-6)
