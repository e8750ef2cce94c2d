"""The long .kiln fuzzing campaign: mutants of every seed program (mutator.py) until a count or a time limit,
each judged (refused with ProgramFormatError, or loaded and run); escapes are saved for replay.

    python -m tests.format.fuzz_campaign --mutants 100000 --out /tmp/kiln-escapes

Prints the outcome counts per seed and exits 1 if anything escaped. A replay of one saved mutant:
`python -c "import kiln; kiln.load(open('FILE', 'rb').read())"`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

from tests.format.fuzz_seeds import seeds
from tests.format.mutator import Escape, judge, mutant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mutants", type=int, default=100_000, help="mutants in all, shared by the seeds "
                        "(default: 100000)")
    parser.add_argument("--minutes", type=float, default=0, help="stop after this long (default: no limit)")
    parser.add_argument("--seed", default="campaign", help="random seed text (default: campaign)")
    parser.add_argument("--out", type=Path, default=Path("fuzz-escapes"), help="folder for escaping mutants")
    args = parser.parse_args(argv)
    programs = seeds()
    rng = random.Random(args.seed)
    counts: dict[str, Counter] = {s.name: Counter() for s in programs}
    start, escapes = time.monotonic(), 0
    for i in range(args.mutants):
        if args.minutes and time.monotonic() - start > 60 * args.minutes:
            break
        seed = programs[i % len(programs)]
        raw = mutant(seed, rng)
        if raw is None:
            counts[seed.name]["unencodable"] += 1
            continue
        try:
            counts[seed.name][judge(raw)] += 1
        except Escape as e:
            counts[seed.name]["ESCAPE"] += 1
            escapes += 1
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"{seed.name}-{i}.kiln"
            path.write_bytes(raw)
            print(f"escape {path}: {e}", file=sys.stderr, flush=True)
        if (i + 1) % 5000 == 0:
            print(f"{i + 1} mutants, {time.monotonic() - start:.0f} s, {escapes} escapes", flush=True)
    total = sum(sum(c.values()) for c in counts.values())
    print(f"{total} mutants in {time.monotonic() - start:.0f} s, {escapes} escapes")
    for name, c in counts.items():
        print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    return 1 if escapes else 0


if __name__ == "__main__":
    sys.exit(main())
