"""`kiln run`: run one method of a .kiln file on .npy inputs (or seeded random ones) and time it. Torch-free."""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from kiln.cli.common import CliError, add_program_arguments, load_program, parse_assignments, preview, shape_text
from kiln.ir.graph import Value
from kiln.ir.symbolic import resolve_shape
from kiln.runtime import Program

HELP = "run a method of a .kiln file on .npy inputs (or random ones) and report outputs and latency"
DESCRIPTION = """\
Run one method of a .kiln file with the torch-free runtime. Inputs come from .npy files, in the method's input
order (see `kiln inspect`), or with --random from a seeded generator following the input specs: floats from a
standard normal, integers from [0, --int-high), booleans fair coins. Symbolic dimensions need a size: --dim seq=16.

Prints each output's name, dtype, shape and first values, the latency of the first run (which builds the
execution plan) and the median of --repeat more runs (state buffers are reset before each, so every run sees the
same state). With -o, outputs are saved as out_0.npy, out_1.npy, ... (and random inputs as in_0.npy, ...)."""
EPILOG = """\
examples:
  kiln run model.kiln -i x.npy -o outputs/
  kiln run model.kiln --random --dim seq=16 --repeat 20
  kiln run llm.kiln --method decode -i token.npy -i pos.npy
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_program_arguments(p, "run")
    p.add_argument("--random", action="store_true", help="make seeded random inputs from the input specs")
    p.add_argument("--dim", action="append", metavar="SYMBOL=N", help="size of a symbolic dimension for --random")
    p.add_argument("--seed", type=int, default=0, help="seed for --random (default: 0)")
    p.add_argument("--int-high", type=int, default=10, metavar="N",
                   help="--random integers are drawn from [0, N) (default: 10), valid indices for small tables")
    p.add_argument("-o", "--output-dir", type=Path, help="directory to save out_K.npy files in")
    p.add_argument("--repeat", type=int, default=0, metavar="N", help="time N more runs and report their median")
    p.add_argument("--validate", action="store_true",
                   help="check every kernel's output dtype and shape against the program (slow; for debugging)")
    p.set_defaults(handler=run)


def pick_method(program: Program, name: str | None) -> str:
    if name is not None:
        program.method(name)  # raises InputError listing the methods
        return name
    if "forward" in program.methods or len(program.methods) != 1:
        if "forward" not in program.methods:
            raise CliError(f"the program has methods {program.methods} and none is 'forward'; choose one with "
                           "--method")
        return "forward"
    return program.methods[0]


NPY_MAGIC = b"\x93NUMPY"
NPY_VERSIONS = ((1, 0), (2, 0), (3, 0))


def check_npy_size(path: str) -> None:
    """Refuse a .npy file whose header does not parse, or declares more data than the file holds, before np.load
    allocates what it declares: np.load reads a header of the length the file states and then an array of the
    shape it states, each allocated whole first (a 100-byte file can declare 8 TiB). The header is parsed here
    from a buffer of the file's first bytes, whose reads never allocate more than is there. Other files (.npz) are
    left to np.load."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = io.BytesIO(f.read(min(size, 1 << 20)))  # (numpy refuses headers over 10,000 bytes anyway)
    if not head.getvalue().startswith(NPY_MAGIC):
        return
    try:
        version = np.lib.format.read_magic(head)
        if version not in NPY_VERSIONS:
            raise ValueError(f"its format version is {version}; .npy versions are {NPY_VERSIONS}")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(head)
    except ValueError:
        raise
    except Exception as e:  # numpy parses the header with ast and tokenize: SyntaxError, TokenError, TypeError...
        raise ValueError(f"its header does not parse ({type(e).__name__}: {e})") from None
    declared = math.prod(shape) * dtype.itemsize
    held = size - head.tell()
    if declared > held:
        raise ValueError(f"its header declares {dtype}{list(shape)} ({declared} bytes) but it holds {held} bytes")


def load_inputs(paths: list[str]) -> list[np.ndarray]:
    arrays = []
    for path in paths:
        try:
            check_npy_size(path)
            arr = np.load(path, allow_pickle=False)  # never unpickle: a .npy of objects is refused
        except FileNotFoundError:
            raise CliError(f"input file {path!r} does not exist") from None
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise CliError(f"input file {path!r} is not a readable .npy array: {e}") from None
        if not isinstance(arr, np.ndarray):
            raise CliError(f"input file {path!r} is an .npz archive; give one .npy file per input")
        arrays.append(arr)
    return arrays


def random_inputs(specs: tuple[Value, ...], dims: dict[str, str], seed: int, int_high: int,
                  symbols: dict[str, str]) -> list[np.ndarray]:
    """Seeded inputs following the specs; every symbol in a shape must be sized by --dim."""
    env: dict[str, int] = {}
    for name, text in dims.items():
        if name not in symbols:
            known = ", ".join(symbols.values()) or "none"
            raise CliError(f"--dim {name}={text}: the method has no symbol {name!r} (its symbols: {known})")
        try:
            env[name] = int(text)
        except ValueError:
            raise CliError(f"--dim {name}={text}: the size must be an integer") from None
    missing = [d for d in symbols if d not in env]
    if missing:
        hints = " ".join(f"--dim {d}=N" for d in missing)
        raise CliError(f"--random needs a size for each symbolic dimension: give {hints} "
                       f"({'; '.join(symbols[d] for d in missing)})")
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in specs:
        shape = resolve_shape(spec.shape, env)
        dtype = spec.dtype.numpy
        if spec.dtype.is_float:
            arr = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        elif spec.dtype.name == "bool":
            arr = rng.random(shape) < 0.5
        else:
            arr = rng.integers(0, int_high, shape).astype(dtype)
        arrays.append(arr)
    return arrays


def _timed(session: Any, method: str, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], float]:
    """One run, outputs copied to NumPy inside the timing so an asynchronous backend is measured fully."""
    t0 = time.perf_counter()
    outs = [session.backend.to_numpy(o) for o in session.run(method, *inputs)]
    return outs, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    if args.random and args.inputs:
        raise CliError("give either -i input files or --random, not both")
    if args.repeat < 0:
        raise CliError(f"--repeat must be >= 0, got {args.repeat}")
    t0 = time.perf_counter()
    program = load_program(args.model)
    load_ms = (time.perf_counter() - t0) * 1e3
    method = pick_method(program, args.method)
    info = program.info(method)
    if args.random:
        symbols = {s.name: s.describe() for s in info.symbols}
        inputs = random_inputs(info.inputs, parse_assignments(args.dim, "a symbol size", "--dim"), args.seed,
                               args.int_high, symbols)
    else:
        if args.dim:
            raise CliError("--dim sizes symbolic dimensions for --random; with -i the inputs' shapes bind them")
        inputs = load_inputs(args.inputs)
    session = program.session(args.backend, validate=args.validate)
    outputs, first = _timed(session, method, inputs)  # checks the inputs first: InputError before any output
    print(f"loaded {args.model} in {load_ms:.1f} ms; ran {method!r} on {args.backend}")
    for k, (spec, arr) in enumerate(zip(info.inputs, inputs, strict=True)):
        print(f"  in_{k} {spec.name}: {arr.dtype}{shape_text(arr.shape)}")
    times = []
    for _ in range(args.repeat):
        session.reset_state()
        times.append(_timed(session, method, inputs)[1])
    for k, (spec, arr) in enumerate(zip(info.outputs, outputs, strict=True)):
        print(f"  out_{k} {spec.name}: {arr.dtype}{shape_text(arr.shape)} {preview(arr)}")
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        for k, arr in enumerate(outputs):
            np.save(args.output_dir / f"out_{k}.npy", arr)
        if args.random:
            for k, arr in enumerate(inputs):
                np.save(args.output_dir / f"in_{k}.npy", arr)
        print(f"saved {len(outputs)} output(s) to {args.output_dir}")
    line = f"latency: first run {first * 1e3:.3f} ms"
    if times:
        line += f", median of {len(times)} more {statistics.median(times) * 1e3:.3f} ms"
    print(line)
    return 0
