"""The host Sampler's time per token on one row of a large vocabulary, for each filter setting: what a sampled
(non-greedy) sequence costs `kiln generate` and the serving engine per step beside the model.

    .venv/bin/python benchmarks/sampler_cpu.py [--vocab 128256] [--calls 30] [--dtype bfloat16]

Logits are N(0, 3) in the given type (a peaked distribution, as an LLM's); median of 5 runs of --calls calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SETTINGS = [dict(temperature=0.7), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=50),
            dict(temperature=1.0, top_k=50, top_p=0.9), dict(temperature=1.0, top_p=0.5)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=128256, help="logits per row (default: Llama 3's 128256)")
    parser.add_argument("--calls", type=int, default=30, help="calls per timed run (default 30)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    from kiln.runtime.backends.array_api import BFLOAT16
    from kiln.runtime.llm.sampling import Sampler

    dtype = BFLOAT16 if args.dtype == "bfloat16" else np.dtype(args.dtype)
    row = (np.random.default_rng(0).standard_normal(args.vocab) * 3).astype(dtype)
    print(f"| settings | ms a token ({args.vocab} {args.dtype} logits) |\n|---|---:|")
    for settings in SETTINGS:
        sampler = Sampler(seed=1, **settings)
        sampler(row)
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.calls):
                sampler(row)
            runs.append((time.perf_counter() - start) / args.calls * 1e3)
        print(f"| {', '.join(f'{k} {v}' for k, v in settings.items())} | {statistics.median(runs):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
