"""fuse_residual_norm: rms_norm(x + r) becomes one add_rms_norm node giving the sum and its norm, wherever the
sum is read after, and only for a same-shape, same-dtype add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.passes.common import export_checked, nodes, ops

LATER = {"fuse_norm_linear"}
"""The pass that absorbs an add_rms_norm into the linear reading it (tests/passes/test_fuse_linear.py)."""


class PreNormBlocks(nn.Module):
    """Two pre-norm residual blocks: each norm reads a residual sum that the next residual add reads again."""

    def __init__(self, d: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.f, self.g = nn.Linear(d, d), nn.Linear(d, d)
        self.w1, self.w2 = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        h = x + self.f(F.rms_norm(x, (x.shape[-1],), self.w1, 1e-6))
        n = F.rms_norm(h, (h.shape[-1],), self.w2, 1e-6)
        out = h + self.g(n)
        return out, F.rms_norm(out, (out.shape[-1],), None, 1e-5)


def test_residual_adds_fuse_into_their_norms() -> None:
    program = export_checked(PreNormBlocks(), (torch.randn(2, 3, 16),), skip_passes=LATER)
    fused = nodes(program, "add_rms_norm")
    assert len(fused) == 2 and "add" not in ops(program)
    assert [n.attrs["eps"] for n in fused] == [1e-6, 1e-5]
    assert len(nodes(program, "rms_norm")) == 1  # the first norm reads the input, no add before it


def test_fused_blocks_match_eager_in_float16() -> None:
    model = PreNormBlocks().to(torch.float16)
    program = export_checked(model, (torch.randn(2, 3, 16, dtype=torch.float16),), tol=1e-2, skip_passes=LATER)
    assert len(nodes(program, "add_rms_norm")) == 2


class NotFusable(nn.Module):
    """A broadcasting add before a norm (not a residual path), and a norm whose weight is computed after its add
    (the fused node, in the add's place, could not read it)."""

    def forward(self, x, bias, y, w):
        a = F.rms_norm(x + bias, (8,), None, 1e-6)
        s = x + y
        b = F.rms_norm(s, (8,), torch.sigmoid(w), 1e-6)
        return a, b


def test_declines_other_adds() -> None:
    args = (torch.randn(2, 8), torch.randn(8), torch.randn(2, 8), torch.randn(8))
    program = export_checked(NotFusable(), args)
    assert "add_rms_norm" not in ops(program)
