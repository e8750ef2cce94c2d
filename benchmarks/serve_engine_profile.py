"""Where a serving engine's wall time goes: prefill chunks, batched decode steps (host launch, GPU wait, sampling),
the per-token work of emitting (detokenizing, stop strings, callbacks) and the loop's own, at each concurrency
level of serve_load.py's closed loop on an in-process LLMEngine (no HTTP).

    PYTHONPATH=src python3 benchmarks/serve_engine_profile.py PROGRAM.kiln --backend cuda [--concurrency 8,64]

Each phase is timed with the device synchronized before and after it, so a phase's time is its own GPU work plus
its host work; the synchronizations remove the overlap a real run has, so the levels' tokens/s here are a little
below serve_load.py's. What it is for: which phase to make cheaper, and by how much at most.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def synchronizer(backend: str):
    """A function that waits for the backend's queued work."""
    if backend == "cuda":
        import cupy as cp

        return cp.cuda.Device().synchronize
    if backend == "mlx":
        import mlx.core as mx

        return mx.synchronize
    return lambda: None


PHASES = ("_prefill_chunk", "_run_rows", "_sample", "_accept")


def instrument(engine, sync) -> tuple[dict[str, float], dict[str, int]]:
    """Wrap the engine's phases with timers (seconds and counts by phase name): a prefill-method chunk, a decode
    call over its rows (launch, GPU, padding), sampling the rows (the logits' trip to the host included), and
    accepting each token (detokenizing, stop strings, the emit callback)."""
    from kiln.runtime.serve.engine import padded_rows

    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    originals = {name: getattr(engine, name) for name in PHASES}

    def timed(name, fn, synchronized=True):
        def call(*args, **kwargs):
            if synchronized:
                sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if synchronized:
                sync()
            seconds[name] += time.perf_counter() - start
            counts[name] += 1
            return result
        return call

    def run_rows(rows, most):
        counts["rows"] += len(rows)
        counts["padded rows"] += padded_rows(len(rows), most) if engine._pad_batches else len(rows)
        return timed("_run_rows", originals["_run_rows"])(rows, most)

    engine._prefill_chunk = timed("_prefill_chunk", originals["_prefill_chunk"])
    engine._run_rows = run_rows
    engine._sample = timed("_sample", originals["_sample"])
    engine._accept = timed("_accept", originals["_accept"], synchronized=False)
    return seconds, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", type=Path)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--concurrency", default="8,64")
    parser.add_argument("--rounds", type=int, default=2, help="requests per worker (default 2)")
    parser.add_argument("--prompt-lengths", default="128,512")
    parser.add_argument("--output-lengths", default="128,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-in-steps", choices=("auto", "on", "off"), default="auto",
                        help="prompts as rows of the decode steps, or by the prefill method (default: the engine's)")
    parser.add_argument("--prefill-tokens", type=int, help="prompt tokens a step carries (default: the engine's)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))

    from serve_load import engine_level

    import kiln
    from kiln.runtime.llm.info import LLMInfo
    from kiln.runtime.serve.engine import LLMEngine

    program = kiln.load(args.program)
    info = LLMInfo.from_metadata(program.metadata)
    rng = np.random.default_rng(args.seed)
    pairs = itertools.cycle(itertools.product([int(n) for n in args.prompt_lengths.split(",")],
                                              [int(n) for n in args.output_lengths.split(",")]))
    levels = [int(c) for c in args.concurrency.split(",")]
    in_steps = {"auto": None, "on": True, "off": False}[args.prefill_in_steps]
    engine = LLMEngine(program, args.backend, max_queue=max(levels) * args.rounds, prefill_tokens=args.prefill_tokens,
                       prefill_in_steps=in_steps).warm_up().start()
    sync = synchronizer(args.backend)
    rows = []
    try:
        for c in levels:
            work = [(rng.integers(0, info.vocab_size or 1000, n).tolist(), m)
                    for n, m in itertools.islice(pairs, c * args.rounds)]
            engine_level(engine, c, [(p, 4) for p, _ in work[:c]])  # warm-up: plans and graphs
            seconds, counts = instrument(engine, sync)
            level = engine_level(engine, c, work)
            for name in PHASES:
                delattr(engine, name)  # back to the class's methods
            rows.append((c, level, dict(seconds), dict(counts)))
    finally:
        engine.shutdown()

    mode = f"prompts in decode steps ({engine.prefill_tokens} tokens a step)" if engine.prefill_in_steps else \
        "prompts by the prefill method"
    print(f"\nProgram {args.program.name}, backend {args.backend}, slots {info.slots}, prefill chunk "
          f"{info.prefill_chunk}, {mode}; prompts {args.prompt_lengths} x outputs {args.output_lengths}, "
          f"{args.rounds} requests per worker, every phase synchronized\n")
    print("| concurrency | tok/s | prefill-method chunks: n, ms each, share | decode calls: n, ms each, rows "
          "(padded), share | sampling ms each, share | accept+emit us/token, share | rest share |")
    print("|---:|---:|---|---|---|---|---:|")
    for c, level, seconds, counts in rows:
        wall = level.wall
        def phase(name: str, unit: float = 1e3, digits: int = 2, seconds=seconds, counts=counts, wall=wall) -> str:
            each = unit * seconds.get(name, 0.0) / max(1, counts.get(name, 0))
            return f"{each:.{digits}f}, {100 * seconds.get(name, 0.0) / wall:.0f}%"

        calls = max(1, counts.get("_run_rows", 0))
        rest = wall - sum(seconds.get(name, 0.0) for name in PHASES)
        print(f"| {c} | {level.output_tokens / wall:,.0f} | {counts.get('_prefill_chunk', 0)}, "
              f"{phase('_prefill_chunk')} | {counts.get('_run_rows', 0)}, "
              f"{1e3 * seconds.get('_run_rows', 0.0) / calls:.2f}, {counts.get('rows', 0) / calls:.1f} "
              f"({counts.get('padded rows', 0) / calls:.1f}), {100 * seconds.get('_run_rows', 0.0) / wall:.0f}% | "
              f"{phase('_sample')} | {phase('_accept', 1e6, 1)} | {100 * rest / wall:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
