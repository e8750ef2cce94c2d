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


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_quantized_projections_fuse_into_their_quantized_forms(quantize, bias) -> None:
    """A quantized gate/up projection and the norm before it fuse as the float ones do, into
    add_rms_norm_quantized_linear (the gated form inside), its quantization carried over; the program gives the
    unfused program's outputs, bit for bit, on every backend that runs here."""
    import numpy as np

    import kiln
    from tests.conftest import BACKENDS

    model = PreNormMLPBlock(d=64, hidden=96, bias=bias).eval()
    for x in (torch.randn(1, 1, 64), torch.randn(3, 5, 64)):  # few rows (the compiled few-row path) and many
        fused = kiln.export(model, (x,), quantize=quantize).load()
        (node,) = nodes(fused, "add_rms_norm_quantized_linear")
        assert node.attrs["activation"] == "silu" and node.attrs["bits"] == (8 if quantize == "int8" else 4)
        assert len(node.inputs) == 7 and (node.inputs[6] != NO_VALUE) == bias  # x residual nw q scale zero bias
        for gone in ("add_rms_norm", "gated_activation", "slice"):
            assert gone not in ops(fused), gone
        plain = kiln.export(model, (x,), quantize=quantize,
                            skip_passes=("fuse_gated_linear", "fuse_norm_linear")).load()
        assert "add_rms_norm_quantized_linear" not in ops(plain)
        for backend in [b for b in ("cpu", "mlx") if b in BACKENDS]:
            got, want = (p.session(backend).run("forward", x.numpy())[0] for p in (fused, plain))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_quantized_gated_projection_without_a_norm() -> None:
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gate, self.up = nn.Linear(64, 48), nn.Linear(64, 48)

        def forward(self, x):
            return F.gelu(self.gate(x)) * self.up(x)

    import kiln

    program = kiln.export(Gated().eval(), (torch.randn(2, 64),), quantize="int8").load()
    (node,) = nodes(program, "gated_quantized_linear")
    assert ops(program) == ["gated_quantized_linear"]
    assert node.attrs == {"bits": 8, "group_size": 64, "activation": "gelu"}
