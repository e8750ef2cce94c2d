"""Load test of `kiln serve` for a language model: aggregate output tokens/s, time to first token and inter-token
latency (p50/p99) at several concurrency levels, and the single-stream decode speed of the same program without a
server (what `kiln generate` gets), as the reference for concurrency 1.

    .venv/bin/python benchmarks/serve_load.py PROGRAM.kiln [--backend cpu] [--concurrency 1,4]
        [--requests 8] [--prompt-lengths 32,96] [--output-lengths 48,96] [--seed 0]

The server runs in its own process (`kiln serve`, as users run it); the load generator is asyncio with the
official openai client (AsyncOpenAI), closed loop: C workers each send a request, read its stream to the end,
and send the next, until the level's --requests requests are done. Every request is a completion of random token
ids with `ignore_eos`, so prompt and output lengths are exactly the fixed mix (cycled: prompt lengths x output
lengths), the same at every level. Time to first token: from sending the request to the first content chunk.
Inter-token latency: the gaps between a stream's chunks (one token each, but for text held back inside a
multi-byte character). Output tokens/s: all completion tokens of the level (from `usage`) over its wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("program", type=Path, help="a language-model .kiln file (export with --slots N to batch)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--concurrency", default="1,4", help="comma-separated concurrency levels (default: 1,4)")
    p.add_argument("--requests", type=int, default=8, help="requests per level (default: 8)")
    p.add_argument("--prompt-lengths", default="32,96", help="prompt lengths of the mix (default: 32,96)")
    p.add_argument("--output-lengths", default="48,96", help="output lengths of the mix (default: 48,96)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@dataclass
class Level:
    concurrency: int
    wall: float = 0.0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one_request(client, model: str, prompt: list[int], max_tokens: int, level: Level) -> None:
    import openai

    start = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                level.output_tokens += chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                now = time.perf_counter()
                if last is None:
                    level.ttft.append(now - start)
                else:
                    level.itl.append(now - last)
                last = now
    except openai.APIError as e:
        print(f"request failed: {e}", file=sys.stderr)
        level.errors += 1


async def run_level(port: int, model: str, concurrency: int, work: list[tuple[list[int], int]]) -> Level:
    import openai

    level = Level(concurrency)
    queue = list(work)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                timeout=600)

    async def worker() -> None:
        while queue:
            prompt, max_tokens = queue.pop(0)
            await one_request(client, model, prompt, max_tokens, level)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    level.wall = time.perf_counter() - start
    await client.close()
    return level


def single_stream_decode(program: Path, backend: str, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s of one sequence through Generator (what `kiln generate` runs), no server."""
    from kiln.runtime.llm import Generator

    generator = Generator(program, backend)
    generator.generate(prompt, 8, stop_token_ids=[])  # warm-up (plans, graphs)
    result = generator.generate(prompt, tokens, stop_token_ids=[])
    return result.stats.decode_tokens_per_second


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompt_lengths = [int(n) for n in args.prompt_lengths.split(",")]
    output_lengths = [int(n) for n in args.output_lengths.split(",")]
    sys.path.insert(0, str(REPO / "src"))
    import kiln
    from kiln.runtime.llm.info import LLMInfo

    program = kiln.load(args.program)
    info = LLMInfo.from_metadata(program.metadata)
    vocab = info.vocab_size or 1000
    rng = np.random.default_rng(args.seed)
    mix = list(itertools.islice(itertools.cycle(itertools.product(prompt_lengths, output_lengths)), args.requests))
    work = [(rng.integers(0, vocab, n).tolist(), m) for n, m in mix]
    print(f"single-stream decode (Generator, {args.backend}) ...", file=sys.stderr, flush=True)
    reference = single_stream_decode(args.program, args.backend, work[0][0], max(output_lengths))
    del program

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    server = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(args.program), "--port", str(port),
                               "--backend", args.backend, "--model-name", "bench", "--log-level", "warning",
                               "--max-queue", str(max(levels) + args.requests)], cwd=REPO, env=env)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit("the server exited") from None
                time.sleep(0.2)
        asyncio.run(run_level(port, "bench", 1, work[:1]))  # warm-up
        results = []
        for c in levels:
            print(f"concurrency {c}: {args.requests} requests ...", file=sys.stderr, flush=True)
            results.append(asyncio.run(run_level(port, "bench", c, work)))
    finally:
        server.terminate()
        server.wait(60)

    print(f"\nProgram {args.program.name}: slots {info.slots or 1}, context {info.max_context}, backend "
          f"{args.backend}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"Mix: {args.requests} requests per level, prompt lengths {prompt_lengths} x output lengths "
          f"{output_lengths}, greedy, ignore_eos. Single-stream decode without a server (Generator): "
          f"{reference:.1f} tokens/s.\n")
    print("| concurrency | output tokens/s | x concurrency 1 | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = results[0].output_tokens / results[0].wall
    for r in results:
        rate = r.output_tokens / r.wall
        print(f"| {r.concurrency} | {rate:.1f} | {rate / base:.2f} | {percentile(r.ttft, 50) * 1e3:.0f} / "
              f"{percentile(r.ttft, 99) * 1e3:.0f} | {percentile(r.itl, 50) * 1e3:.1f} / "
              f"{percentile(r.itl, 99) * 1e3:.1f} | {r.errors} |")
    first = results[0]
    per_stream = 1 / statistics.median(first.itl) if first.itl else float("nan")
    print(f"\nconcurrency {first.concurrency}: {per_stream:.1f} tokens/s per stream (1 / median inter-token gap), "
          f"{per_stream / reference:.2f}x the single-stream decode without a server ({reference:.1f})")
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
