"""fold_batch_norm: fires on conv -> batch_norm, declines when the fold would be wrong, leaves outputs unchanged."""

from __future__ import annotations

import torch
from torch import nn

from kiln.models import vision
from tests.passes.common import export_checked, ops


def _calibrated(model: nn.Module) -> nn.Module:
    """Non-trivial batch-norm statistics and affine parameters, so a wrong fold cannot pass."""
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=gen))
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen))
    return model.eval()


class ConvBN(nn.Module):
    def __init__(self, bias: bool, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=bias, groups=groups)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_folds_conv_with_and_without_bias() -> None:
    x = torch.randn(2, 4, 6, 6)
    for bias, groups in ((True, 1), (False, 1), (False, 4)):
        program = export_checked(_calibrated(ConvBN(bias, groups)), (x,))
        assert "batch_norm" not in ops(program) and ops(program).count("conv") == 1


class SharedConvOutput(nn.Module):
    """The raw conv output is also returned: folding would change it, so the pass must decline."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y), y


class TransposedConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.ConvTranspose2d(4, 8, 3, stride=2)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x))


class InputBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(x)


def test_declines_when_the_fold_would_be_wrong() -> None:
    x = torch.randn(1, 4, 6, 6)
    for model in (SharedConvOutput(), TransposedConvBN(), InputBN()):
        program = export_checked(_calibrated(model), (x,))
        assert "batch_norm" in ops(program), type(model).__name__


def test_fires_on_real_model_graphs() -> None:
    model = _calibrated(vision.resnet18(num_classes=10))
    program = export_checked(model, (torch.randn(1, 3, 32, 32),), tol=1e-4)
    assert "batch_norm" not in ops(program)
