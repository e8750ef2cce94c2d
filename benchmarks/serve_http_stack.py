"""The HTTP side of `kiln serve` under streaming load: the server process's CPU per streamed token with each
uvicorn stack (`kiln serve --http ... --loop ...`), servers started in turn, rounds interleaved, medians.

    .venv/bin/python benchmarks/serve_http_stack.py [PROGRAM.kiln] [--rounds 3] [--concurrency 64]
        [--requests 128] [--prompt-length 16] [--output-length 256]

Without PROGRAM, a one-layer random-weight Llama (d 64, vocabulary 8192, 64 slots, float32; needs torch and
transformers to export) is written to .cache/bench/serve-tiny.kiln: a model so cheap that the host's work per token
shows. The HTTP process's microseconds of CPU per output token say where one core's ceiling is (1e6 / us tokens/s),
whatever device runs the engine; the engine's own process is charged separately.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from serve_load import export_llama_shape, free_port, run_level, start_server  # noqa: E402

STACKS = {"h11 + asyncio": ("h11", "asyncio"), "httptools + asyncio": ("httptools", "asyncio"),
          "httptools + uvloop": ("httptools", "uvloop")}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=8192, tie_word_embeddings=True, max_position_embeddings=2048)


def tiny_program(path: Path) -> Path:
    """The default program: exported once, kept for later runs."""
    if not path.exists():
        import cpu_compare

        cpu_compare.LLAMA_SIZES.setdefault("serve-tiny", TINY)
        path.parent.mkdir(parents=True, exist_ok=True)
        export_llama_shape(path, "serve-tiny", "float32", 64, 1024, 256)
    return path


def one_run(program: Path, http: str, loop: str, work: list, concurrency: int) -> tuple[float, float, float, float]:
    """(tokens/s, HTTP us/token, engine us/token, ITL p50 ms) of one server with this stack, after a warm-up."""
    port = free_port()
    server = start_server(program, port, ["--max-queue", str(len(work)), "--http", http, "--loop", loop],
                          seconds=120, stdout=subprocess.DEVNULL)
    try:
        asyncio.run(run_level(port, "bench", concurrency, [(p, 4) for p, _ in work[:concurrency]], True))
        level = asyncio.run(run_level(port, "bench", concurrency, work, True, cpu=True))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    per_token = {name: cpu / max(level.output_tokens, 1) * 1e6 for name, cpu in level.server_cpu.items()}
    return (level.output_tokens / level.wall, per_token.get("http", float("nan")),
            per_token.get("engine", float("nan")), statistics.median(level.itl) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", type=Path, nargs="?", help="a language-model .kiln with slots (default: the "
                        "tiny program, exported on first use)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each stack, interleaved (default 3)")
    parser.add_argument("--concurrency", type=int, default=64, help="streams at once (default 64)")
    parser.add_argument("--requests", type=int, default=128, help="requests a run (default 128)")
    parser.add_argument("--prompt-length", type=int, default=16, help="prompt tokens (default 16)")
    parser.add_argument("--output-length", type=int, default=256, help="output tokens (default 256)")
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated, of: " + ", ".join(STACKS))
    args = parser.parse_args(argv)
    stacks = [s.strip() for s in args.stacks.split(",")]
    if unknown := [s for s in stacks if s not in STACKS]:
        parser.error(f"unknown stacks {unknown}; known: {', '.join(STACKS)}")
    program = args.program or tiny_program(REPO / ".cache" / "bench" / "serve-tiny.kiln")
    rng = np.random.default_rng(0)
    work = [(rng.integers(0, 8192, args.prompt_length).tolist(), args.output_length) for _ in range(args.requests)]
    runs: dict[str, list] = {s: [] for s in stacks}
    for r in range(args.rounds):
        for stack in stacks:
            print(f"round {r + 1}/{args.rounds}: {stack} ...", file=sys.stderr, flush=True)
            runs[stack].append(one_run(program, *STACKS[stack], work, args.concurrency))
    print(f"\n{program.name}, {args.concurrency} streams, {args.requests} requests of {args.prompt_length} + "
          f"{args.output_length} tokens, {os.cpu_count()} cores; medians of {args.rounds} interleaved runs\n")
    print("| uvicorn stack | HTTP process us/token | engine process us/token | tokens/s | ITL p50 ms |")
    print("|---|---:|---:|---:|---:|")
    for stack, values in runs.items():
        rate, http, engine, itl = (statistics.median(v[i] for v in values) for i in range(4))
        print(f"| {stack} | {http:.1f} | {engine:.1f} | {rate:,.0f} | {itl:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
