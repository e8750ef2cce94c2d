"""fuse_gated_mlp: act(gate) * up becomes one gated_activation node for SwiGLU and GeGLU, and only then."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.passes.common import export_checked, nodes, ops


class GatedMLP(nn.Module):
    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act = act

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("act,name", [(F.silu, "silu"), (F.gelu, "gelu"),
                                      (lambda t: F.gelu(t, approximate="tanh"), "gelu_tanh")])
def test_gated_mlp_becomes_one_node(act, name) -> None:
    program = export_checked(GatedMLP(act), (torch.randn(2, 3, 8),), skip_passes={"fuse_gated_linear"})
    (fused,) = nodes(program, "gated_activation")
    assert fused.attrs["activation"] == name and "mul" not in ops(program)


class NotGated(nn.Module):
    """A broadcasting product, and an activation also read elsewhere: neither may fuse."""

    def forward(self, x, scale):
        a = F.silu(x) * scale
        b = F.silu(x + 1)
        return a, b * x, b


def test_declines_other_products() -> None:
    program = export_checked(NotGated(), (torch.randn(2, 8), torch.randn(8)))
    assert "gated_activation" not in ops(program)
