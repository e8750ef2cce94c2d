"""`kiln classify`: the top-k ImageNet (or other) labels of an image from a classifier program. Torch-free."""

from __future__ import annotations

import argparse
import time

import numpy as np

from kiln.cli.common import CliError
from kiln.cli.vision_common import add_common_arguments, labels_for, open_program, read_image
from kiln.runtime import vision

HELP = "classify an image with an image-classifier .kiln program (top-k labels with scores)"
DESCRIPTION = """\
Classify one image with a classifier program whose forward takes a (1, 3, H, W) float32 image and returns
(1, classes) logits. The image is decoded with Pillow, its short side resized, center-cropped to the input size,
scaled to [0, 1] and normalized with mean/std; the scores printed are the softmax of the logits.

Preprocessing comes from the program's metadata (kiln.vision.size, resize, mean, std, interpolation, labels),
written by kiln's export recipes; without it: resize to size/0.875 (256 for 224), ImageNet mean/std, bilinear,
ImageNet labels. The options below override it."""
EPILOG = """\
make a program (real ImageNet weights, needs torch):
  python -m kiln.models.imagenet -o efficientnet_lite0.kiln
  kiln export kiln.models.imagenet:efficientnet_lite0_factory -o efficientnet_lite0.kiln   # the same

examples:
  kiln classify efficientnet_lite0.kiln photo.jpg
  kiln classify model.kiln photo.jpg --top 10 --resize 256 --mean 0.5 --std 0.5
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("classify", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--top", type=int, default=5, metavar="K", help="how many labels to print (default: 5)")
    p.add_argument("--resize", type=int, metavar="N", help="resize the short side to N before the center crop")
    p.add_argument("--mean", metavar="R,G,B", help="per-channel mean of [0, 1] pixels (one value for all channels)")
    p.add_argument("--std", metavar="R,G,B", help="per-channel standard deviation (one value for all channels)")
    p.add_argument("--interpolation", choices=vision.INTERPOLATIONS, help="resize filter (default: bilinear)")
    p.set_defaults(handler=run)


def preprocess_settings(args: argparse.Namespace, meta: dict[str, str], size: int) -> dict:
    """Resize, mean, std and interpolation: the command line first, then the program's metadata, then defaults."""
    try:
        mean_text = args.mean or meta.get("kiln.vision.mean")
        std_text = args.std or meta.get("kiln.vision.std")
        resize = args.resize or (int(meta["kiln.vision.resize"]) if meta.get("kiln.vision.resize", "").isdigit()
                                 else None)
        return {"resize": resize if resize is not None else int(size / 0.875),
                "mean": vision.parse_floats(mean_text, "--mean") if mean_text else vision.IMAGENET_MEAN,
                "std": vision.parse_floats(std_text, "--std") if std_text else vision.IMAGENET_STD,
                "interpolation": args.interpolation or meta.get("kiln.vision.interpolation", "bilinear")}
    except ValueError as e:
        raise CliError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise CliError(f"--top must be >= 1, got {args.top}")
    prog = open_program(args)
    if prog.height != prog.width:
        raise CliError(f"the program's input is {prog.height}x{prog.width}; classify center-crops a square")
    settings = preprocess_settings(args, prog.meta, prog.height)
    if min(settings["std"]) <= 0:
        raise CliError(f"--std must be positive, got {settings['std']}")
    labels = labels_for(args, prog.meta, "imagenet")
    image = read_image(args.image)
    try:
        x = vision.classifier_input(image, prog.height, **settings)
    except ValueError as e:
        raise CliError(str(e)) from None
    t0 = time.perf_counter()
    outputs = prog.run(args.backend, x)
    elapsed = (time.perf_counter() - t0) * 1e3
    logits = np.asarray(outputs[0], dtype=np.float32).reshape(-1)
    if logits.size != len(labels):
        raise CliError(f"the program returns {logits.size} scores but there are {len(labels)} labels; "
                       "give matching --labels")
    probs = vision.softmax(logits.astype(np.float64))
    print(f"{args.image} ({image.size[0]}x{image.size[1]}) -> {args.model} ({elapsed:.1f} ms)")
    for rank, (index, p) in enumerate(vision.top_k(probs, args.top), 1):
        print(f"  {rank}. {p:7.2%}  {labels[index]}  (class {index})")
    return 0
