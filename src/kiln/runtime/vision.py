"""Torch-free image pre- and post-processing for vision programs: what `kiln classify` and `kiln detect` use.

Images are decoded and resized with Pillow (imported lazily, so the runtime does not need it until an image is
read); everything else is NumPy. Preprocessing follows what the exported model expects, recorded at export time in
the program's metadata under `kiln.vision.*` (see `classifier_metadata`, `detector_metadata`):

  classification: resize the short side, center-crop, scale to [0, 1], normalize with mean/std, NCHW float32
  detection (YOLO): stretch to the input size (or letterbox: fit and pad with gray), scale to [0, 1], NCHW
                    float32; after the model,
                    score threshold, class-aware NMS, and boxes mapped back to the original image's pixels.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.errors import FileFormatError

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
DETECTOR_RESIZES = ("stretch", "letterbox")
LETTERBOX_FILL = 0.5
"""Darknet pads letterboxed images with mid gray (0.5 after scaling to [0, 1])."""


def pillow() -> Any:
    """The PIL.Image module, or an error that says how to get it (kiln's runtime does not require Pillow)."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("reading images needs Pillow: pip install pillow") from None
    return Image


# ---------------------------------------------------------------------------------------------------------------
# Metadata: how a program wants its images
# ---------------------------------------------------------------------------------------------------------------


def _floats(values: tuple[float, ...] | list[float]) -> str:
    return ",".join(repr(float(v)) for v in values)


def classifier_metadata(size: int, resize: int, mean: tuple[float, ...] = IMAGENET_MEAN,
                        std: tuple[float, ...] = IMAGENET_STD, interpolation: str = "bilinear",
                        labels: str = "imagenet") -> dict[str, str]:
    """`kiln.vision.*` entries for an image classifier: short side resized to `resize`, center crop `size`."""
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    return {"kiln.vision.task": "classify", "kiln.vision.size": str(size), "kiln.vision.resize": str(resize),
            "kiln.vision.mean": _floats(mean), "kiln.vision.std": _floats(std),
            "kiln.vision.interpolation": interpolation, "kiln.vision.labels": labels}


def detector_metadata(size: int, resize: str = "stretch", labels: str = "coco") -> dict[str, str]:
    """`kiln.vision.*` entries for a YOLO-style detector whose outputs start (boxes cxcywh, objectness, scores).
    resize: 'stretch' (plain resize to the input size) or 'letterbox' (fit, keep the aspect ratio, pad)."""
    if resize not in DETECTOR_RESIZES:
        raise ValueError(f"resize must be one of {DETECTOR_RESIZES}, got {resize!r}")
    return {"kiln.vision.task": "detect", "kiln.vision.size": str(size), "kiln.vision.resize": resize,
            "kiln.vision.labels": labels, "kiln.vision.outputs": "boxes_cxcywh,objectness,class_scores"}


def parse_floats(text: str, what: str, count: int = 3) -> tuple[float, ...]:
    """'0.5,0.5,0.5' (or one value for all channels) -> a tuple of `count` floats."""
    try:
        values = tuple(float(v) for v in text.replace(" ", ",").split(",") if v)
    except ValueError:
        raise ValueError(f"{what}: expected {count} comma-separated numbers, got {text!r}") from None
    if len(values) == 1:
        values = values * count
    if len(values) != count:
        raise ValueError(f"{what}: expected {count} numbers (one per channel), got {len(values)} in {text!r}")
    return values


# ---------------------------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------------------------


def load_labels(name_or_path: str) -> list[str]:
    """Class names: 'imagenet' (1000) and 'coco' (80) are shipped with kiln; anything else is a text file path
    with one name per line, in class-index order."""
    if name_or_path in ("imagenet", "coco"):
        text = resources.files("kiln").joinpath(f"data/{name_or_path}_classes.txt").read_text(encoding="utf-8")
    else:
        try:
            with open(name_or_path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"labels {name_or_path!r}: not 'imagenet', 'coco' or a readable file ({e})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# Decoding and preprocessing
# ---------------------------------------------------------------------------------------------------------------


class ImageFormatError(FileFormatError):
    """An image file kiln cannot read: not an image, truncated or corrupt, of a format it does not open, or larger
    than MAX_PIXELS."""


IMAGE_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "DIB", "TIFF", "WEBP", "PPM", "TGA", "ICO", "JPEG2000", "AVIF")
"""The Pillow formats load_image opens (JPEG includes the MPO files phones write). Formats Pillow decodes by running
other programs (EPS, through Ghostscript) or rarely meant as photos are left out: the file is untrusted."""
MAX_PIXELS = 89_478_485
"""Largest image (width x height) load_image decodes: Pillow's own decompression-bomb limit (a 1 KB PNG can
declare 50000 x 50000 pixels), here an error rather than Pillow's warning."""


def load_image(path: str | os.PathLike) -> Image:
    """The image at `path` as an RGB Pillow image (grayscale, palette and RGBA images are converted).

    Raises FileNotFoundError for a missing file and ImageFormatError for anything else that goes wrong: Pillow's
    decoders raise a wide, undocumented range of exceptions on corrupt input (OSError, SyntaxError, struct.error,
    ValueError, zlib.error, ...), so every one of them is reported as the file's fault, with Pillow's message.

    Pillow reads from the file's bytes in memory rather than from the file: its PNG reader calls read(n) with the
    length a chunk declares, and a file object allocates n bytes up front (a 200-byte PNG whose IDAT claims 4 GB
    made Pillow 13 allocate 4 GB); an in-memory buffer returns what is there."""
    image_mod = pillow()
    name = os.fspath(path)
    try:
        if Path(path).exists() and not Path(path).is_dir() and not Path(path).is_file():
            raise ImageFormatError(f"{name} is not a regular file (a device or a pipe?)")
        data = io.BytesIO(Path(path).read_bytes())
        with warnings.catch_warnings():  # the size is checked here, before decoding; Pillow need not warn too
            warnings.simplefilter("ignore", image_mod.DecompressionBombWarning)
            with image_mod.open(data, formats=IMAGE_FORMATS) as image:
                _check_size(image.size, name)
                return image.convert("RGB")
    except ImageFormatError:
        raise
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: no such image file") from None
    except IsADirectoryError:
        raise ImageFormatError(f"{name}: a folder, not an image file") from None
    except image_mod.DecompressionBombError:  # (Pillow's own check, at twice its limit, comes first)
        raise ImageFormatError(f"{name}: over kiln's limit of {MAX_PIXELS:,} pixels (a decompression bomb, or a "
                               "photo to scale down first)") from None
    except image_mod.UnidentifiedImageError:
        raise ImageFormatError(f"{name}: not an image Pillow can read in the formats kiln opens "
                               f"({', '.join(IMAGE_FORMATS)})") from None
    except Exception as e:  # a corrupt file may make any decoder fail in any way (see above)
        cause = " ".join(str(e).split())[:200]
        raise ImageFormatError(f"{name}: a corrupt or truncated image ({type(e).__name__}: {cause})") from None


def _check_size(size: tuple[int, int], name: str) -> None:
    """Refuse an empty image or one over MAX_PIXELS before its pixels are decoded (the header alone says)."""
    width, height = size
    if width < 1 or height < 1:
        raise ImageFormatError(f"{name}: an image of {width}x{height} pixels")
    if width * height > MAX_PIXELS:
        raise ImageFormatError(f"{name}: {width}x{height} pixels is over kiln's limit of {MAX_PIXELS:,} "
                               "(a decompression bomb, or a photo to scale down first)")


def _resample(interpolation: str) -> Any:
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    return getattr(pillow().Resampling, interpolation.upper())


def resize_short_side(image: Image, size: int, interpolation: str = "bilinear") -> Image:
    """Resize so the shorter side is `size`, keeping the aspect ratio (torchvision's Resize(int))."""
    width, height = image.size
    if min(width, height) == size:
        return image
    if width <= height:
        new = (size, int(size * height / width))
    else:
        new = (int(size * width / height), size)
    return image.resize(new, _resample(interpolation))


def center_crop(image: Image, width: int, height: int) -> Image:
    """The central width x height window (torchvision's CenterCrop rounding); the image must be large enough."""
    w, h = image.size
    if w < width or h < height:
        raise ValueError(f"cannot center-crop {width}x{height} from a {w}x{h} image")
    left, top = int(round((w - width) / 2.0)), int(round((h - height) / 2.0))
    return image.crop((left, top, left + width, top + height))


def to_nchw(image: Image | np.ndarray, mean: tuple[float, ...] | None = None,
            std: tuple[float, ...] | None = None) -> np.ndarray:
    """RGB uint8 (H, W, 3) -> float32 (1, 3, H, W) in [0, 1], then (x - mean) / std per channel if given."""
    array = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    if mean is not None or std is not None:
        mean_arr = np.asarray(mean if mean is not None else (0.0,) * 3, dtype=np.float32)
        std_arr = np.asarray(std if std is not None else (1.0,) * 3, dtype=np.float32)
        array = (array - mean_arr) / std_arr
    return np.ascontiguousarray(array.transpose(2, 0, 1)[None])


def classifier_input(image: Image, size: int, resize: int | None = None, mean: tuple[float, ...] = IMAGENET_MEAN,
                     std: tuple[float, ...] = IMAGENET_STD, interpolation: str = "bilinear") -> np.ndarray:
    """Resize the short side to `resize` (default size/0.875, the usual 256 for 224), center-crop size x size,
    normalize: the (1, 3, size, size) float32 input of an ImageNet classifier."""
    resize = int(size / 0.875) if resize is None else resize
    if resize < size:
        raise ValueError(f"resize ({resize}) must be at least the crop size ({size})")
    return to_nchw(center_crop(resize_short_side(image, resize, interpolation), size, size), mean, std)


@dataclass(frozen=True)
class Placement:
    """How an image was placed in the network input: input_x = x * scale_x + pad_x, likewise y."""

    scale_x: float
    scale_y: float
    pad_x: int
    pad_y: int
    width: int
    """Original image width in pixels."""
    height: int
    """Original image height in pixels."""


def letterbox(image: Image, width: int, height: int,
              interpolation: str = "bilinear") -> tuple[np.ndarray, Placement]:
    """Fit the image inside width x height keeping its aspect ratio, centered on gray (Darknet's letterbox);
    returns the (1, 3, height, width) float32 input in [0, 1] and the placement to undo it."""
    w, h = image.size
    scale = min(width / w, height / h)
    new_w, new_h = max(1, min(width, round(w * scale))), max(1, min(height, round(h * scale)))
    pad_x, pad_y = (width - new_w) // 2, (height - new_h) // 2
    canvas = np.full((1, 3, height, width), LETTERBOX_FILL, dtype=np.float32)
    resized = image if (new_w, new_h) == (w, h) else image.resize((new_w, new_h), _resample(interpolation))
    canvas[:, :, pad_y:pad_y + new_h, pad_x:pad_x + new_w] = to_nchw(resized)
    return canvas, Placement(new_w / w, new_h / h, pad_x, pad_y, w, h)


def stretch(image: Image, width: int, height: int,
            interpolation: str = "bilinear") -> tuple[np.ndarray, Placement]:
    """Resize to width x height ignoring the aspect ratio (what OpenCV's blobFromImage and Darknet without
    letter_box do); returns the (1, 3, height, width) float32 input in [0, 1] and the placement to undo it."""
    w, h = image.size
    resized = image if (width, height) == (w, h) else image.resize((width, height), _resample(interpolation))
    return to_nchw(resized), Placement(width / w, height / h, 0, 0, w, h)


def detector_input(image: Image, width: int, height: int, resize: str = "stretch",
                   interpolation: str = "bilinear") -> tuple[np.ndarray, Placement]:
    """The detector input by `resize` ('stretch' or 'letterbox') and the placement to map boxes back."""
    if resize not in DETECTOR_RESIZES:
        raise ValueError(f"resize must be one of {DETECTOR_RESIZES}, got {resize!r}")
    return (stretch if resize == "stretch" else letterbox)(image, width, height, interpolation)


# ---------------------------------------------------------------------------------------------------------------
# Classification and detection outputs
# ---------------------------------------------------------------------------------------------------------------


def softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = logits - logits.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


def top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k best (class index, score) pairs of a 1-D score vector, best first (ties: lower index first)."""
    scores = np.asarray(scores).reshape(-1)
    order = np.argsort(-scores, kind="stable")[:k]
    return [(int(i), float(scores[i])) for i in order]


def cxcywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    cx, cy, w, h = np.moveaxis(np.asarray(boxes, dtype=np.float32), -1, 0)
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=-1)


def box_iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one xyxy box with each of `boxes` (N, 4)."""
    x0 = np.maximum(box[0], boxes[:, 0])
    y0 = np.maximum(box[1], boxes[:, 1])
    x1 = np.minimum(box[2], boxes[:, 2])
    y1 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    union = area + areas - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy non-maximum suppression on xyxy boxes: indices kept, highest score first. A box is dropped when its
    IoU with a kept, higher-scoring box is above `iou_threshold`."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    keep: list[int] = []
    while order.size:
        best = order[0]
        keep.append(int(best))
        rest = order[1:]
        order = rest[box_iou(boxes[best], boxes[rest]) <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def batched_nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Class-aware NMS: boxes of different classes never suppress each other. Indices kept, best score first."""
    keep = [np.flatnonzero(classes == c)[nms(boxes[classes == c], scores[classes == c], iou_threshold)]
            for c in np.unique(classes)]
    if not keep:
        return np.zeros(0, dtype=np.int64)
    kept = np.concatenate(keep)
    return kept[np.argsort(-scores[kept], kind="stable")]


@dataclass(frozen=True)
class Detection:
    """One detected object: box (x0, y0, x1, y1) in original-image pixels, score in [0, 1], class."""

    box: tuple[float, float, float, float]
    score: float
    class_id: int
    label: str


def to_original(boxes_xyxy: np.ndarray, placement: Placement) -> np.ndarray:
    """Boxes in network-input pixels -> original-image pixels, clipped to the image."""
    out = np.asarray(boxes_xyxy, dtype=np.float32).copy()
    out[..., [0, 2]] = (out[..., [0, 2]] - placement.pad_x) / placement.scale_x
    out[..., [1, 3]] = (out[..., [1, 3]] - placement.pad_y) / placement.scale_y
    out[..., [0, 2]] = np.clip(out[..., [0, 2]], 0, placement.width)
    out[..., [1, 3]] = np.clip(out[..., [1, 3]], 0, placement.height)
    return out


def detections(boxes: np.ndarray, objectness: np.ndarray, class_scores: np.ndarray, labels: list[str],
               placement: Placement, conf: float = 0.25, iou: float = 0.45,
               max_detections: int = 300) -> list[Detection]:
    """YOLO outputs of one image -> detections: score = objectness x best class score, kept when >= conf, then
    class-aware NMS at `iou`, boxes mapped back to the original image. boxes (N, 4) are cx, cy, w, h in input
    pixels; objectness (N,); class_scores (N, classes)."""
    class_ids = np.argmax(class_scores, axis=-1)
    scores = objectness * np.take_along_axis(class_scores, class_ids[:, None], axis=-1)[:, 0]
    candidates = np.flatnonzero(scores >= conf)
    xyxy = cxcywh_to_xyxy(boxes[candidates])
    kept = candidates[batched_nms(xyxy, scores[candidates], class_ids[candidates], iou)][:max_detections]
    original = to_original(cxcywh_to_xyxy(boxes[kept]), placement)
    return [Detection(tuple(float(v) for v in box), float(scores[i]), int(class_ids[i]),
                      labels[class_ids[i]] if class_ids[i] < len(labels) else f"class {class_ids[i]}")
            for box, i in zip(original, kept)]


def color(class_id: int) -> tuple[int, int, int]:
    """A distinct, stable, saturated color per class."""
    hue = (class_id * 0.618033988749895) % 1.0
    i, f = int(hue * 6), hue * 6 - int(hue * 6)
    q, t = int(255 * (1 - f)), int(255 * f)
    return [(255, t, 0), (q, 255, 0), (0, 255, t), (0, q, 255), (t, 0, 255), (255, 0, q)][i % 6]


def draw_detections(image: Image, found: list[Detection], path: str | os.PathLike) -> None:
    """Write `image` with each detection's box and 'label score' drawn on it (format from the file suffix)."""
    from PIL import ImageDraw, ImageFont

    canvas = image.copy()
    draw = ImageDraw.Draw(canvas)
    width = max(2, round(min(canvas.size) / 200))
    try:
        font = ImageFont.load_default(size=max(12, round(min(canvas.size) / 40)))
    except TypeError:  # Pillow < 10.1 has one fixed-size default font
        font = ImageFont.load_default()
    for det in found:
        rgb = color(det.class_id)
        x0, y0, x1, y1 = det.box
        draw.rectangle((x0, y0, x1, y1), outline=rgb, width=width)
        text = f"{det.label} {det.score:.2f}"
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        tw, th = right - left, bottom - top
        ty = y0 - th - 2 * width if y0 - th - 2 * width >= 0 else y0
        draw.rectangle((x0, ty, x0 + tw + 2 * width, ty + th + 2 * width), fill=rgb)
        ink = (0, 0, 0) if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 128 else (255, 255, 255)
        draw.text((x0 + width - left, ty + width - top), text, fill=ink, font=font)
    canvas.save(path)


__all__ = ["IMAGE_FORMATS", "MAX_PIXELS", "Detection", "ImageFormatError", "Placement", "batched_nms", "center_crop",
           "classifier_input", "classifier_metadata",
           "cxcywh_to_xyxy", "detections", "detector_input", "detector_metadata", "draw_detections", "letterbox",
           "load_image", "load_labels", "nms", "parse_floats", "resize_short_side", "softmax", "stretch", "to_nchw",
           "to_original", "top_k"]
