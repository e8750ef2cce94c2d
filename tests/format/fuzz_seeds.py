"""The programs the .kiln fuzzer mutates: small, but together they hold the kinds of ops, symbols, state and
methods real programs have (a dynamic batch with a state buffer; a CNN; an attention block over embeddings; a
tiny language model with its KV cache, prefill and decode methods)."""

from __future__ import annotations

import torch
from torch import nn

import kiln
from tests.format.mutator import Seed


class Stateful(nn.Module):
    """A state buffer with an initial value, a dynamic batch, softmax and slicing."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("total", torch.arange(8, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        return torch.softmax(self.proj(x) * self.total, dim=-1)[1:, :4]


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        y = nn.functional.max_pool2d(nn.functional.hardswish(self.dw(y)), 2)
        y = nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        return torch.log_softmax(self.head(y), dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.norm = nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool())
        y = y.transpose(1, 2).reshape(b, t, 16)
        return nn.functional.gelu(self.norm(x + y)).mean(1)


def seeds() -> list[Seed]:
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=2, max=16)
    seq = torch.export.Dim("seq", min=2, max=24)
    built = {
        "stateful": kiln.export(Stateful(), (torch.randn(3, 8),), dynamic_shapes=({0: batch},)),
        "cnn": kiln.export(SmallCNN().eval(), (torch.randn(1, 3, 16, 16),)),
        "attention": kiln.export(Attention().eval(), (torch.randint(0, 32, (2, 5)), torch.ones(2, 5)),
                                 dynamic_shapes=({1: seq}, {1: seq})),
    }
    from tests.runtime.tiny_llm import export_tiny_llm

    built["tiny_llm"] = export_tiny_llm(with_tokenizer=False, max_context=32)[1]
    out = []
    for name, builder in built.items():
        program, data = builder.build()
        out.append(Seed(name, program, list(data)))
    return out
