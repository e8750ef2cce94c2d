"""Small helpers shared by the commands: the user-error type and human-readable formatting."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from kiln.runtime import Program, load


class CliError(Exception):
    """A mistake on the command line (bad SPEC, missing file, ...): printed as one message, exit status 2."""


def error(command: str, message: str) -> None:
    print(f"kiln {command}: error: {message}", file=sys.stderr)


BACKEND_HELP = ("where to run: cpu (NumPy, any machine), cuda (an NVIDIA GPU, through CuPy), mlx (Apple's MLX: the GPU "
                "of a Mac, or the CPU with `pip install \"mlx[cpu]\"` elsewhere) (default: cpu)")


def add_backend_argument(p: argparse.ArgumentParser) -> None:
    """--backend, with the backends kiln has as its choices."""
    from kiln.runtime.backends import BACKENDS

    p.add_argument("--backend", default="cpu", choices=sorted(BACKENDS), help=BACKEND_HELP)
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="CPU threads the compiled kernels may use (default: KILN_THREADS, else every core); results "
                        "do not depend on it")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_program_arguments(p: argparse.ArgumentParser, verb: str) -> None:
    """The arguments every command that runs a method shares: the file, the method, the backend, .npy inputs."""
    p.add_argument("model", help="the .kiln file")
    p.add_argument("--method", help=f"the method to {verb} (default: forward, or the only method)")
    add_backend_argument(p)
    p.add_argument("-i", "--input", action="extend", nargs="+", default=[], metavar="NPY", dest="inputs",
                   help="an input .npy file; repeat (or list several) in the method's input order")


def load_program(path: str | os.PathLike) -> Program:
    """kiln.load with a missing or unreadable file reported as a user error rather than a traceback."""
    try:
        return load(path)
    except FileNotFoundError:
        raise CliError(f"{os.fspath(path)}: no such file") from None
    except PermissionError:
        raise CliError(f"{os.fspath(path)}: permission denied") from None


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB so small files stay readable."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def shape_text(shape: list | tuple) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def preview(array: np.ndarray, count: int = 6) -> str:
    """The first `count` values of an array, flattened, and for numbers its range and mean: enough to eyeball."""
    flat = np.asarray(array).reshape(-1)
    if flat.dtype.kind not in "biuf":  # bfloat16 and other ml_dtypes types: show as float32
        flat = flat.astype(np.float32)
    fmt = (lambda v: f"{v:.4g}") if flat.dtype.kind == "f" else str
    body = "[" + ", ".join(fmt(v) for v in flat[:count].tolist()) + (", ...]" if flat.size > count else "]")
    if flat.size == 0 or flat.dtype.kind == "b":
        return body
    stats = flat.astype(np.float64)
    return f"{body}  min {fmt(flat.min().item())} max {fmt(flat.max().item())} mean {stats.mean():.4g}"


def compact_json(data: object, indent: int = 2, level: int = 0) -> str:
    """JSON with nested containers indented but lists of plain values (shapes) kept on one line."""
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    if isinstance(data, dict) and data:
        items = [f"{inner}{json.dumps(str(k))}: {compact_json(v, indent, level + 1)}" for k, v in data.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        items = [f"{inner}{compact_json(v, indent, level + 1)}" for v in data]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(data)


def parse_assignments(items: list[str] | None, what: str, flag: str) -> dict[str, str]:
    """['a=1', 'b=x'] -> {'a': '1', 'b': 'x'}; a clear error for anything without '='."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"{flag} {item!r}: expected {what} as NAME=VALUE")
        out[key.strip()] = value.strip()
    return out
