"""fuse_gated_linear and fuse_norm_linear: a linear layer absorbs the gated activation of its two halves and the
residual add + RMSNorm before it, and only where the small nodes have no other reader."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.ir.graph import NO_VALUE
from tests.passes.common import export_checked, nodes, ops


class PreNormMLPBlock(nn.Module):
    """A residual block then a pre-norm gated MLP (Llama's second half): norm(x + f(x)) read by the gate and up
    projections only, whose stacked output's halves feed the activation."""

    def __init__(self, d: int = 16, hidden: int = 24, act=F.silu, bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.f, self.down = nn.Linear(d, d), nn.Linear(hidden, d, bias=bias)
        self.gate, self.up = nn.Linear(d, hidden, bias=bias), nn.Linear(d, hidden, bias=bias)
        self.w = nn.Parameter(torch.rand(d) + 0.5)
        self.act = act

    def forward(self, x):
        h = x + self.f(x)
        n = F.rms_norm(h, (h.shape[-1],), self.w, 1e-6)
        return h + self.down(self.act(self.gate(n)) * self.up(n))


@pytest.mark.parametrize("act,name,bias", [(F.silu, "silu", False), (F.gelu, "gelu", True),
                                           (lambda t: F.gelu(t, approximate="tanh"), "gelu_tanh", False)])
def test_norm_and_gated_activation_fuse_into_the_projection(act, name, bias) -> None:
    program = export_checked(PreNormMLPBlock(act=act, bias=bias), (torch.randn(2, 3, 16),))
    (fused,) = nodes(program, "add_rms_norm_linear")
    assert fused.attrs == {"axes": 1, "eps": 1e-6, "activation": name}
    # x, residual, norm weight, stacked weight, bias
    assert len(fused.inputs) == 5 and (fused.inputs[4] != NO_VALUE) == bias
    for gone in ("add_rms_norm", "gated_activation", "gated_linear", "slice", "rms_norm"):
        assert gone not in ops(program), gone
    assert ops(program).count("linear") == 2  # f and down


def test_gated_linear_without_a_norm_before_it() -> None:
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gate, self.up = nn.Linear(8, 12), nn.Linear(8, 12)

        def forward(self, x):
            return F.silu(self.gate(x)) * self.up(x)

    program = export_checked(Gated(), (torch.randn(3, 8),))
    assert ops(program) == ["gated_linear"]


class PreNormProjection(nn.Module):
    """x + r normalized and projected: a plain linear absorbs the norm too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 40)

    def forward(self, x, r):
        h = x + r
        return h, self.proj(F.rms_norm(h, (16,), None, 1e-5))


def test_plain_projection_absorbs_the_norm() -> None:
    program = export_checked(PreNormProjection(), (torch.randn(1, 16), torch.randn(1, 16)))
    assert ops(program) == ["add_rms_norm_linear"]
    assert program.ir.methods["forward"].nodes[0].attrs["activation"] == ""


def test_fused_block_matches_eager_in_float16() -> None:
    model = PreNormMLPBlock().to(torch.float16)
    program = export_checked(model, (torch.randn(1, 16, dtype=torch.float16),), tol=1e-2)
    assert len(nodes(program, "add_rms_norm_linear")) == 1


class NotFusable(nn.Module):
    """A norm also read outside its projection, and gate/up halves in the other order (up first)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 32)

    def forward(self, x, r):
        n = F.rms_norm(x + r, (16,), None, 1e-5)
        h = self.proj(n)
        return n, F.silu(h[..., 16:]) * h[..., :16]


def test_declines_shared_norms_and_swapped_halves() -> None:
    program = export_checked(NotFusable(), (torch.randn(2, 16), torch.randn(2, 16)))
    assert "add_rms_norm_linear" not in ops(program) and "gated_linear" not in ops(program)
    assert {"add_rms_norm", "linear", "gated_activation"} <= set(ops(program))
