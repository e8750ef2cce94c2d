"""CPU decode of an LLM exported with and without the fused quantized linears (op set 9), interleaved.

    .venv/bin/python benchmarks/cpu_quant_fusion.py MODEL.gguf [--threads 1] [--rounds 15] [--steps 20]

The same model (a GGUF file or a transformers folder, as `kiln export-llm` takes it) exported twice: as the export
makes it (a layer's add + RMSNorm and gated activation inside add_rms_norm_quantized_linear nodes) and without the
fuse_gated_linear / fuse_norm_linear passes (the three nodes apart). Prints each program's node counts, whether
the two give the same logits, whether the native executor lowered each decode plan whole, and the median time of
a decode step at context 128, the two programs' sessions taking turns.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness import configure_threads  # noqa: E402

UNFUSED = ("fuse_gated_linear", "fuse_norm_linear")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file or a transformers folder")
    parser.add_argument("--threads", type=int, default=1, help="compute threads (default 1)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per round (default 20)")
    args = parser.parse_args(argv)
    configure_threads(args.threads)

    import numpy as np

    from kiln.models.llm import export_llm

    programs = {name: export_llm(args.model, max_context=256, prefill_chunk=64, skip_passes=skip).load()
                for name, skip in (("fused", ()), ("unfused", UNFUSED))}
    token, position = np.array([[42]], np.int64), np.array([128], np.int64)
    sessions = {name: program.session("cpu") for name, program in programs.items()}
    logits = {name: [s.run("decode", token, position)[0] for _ in range(3)][-1] for name, s in sessions.items()}
    for name, program in programs.items():
        counts = Counter(n.op for n in program.method("decode").nodes)
        lowered = all(plan.lowered is not None for plan in sessions[name]._plans["decode"].values())
        print(f"{name}: {dict(sorted(counts.items(), key=lambda kv: -kv[1])[:6])}, lowered whole: {lowered}")
    print("same logits:", bool(np.array_equal(logits["fused"], logits["unfused"])))
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(args.rounds):
        for name, session in sessions.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                session.run("decode", token, position)
            times[name].append((time.perf_counter() - t0) / args.steps)
    for name, samples in times.items():
        print(f"{name}: decode at 128, median {np.median(samples) * 1e3:.3f} ms a step ({args.threads} thread(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
