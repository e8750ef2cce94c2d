"""Small models shared by the format and runtime tests; each one shows one feature of the file format."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.export import ProgramBuilder

WIDTH = 32


class DuplicatedMLP(nn.Module):
    """Two linears with equal (copied, not tied) weights and a buffer with the same bytes in another shape.

    All three are stored as one blob: the exporter deduplicates constants by content, not by parameter identity.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)
        self.register_buffer("flat", self.a.weight.detach().clone().reshape(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + (self.flat * x.mean())[:WIDTH]  # flat stays a constant, not folded


class DistinctMLP(DuplicatedMLP):
    """DuplicatedMLP with every weight different: the baseline that shows the size saved by deduplication."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.b.weight.add_(1.0)
            self.flat.add_(2.0)


class Accumulator(nn.Module):
    """A mutated buffer (it becomes a program state buffer) with non-zero initial contents."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.proj = nn.Linear(8, 8)
        self.register_buffer("total", torch.arange(8, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        return self.proj(x) * self.total


class DynamicBlock(nn.Module):
    """Dynamic batch and sequence, with ops whose attributes cover most attribute kinds (int, float, bool, string,
    dtype, ints, symint, symints)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.norm = nn.LayerNorm(8, eps=1e-6)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.proj(self.norm(x)), approximate="tanh")
        h = torch.softmax(h, dim=-1) + h[:, 1:].sum(1, keepdim=True)
        flat = h.reshape(h.shape[0], -1)
        return flat * (flat > 0).to(torch.float32)


def dynamic_shapes() -> tuple:
    batch = torch.export.Dim("batch", min=1, max=16)
    seq = torch.export.Dim("seq", min=3, max=32)
    return ({0: batch, 1: seq},)


def export_duplicated(distinct: bool = False) -> ProgramBuilder:
    import kiln

    model = DistinctMLP() if distinct else DuplicatedMLP()
    return kiln.export(model, (torch.randn(3, WIDTH),))


def export_accumulator() -> ProgramBuilder:
    import kiln

    return kiln.export(Accumulator(), (torch.randn(3, 8),))


def export_dynamic() -> ProgramBuilder:
    import kiln

    return kiln.export(DynamicBlock(), (torch.randn(2, 5, 8),), dynamic_shapes=dynamic_shapes())
