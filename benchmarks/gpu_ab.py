"""A/B of kiln source trees on one GPU: a benchmark run once per tree and round, the trees alternating (A, B, A,
B), kiln's times compared case by case against the first tree's.

    mkdir -p .ab/main && git archive main src | tar -x -C .ab/main   # a variant: a directory holding src/
    PYTHONPATH=src python3 benchmarks/gpu_ab.py main=.ab/main/src new=src --rounds 2 -- --prefill 128

A change to a kernel source or to the runtime cannot be switched inside one process (modules and compiled kernels
live as long as it does), so its A/B alternates processes, and the alternation spreads the drift of a lease over
every variant. Each process is `--script` (default gpu_llm.py) with the options after `--`, `--no-compile` (only
kiln's time is compared) and `--json`; its own progress and table go to stderr. The table (stdout) gives each
variant's time per run, the median over its runs and that median against the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_harness import print_table  # noqa: E402
from harness import stderr_log  # noqa: E402

CONTESTANT = "kiln cuda"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, forwarded = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s NAME=SRC NAME=SRC [...] [options] [-- benchmark options]")
    parser.add_argument("variants", nargs="+", metavar="NAME=SRC",
                        help="a name and a directory holding the kiln package (a checkout's src/); the first is "
                             "the reference")
    parser.add_argument("--rounds", type=int, default=2, help="runs per variant, alternating (default 2)")
    parser.add_argument("--script", type=Path, default=Path(__file__).resolve().parent / "gpu_llm.py",
                        help="the benchmark each run starts; it must take --no-compile and --json (default "
                             "gpu_llm.py)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(own)
    try:
        variants = parse_variants(args.variants)
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    runs: dict[str, list[dict]] = {name: [] for name in variants}
    total, done, t0 = args.rounds * len(variants), 0, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, src in variants.items():
                done += 1
                stderr_log(f"run {done}/{total}: {name} (round {round_ + 1}), {time.perf_counter() - t0:.0f} s in")
                out = Path(tmp) / f"{name}-{round_}.json"
                command = [sys.executable, str(args.script), *forwarded, "--no-compile", "--json", str(out)]
                path = [str(src), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
                result = subprocess.run(command, env=env, stdout=sys.stderr)
                if result.returncode:
                    stderr_log(f"{name}: {args.script.name} exited with {result.returncode}")
                    return result.returncode
                runs[name].append(json.loads(out.read_text()))
    header, body = ab_table(runs)
    print(f"{args.script.name} {' '.join(forwarded)}: {CONTESTANT} ms per run (in the order run), median, "
          f"median against {next(iter(variants))}'s")
    print_table(body, header, args.markdown)
    return 0


def parse_variants(specs: list[str]) -> dict[str, Path]:
    """{name: source directory} from NAME=SRC arguments; each directory must hold a kiln package."""
    variants: dict[str, Path] = {}
    for spec in specs:
        name, sep, src = spec.partition("=")
        if not (sep and name and src):
            raise ValueError(f"{spec!r}: a variant is NAME=SRC, e.g. main=.ab/main/src")
        if name in variants:
            raise ValueError(f"variant {name!r} given twice")
        if not (Path(src) / "kiln" / "__init__.py").is_file():
            raise ValueError(f"{name}: {src} holds no kiln package (expected {src}/kiln/__init__.py)")
        variants[name] = Path(src).resolve()
    if len(variants) < 2:
        raise ValueError("give at least two variants: the reference first, then what it is compared with")
    return variants


def ab_table(runs: dict[str, list[dict]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per case, each variant's runs and median (ms), from the second variant on its median over
    the reference's, and each median's share of the roofline (as the reference's first run measured it)."""
    names = list(runs)
    reference = names[0]
    cases = list(runs[reference][0])
    header = ["case"] + [f"{n} ms" for n in names] + [f"{n}/{reference}" for n in names[1:]] + [
        f"{n} % roofline" for n in names]
    body = []
    for case in cases:
        medians = {n: statistics.median(r[case]["medians"][CONTESTANT] for r in runs[n]) for n in names}
        cells = [case]
        for n in names:
            each = ", ".join(f"{r[case]['medians'][CONTESTANT] * 1e3:.3f}" for r in runs[n])
            cells.append(f"{each} ({medians[n] * 1e3:.3f})" if len(runs[n]) > 1 else each)
        cells += [f"{medians[n] / medians[reference]:.3f}" for n in names[1:]]
        roofline = runs[reference][0][case]["roofline"]
        cells += [f"{100 * roofline / medians[n]:.0f}%" if roofline else "-" for n in names]
        body.append(cells)
    return header, body


if __name__ == "__main__":
    raise SystemExit(main())
