"""`kiln bench`: time one method of a .kiln file (warm-up, repeats, median/min/max, peak memory). Torch-free."""

from __future__ import annotations

import argparse
import sys

from kiln.cli.common import CliError, add_program_arguments, load_program, parse_assignments, shape_text
from kiln.cli.run_cmd import load_inputs, pick_method, random_inputs
from kiln.runtime.bench import Contestant, format_bytes, format_ms, measure_memory, run_interleaved

HELP = "time a method of a .kiln file: median, min, max latency and peak memory"
DESCRIPTION = """\
Time one method of a .kiln file with the torch-free runtime. Inputs come from .npy files (-i, in the method's input
order) or, when none are given, from a seeded generator following the input specs (floats standard normal,
integers in [0, --int-high), booleans fair coins); symbolic dimensions then need a size: --dim seq=16.

Runs --warmup untimed runs (the first builds the execution plan), then --repeat timed ones; state buffers are reset
before each run, outside the timing. Reports the median, min, max and mean latency, the peak memory that NumPy
allocated during one run (tracemalloc) and how much one run raised the process's peak resident set. --profile N
then prints the N ops that take the most time (a separate, slower run with every kernel timed)."""
EPILOG = """\
examples:
  kiln bench model.kiln
  kiln bench minilm.kiln --dim batch=1 --dim seq=16 --repeat 50
  kiln bench llm.kiln --method decode -i token.npy -i pos.npy --profile 10
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_program_arguments(p, "time")
    p.add_argument("--dim", action="append", metavar="SYMBOL=N", help="size of a symbolic dimension for random inputs")
    p.add_argument("--seed", type=int, default=0, help="seed for random inputs (default: 0)")
    p.add_argument("--int-high", type=int, default=10, metavar="N",
                   help="random integers are drawn from [0, N) (default: 10), valid indices for small tables")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed runs first (default: 3)")
    p.add_argument("--repeat", type=int, default=20, metavar="N", help="timed runs (default: 20)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument("--no-graphs", action="store_true",
                   help="run op by op on a backend that otherwise replays each method as a captured graph (cuda; "
                        "KILN_CUDA_GRAPHS=0 does the same for every command) or compiles it (mlx; KILN_MLX_COMPILE=0)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the N ops with the most time (per-op timing in separate runs)")
    p.set_defaults(handler=run)


def _progress(line: str) -> None:
    print(f"  ... {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.warmup < 0:
        raise CliError(f"--warmup must be >= 0, got {args.warmup}")
    if args.repeat < 1:
        raise CliError(f"--repeat must be >= 1, got {args.repeat}")
    if args.profile < 0:
        raise CliError(f"--profile must be >= 0, got {args.profile}")
    program = load_program(args.model)
    method = pick_method(program, args.method)
    info = program.info(method)
    if args.inputs:
        if args.dim:
            raise CliError("--dim sizes symbolic dimensions of random inputs; with -i the inputs' shapes bind them")
        inputs = load_inputs(args.inputs)
    else:
        symbols = {s.name: s.describe() for s in info.symbols}
        inputs = random_inputs(info.inputs, parse_assignments(args.dim, "a symbol size", "--dim"), args.seed,
                               args.int_high, symbols)
    session = program.session(args.backend, graphs=False if args.no_graphs else None)
    backend = session.backend

    def once() -> None:
        for out in session.run(method, *inputs):
            backend.to_numpy(out)  # an asynchronous backend is timed until its results are on the host

    session.reset_state()
    once()  # checks the inputs: an InputError comes before any timing
    print(f"benchmarking {args.model} method {method!r} on {args.backend} ({info.num_nodes} nodes)")
    for k, (spec, arr) in enumerate(zip(info.inputs, inputs, strict=True)):
        print(f"  in_{k} {spec.name}: {arr.dtype}{shape_text(arr.shape)}")
    contestant = Contestant(method, once, setup=session.reset_state)
    stats = run_interleaved([contestant], warmup=args.warmup, repeat=args.repeat, progress=_progress)
    if not args.no_memory:
        measure_memory([contestant], stats)
    s = stats[method]
    print(f"runs: {args.warmup} warm-up, {args.repeat} timed")
    print(f"latency ms: median {format_ms(s.median)}  min {format_ms(s.min)}  max {format_ms(s.max)}  "
          f"mean {format_ms(s.mean)}")
    if not args.no_memory:
        print(f"peak memory: {format_bytes(s.traced_peak)} allocated during one run (tracemalloc), "
              f"peak RSS +{format_bytes(s.rss_peak)}")
    if args.profile:
        from kiln.runtime.profile import OpProfiler

        profiler = OpProfiler().attach(session)
        runs = max(3, min(args.repeat, 10))
        for _ in range(runs):
            session.reset_state()
            once()
        print(f"\nops by time ({runs} profiled runs; kernel time {profiler.total / runs * 1e3:.3f} ms/run):")
        print(profiler.table(top=args.profile, runs=runs))
    return 0
