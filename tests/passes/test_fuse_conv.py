"""fuse_conv: zero pads and activations fused into convolutions, declining when the fusion would be wrong, with
outputs unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.models import vision
from tests.passes.common import export_checked, nodes, ops


class SamePadConv(nn.Module):
    """TF-style "same" padding, asymmetric, before a strided depthwise and a dense conv, each with an activation."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.dw = nn.Conv2d(4, 4, 5, stride=2, groups=4)
        self.conv = nn.Conv2d(4, 6, 3, stride=2)
        self.act = act

    def forward(self, x):
        y = self.act(self.dw(F.pad(x, (1, 2, 2, 1))))
        return self.act(self.conv(F.pad(y, (0, 1, 0, 1))))


@pytest.mark.parametrize("act", [nn.ReLU(), nn.ReLU6(), nn.Hardtanh(-1.0, 2.0), nn.Hardswish()],
                         ids=["relu", "relu6", "hardtanh", "hardswish"])
def test_fuses_pads_and_activations(act: nn.Module) -> None:
    program = export_checked(SamePadConv(act), (torch.randn(2, 4, 15, 14),))
    assert ops(program) == ["conv", "conv"]
    dw, conv = nodes(program, "conv")
    assert (dw.attrs["padding"], dw.attrs["padding_end"]) == ((2, 1), (1, 2))
    assert (conv.attrs["padding"], conv.attrs["padding_end"]) == ((0, 0), (1, 1))
    assert dw.attrs["activation"] == conv.attrs["activation"] != "none"


class SharedOutputs(nn.Module):
    """Each fusion here would change a value someone else reads, so every one must decline."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 3, 3)
        self.b = nn.Conv2d(3, 3, 3)

    def forward(self, x):
        p = F.pad(x, (1, 1, 1, 1))
        y = self.a(p)
        return torch.relu(y), y, self.b(p) + p[..., 1:-1, 1:-1].sum()


class UnfusablePads(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3)
        self.convt = nn.ConvTranspose2d(3, 3, 3)

    def forward(self, x):
        a = self.conv(F.pad(x, (1, 1, 1, 1), value=0.5))  # not zero
        b = self.conv(F.pad(x[:, :3], (1, 1, 1, 1, 0, 1)))  # pads the channel dim
        c = self.conv(F.pad(x, (1, 1, -1, 1)))  # crops
        d = torch.relu(self.convt(x[:, :3]))  # transposed: left alone
        return a, b, c, d


def test_declines_when_fusion_would_be_wrong() -> None:
    program = export_checked(SharedOutputs(), (torch.randn(1, 3, 6, 6),))
    assert ops(program).count("pad") == 1 and "relu" in ops(program)
    assert all(c.attrs.get("activation", "none") == "none" for c in nodes(program, "conv"))

    program = export_checked(UnfusablePads(), (torch.randn(1, 4, 6, 6),))
    assert ops(program).count("pad") == 3 and "relu" in ops(program)
    assert all(not c.attrs.get("padding_end") for c in nodes(program, "conv"))


def test_fires_on_real_model_graphs() -> None:
    program = export_checked(vision.mobilenet_v3_small(num_classes=10), (torch.randn(1, 3, 64, 64),), tol=1e-4)
    assert "hardswish" in ops(program)  # the squeeze-excitation and classifier ones have no conv to join
    assert sum(c.attrs.get("activation") == "hardswish" for c in nodes(program, "conv")) >= 10
    assert sum(c.attrs.get("activation") == "clamp" for c in nodes(program, "conv")) >= 5


def test_fires_on_efficientnet_lite0() -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    model = vision.efficientnet_lite0(pretrained=False)
    program = export_checked(model, (torch.randn(1, 3, 64, 64),), tol=1e-4)
    assert "pad" not in ops(program) and "clamp" not in ops(program)
    convs = nodes(program, "conv")
    assert any(c.attrs.get("padding_end") and c.attrs["padding_end"] != c.attrs["padding"] for c in convs)
