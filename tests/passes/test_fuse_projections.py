"""fuse_projections: linears on one input become one linear over stacked weights and a slice per output."""

from __future__ import annotations

import torch
from torch import nn

from tests.passes.common import export_checked, nodes


class Attention(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(8, 8, bias=bias), nn.Linear(8, 4, bias=bias), nn.Linear(8, 4, bias=bias)

    def forward(self, x):
        return self.q(x).sum(-1, keepdim=True) * self.k(x) + self.v(x)


def test_projections_on_one_input_stack() -> None:
    for bias in (False, True):
        program = export_checked(Attention(bias), (torch.randn(2, 3, 8),))
        (linear,) = nodes(program, "linear")
        method = program.ir.methods["forward"]
        assert method.values[linear.inputs[1]].shape == (16, 8)
        assert (method.values[linear.inputs[2]].shape == (16,)) if bias else linear.inputs[2] < 0
        assert [(n.attrs["start"], n.attrs["end"]) for n in nodes(program, "slice")] == [(0, 8), (8, 12), (12, 16)]


class Shared(nn.Module):
    """A weight read twice (tied) and linears on different inputs: neither may stack."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        return self.a(x) + self.a(y) + self.b(y)


def test_declines_shared_weights_and_different_inputs() -> None:
    program = export_checked(Shared(), (torch.randn(2, 8), torch.randn(2, 8)))
    assert len(nodes(program, "linear")) == 3 and not nodes(program, "slice")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


class SharedLayers(nn.Module):
    """Two layers with one layer's weights (ALBERT-style; the benchmarks' cycled layers) and a third of its own."""

    def __init__(self, tie_third: bool):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.other = Layer(), Layer()
        if tie_third:
            self.other.k = self.first.k  # read with other partners there: the part would stay beside two copies

    def forward(self, x):
        return self.other(self.first(self.first(x)))


def test_layers_that_share_weights_stack_them_alike_once() -> None:
    program = export_checked(SharedLayers(tie_third=False), (torch.randn(2, 3, 8),))
    linears = nodes(program, "linear")
    method = program.ir.methods["forward"]
    refs = [method.values[n.inputs[1]].ref for n in linears]
    assert len(refs) == 3 and refs[0] == refs[1] != refs[2]  # the shared layers' stacked weight is one constant
    assert sorted(c.shape for c in program.ir.constants) == [(24,), (24,), (24, 8), (24, 8)]  # no part beside it
    program = export_checked(SharedLayers(tie_third=True), (torch.randn(2, 3, 8),))
    assert len(nodes(program, "linear")) == 9 and not nodes(program, "slice")
