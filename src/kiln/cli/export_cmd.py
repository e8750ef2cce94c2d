"""`kiln export`: call a user's factory, export the model it returns, write the .kiln file.

The only command that needs torch; it imports kiln.export (and so torch) inside `run`, never at module level.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

from kiln.cli import spec as spec_mod
from kiln.cli.common import CliError, human_bytes, parse_assignments

HELP = "export a PyTorch model (from a factory function) to a .kiln file"
DESCRIPTION = """\
Export a PyTorch model to one .kiln file. SPEC names a factory function, in a file or an importable module:

  path/to/file.py:factory   or   package.module:factory

The factory takes no arguments and returns one of
  (module, example_args)                     # example_args: a tuple of tensors for forward
  (module, example_args, dynamic_shapes)     # dynamic_shapes as torch.export takes them (torch.export.Dim)
  (module, {name: kiln.export.Method(args, dynamic_shapes=...)})   # several methods sharing state buffers

Nothing is written if an op cannot be exported: every unsupported op is listed (exit status 2)."""
EPILOG = """\
example (model.py):
  import torch
  class Net(torch.nn.Module):
      def __init__(self):
          super().__init__()
          self.fc = torch.nn.Linear(16, 4)
      def forward(self, x):
          return torch.relu(self.fc(x))
  def make():
      seq = torch.export.Dim("seq", min=1, max=512)
      return Net(), (torch.randn(2, 8, 16),), {"x": {1: seq}}

  kiln export model.py:make -o net.kiln
  kiln export mypackage.models:make_decoder -o decoder.kiln --method prefill --method decode
  kiln export model.py:make -o net-int4.kiln --quantize int4 --group-size 64
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC", help="path/to/file.py:factory or package.module:factory")
    p.add_argument("-o", "--output", required=True, type=Path, help="the .kiln file to write")
    p.add_argument("--method", action="append", metavar="NAME",
                   help="with a multi-method factory: export only these methods (repeatable); with a single-method "
                        "factory: the name of the exported method (it traces the module function of that name if "
                        "the module has one, else forward)")
    p.add_argument("--meta", action="append", metavar="KEY=VALUE",
                   help="a metadata entry to store in the file (repeatable)")
    add_quantize_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print what each graph pass rewrote and the node counts (as `kiln inspect --passes`)")
    p.set_defaults(handler=run)


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """--quantize, --group-size and --symmetric, shared with `kiln export-llm`."""
    p.add_argument("--quantize", choices=("int8", "int4", "bf16", "fp16"),
                   help="store linear and embedding weights quantized: weight-only int8 (per output channel unless "
                        "--group-size) or int4 (groups of --group-size, default 64), or as bf16/fp16")
    p.add_argument("--group-size", type=int, metavar="N",
                   help="int8/int4: quantize in groups of N consecutive weights of a row (32, 64, 128, ...)")
    p.add_argument("--symmetric", action="store_true",
                   help="int8/int4: a symmetric range per group (no zero point) instead of the default min/max "
                        "range with a zero point")


def _methods(result: Any, spec: str, chosen: list[str] | None) -> tuple[Any, dict[str, Any]]:
    """Check the factory's result; return (module, {method name: kiln.export.Method})."""
    import torch

    from kiln.export import Method

    shape = "(module, example_args[, dynamic_shapes]) or (module, {name: kiln.export.Method(...)})"
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise CliError(f"factory {spec!r} returned {type(result).__name__}; it must return {shape}")
    module, second = result[0], result[1]
    if not isinstance(module, torch.nn.Module):
        raise CliError(f"factory {spec!r}: the first element is a {type(module).__name__}, not a torch.nn.Module")
    if isinstance(second, dict):
        if len(result) == 3:
            raise CliError(f"factory {spec!r}: with a dict of methods, give each method's dynamic_shapes in its "
                           "kiln.export.Method, not as a third element")
        methods = dict(second)
        if chosen:
            unknown = [n for n in chosen if n not in methods]
            if unknown:
                raise CliError(f"--method {', '.join(unknown)}: the factory defines methods {list(methods)}")
            methods = {n: methods[n] for n in chosen}
        return module, methods
    args = (second,) if isinstance(second, torch.Tensor) else second
    if not isinstance(args, (tuple, list)):
        raise CliError(f"factory {spec!r}: example_args is a {type(second).__name__}; give a tuple of inputs")
    if chosen and len(chosen) > 1:
        raise CliError(f"--method given {len(chosen)} times, but factory {spec!r} returns example inputs for one "
                       "method; return {name: kiln.export.Method(...)} to export several")
    name = chosen[0] if chosen else "forward"
    return module, {name: Method(tuple(args), result[2] if len(result) == 3 else None)}


def quantize_option(args: argparse.Namespace):
    """The --quantize/--group-size/--asymmetric options as a kiln.export.Quantize (None: no quantization)."""
    if args.quantize is None:
        if args.group_size is not None or args.symmetric:
            raise CliError("--group-size and --symmetric go with --quantize int8 or int4")
        return None
    from kiln.export.quantize import Quantize

    try:
        return Quantize(args.quantize, args.group_size, args.symmetric)
    except ValueError as e:
        raise CliError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    metadata = parse_assignments(args.meta, "metadata", "--meta")
    quantize = quantize_option(args)
    print(f"loading {args.spec}", flush=True)
    factory, directory = spec_mod.resolve(args.spec)
    import kiln.export  # torch: only this command pays for it

    # torch.export's own deprecation noise (raised inside torch, nothing a user can change)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)

    with spec_mod.importable_from(directory):
        result = factory()
        module, methods = _methods(result, args.spec, args.method)
        print(f"capturing and lowering {', '.join(methods)} ({type(module).__name__})")
        builder = kiln.export.export(module, methods=methods, metadata=metadata, quantize=quantize,
                                     progress=lambda message: print(f"  {message}", flush=True))
    write_program(builder, args.output, args.verbose, start)
    return 0


def write_program(builder: Any, output: Path, verbose: bool, start: float) -> None:
    """Save the exported program, then say what was written (and, verbose, what the passes did) and how long
    the whole export took since `start` (a perf_counter reading)."""
    print(f"writing {output}", flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    builder.save(output)
    print_summary(output)
    if verbose:
        print_pass_stats(builder)
    print(f"done in {time.perf_counter() - start:.1f} s")


def print_pass_stats(builder: Any) -> None:
    """What each graph pass rewrote (`-v`), as `kiln inspect --passes` shows it."""
    from kiln.cli.inspect_cmd import render_passes
    from kiln.ir.graph import PASS_STATS_KEY

    print(render_passes(json.loads(builder.metadata[PASS_STATS_KEY])))


def print_summary(path: Path) -> None:
    """Summarize the file as written (loaded back with the runtime, which also validates it)."""
    from kiln.cli.inspect_cmd import describe
    from kiln.runtime import load

    info = describe(load(path))
    c = info["constants"]
    print(f"wrote {path} ({human_bytes(info['file_bytes'])})")
    methods = [f"{m['name']} ({m['nodes']} node{'' if m['nodes'] == 1 else 's'})" for m in info["methods"]]
    print(f"  methods: {', '.join(methods)}")
    print(f"  nodes: {sum(m['nodes'] for m in info['methods'])}")
    print(f"  constants: {c['count']}, {c['blob_bytes'] / 1e6:.2f} MB in {c['blobs']} blob(s)")
    states = info["states"]
    print(f"  state buffers: {len(states)}" + (f" ({', '.join(s['name'] for s in states)})" if states else ""))
