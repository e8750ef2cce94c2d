"""What `kiln classify` and `kiln detect` share: the program, its image input size, its metadata, the image.

Torch-free: Pillow (lazily) and NumPy only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kiln.cli.common import CliError, add_backend_argument, load_program
from kiln.cli.run_cmd import pick_method
from kiln.runtime import Program, vision


@dataclass
class VisionProgram:
    """A loaded image program: the method to run, its (height, width) input, and its kiln.vision.* metadata."""

    program: Program
    method: str
    height: int
    width: int
    meta: dict[str, str]

    def run(self, backend: str, image: Any) -> list[Any]:
        session = self.program.session(backend)
        return [session.backend.to_numpy(o) for o in session.run(self.method, image)]


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .kiln file")
    p.add_argument("image", help="the image file (JPEG, PNG, ... anything Pillow reads)")
    p.add_argument("--size", type=int, metavar="N",
                   help="square input size, for a program whose input size is symbolic (default: the program's)")
    p.add_argument("--labels", metavar="NAME|FILE",
                   help="class names: imagenet, coco, or a text file with one name per line "
                        "(default: the program's kiln.vision.labels)")
    p.add_argument("--method", help="the method to run (default: forward)")
    add_backend_argument(p)


def open_program(args: argparse.Namespace) -> VisionProgram:
    """Load the program and work out its (1, 3, H, W) input size from its spec, --size or metadata."""
    program = load_program(args.model)
    method = pick_method(program, args.method)
    info = program.info(method)
    if len(info.inputs) != 1 or len(info.inputs[0].shape) != 4:
        specs = ", ".join(v.spec() for v in info.inputs)
        raise CliError(f"{args.model}: method {method!r} takes ({specs}); an image program takes one (N, 3, H, W) "
                       "input")
    meta = {k: v for k, v in program.metadata.items() if k.startswith("kiln.vision.")}
    _, channels, height, width = info.inputs[0].shape
    if isinstance(channels, int) and channels != 3:
        raise CliError(f"{args.model}: the input has {channels} channels; an RGB image program takes 3")
    fallback = args.size or (int(meta["kiln.vision.size"]) if "kiln.vision.size" in meta else None)
    sizes = []
    for dim in (height, width):
        if isinstance(dim, int):
            if args.size and args.size != dim:
                raise CliError(f"--size {args.size}: the program's input is fixed at {height}x{width}")
            sizes.append(dim)
        elif fallback is None:
            raise CliError(f"{args.model}: the input size is symbolic ({dim}); give --size N")
        else:
            sizes.append(fallback)
    return VisionProgram(program, method, sizes[0], sizes[1], meta)


def labels_for(args: argparse.Namespace, meta: dict[str, str], default: str) -> list[str]:
    try:
        return vision.load_labels(args.labels or meta.get("kiln.vision.labels", default))
    except ValueError as e:
        raise CliError(str(e)) from None


def read_image(path: str) -> Any:
    try:
        return vision.load_image(path)
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise CliError(str(e)) from None
