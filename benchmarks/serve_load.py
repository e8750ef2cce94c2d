"""Load test of `kiln serve` for a language model: aggregate output tokens/s, time to first token and inter-token
latency (p50/p99) at several concurrency levels, and the single-stream decode speed of the same program without a
server (what `kiln generate` gets), as the reference for concurrency 1.

    .venv/bin/python benchmarks/serve_load.py PROGRAM.kiln [--backend cpu] [--concurrency 1,4]
        [--requests 8] [--passes 1] [--prompt-lengths 32,96] [--output-lengths 48,96] [--seed 0]

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
import json
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
TEMPERATURE = [0.0]
"""The requests' temperature (--temperature; 0: greedy), one list so that main sets it for every level."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("program", type=Path, help="a language-model .kiln file (export with --slots N to batch)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--concurrency", default="1,4", help="comma-separated concurrency levels (default: 1,4)")
    p.add_argument("--requests", type=int, default=8, help="requests per level, at least (default: 8)")
    p.add_argument("--rounds", type=int, default=1,
                   help="at least this many requests per worker at each level (default: 1)")
    p.add_argument("--passes", type=int, default=1,
                   help="run the levels this many times in turn on the one server (1, 4, 1, 4, ...) and report "
                        "each pass against its own first level, then the medians: on a machine whose speed drifts, "
                        "a ratio between levels measured minutes apart moves with the drift (default: 1)")
    p.add_argument("--prompt-lengths", default="32,96", help="prompt lengths of the mix (default: 32,96)")
    p.add_argument("--output-lengths", default="48,96", help="output lengths of the mix (default: 48,96)")
    p.add_argument("--client", choices=("openai", "raw"), default="openai",
                   help="the official AsyncOpenAI client, or a bare asyncio HTTP client that parses only what is "
                        "measured (for rates one Python client process cannot parse with openai)")
    p.add_argument("--engine", action="store_true",
                   help="also run each level on an LLMEngine in this process, without HTTP")
    p.add_argument("--export-llama", metavar="SHAPE",
                   help="when PROGRAM does not exist, export a random-weight Llama of this shape there "
                        "(cpu_compare.LLAMA_SIZES; word-level tokenizer of its vocabulary; needs torch)")
    p.add_argument("--dtype", default="bfloat16", help="--export-llama: weight type (default: bfloat16)")
    p.add_argument("--slots", type=int, default=64, help="--export-llama: KV-cache slots (default: 64)")
    p.add_argument("--max-context", type=int, default=1024, help="--export-llama: context (default: 1024)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="--export-llama: prefill chunk (default: 256)")
    p.add_argument("--quantize", metavar="SPEC", help="--export-llama: weight-only quantization, MODE[-gGROUP][-sym] "
                   "(int4-g32-sym is Q4_0's layout; default: none)")
    p.add_argument("--engine-in", choices=("process", "thread"), default="process",
                   help="the server's engine in a process of its own (default, as `kiln serve`) or on a thread")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's engine with (--overlap) or without (--no-overlap) overlapped steps (default: "
                        "kiln serve's, on a GPU); with --engine, the engine alone the same way, or with --overlap "
                        "both without and with them, levels interleaved")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (default 0: greedy); above 0 each request samples, seeded")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def export_llama_shape(path: Path, shape: str, dtype: str, slots: int, max_context: int, chunk: int,
                       quantize: str | None = None) -> None:
    """A random-weight Llama of `shape` (seed 0) exported with slots, a word-level tokenizer ("w0", "w1", ...) of
    its whole vocabulary in the program so that every token id streams as text; weights quantized by `quantize`
    (harness.quantize_spec) where given."""
    import torch
    from cpu_compare import LLAMA_SIZES
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models.llm import export_llama
    from kiln.runtime.llm import info

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_SIZES[shape], attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    metadata = {info.VOCAB_SIZE_KEY: str(config.vocab_size), info.STOP_TOKENS_KEY: "[]", info.NAME_KEY: shape,
                info.TOKENIZER_KEY: tokenizer.to_str()}
    from harness import quantize_spec

    start = time.perf_counter()
    options = {"quantize": quantize_spec(quantize)} if quantize else {}
    export_llama(model, max_context, chunk, slots=slots, metadata=metadata, **options).save(path)
    print(f"exported {shape} ({dtype}{', ' + quantize if quantize else ''}, {slots} slots, context {max_context}) to "
          f"{path} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


@dataclass
class Level:
    concurrency: int
    wall: float = 0.0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0
    client_cpu: float = 0.0
    server_cpu: dict[str, float] = field(default_factory=dict)
    """(server) CPU seconds of each of the server's processes over the level, from its /metrics: "http", and
    "engine" where the engine runs in a process of its own (as of its last message)"""
    decode_seconds: float = 0.0
    """(engine alone) the time of the level's batched decode steps, sampling included"""
    overlap: bool = False
    """(engine alone) whether the engine overlapped its steps"""

    def arrived(self, start: float, last: float | None) -> float:
        """A content chunk of a stream sent at `start` whose previous chunk came at `last`: its TTFT or ITL."""
        now = time.perf_counter()
        (self.ttft if last is None else self.itl).append(now - (start if last is None else last))
        return now


def start_server(program: Path, port: int, options: list[str], seconds: float = 360, **popen) -> subprocess.Popen:
    """`kiln serve PROGRAM` (model name "bench", warnings only) with `options`, in its own process, once its
    /health answers; SystemExit if it exits first or does not answer within `seconds`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(program), "--port", str(port),
                               "--model-name", "bench", "--log-level", "warning", *options], cwd=REPO, env=env,
                              **popen)
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the server ({' '.join(options)}) exited") from None
            if time.monotonic() > deadline:
                server.kill()
                raise SystemExit(f"the server did not answer within {seconds:.0f} s") from None
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CPU_SERIES = {"http": "kiln_http_process_cpu_seconds_total", "engine": "kiln_engine_process_cpu_seconds_total"}


def server_cpu_seconds(port: int) -> dict[str, float]:
    """The server's CPU seconds so far by process, from its /metrics: "http" (the server's own process) and, with
    the engine in a process of its own, "engine"."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    found = {}
    for line in text.splitlines():
        for name, series in CPU_SERIES.items():
            if line.startswith(series + "{") or line.startswith(series + " "):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one_request(client, model: str, prompt: list[int], max_tokens: int, level: Level) -> None:
    """One streamed completion through the official client (AsyncOpenAI)."""
    import openai

    start = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=TEMPERATURE[0], seed=len(prompt),
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                level.output_tokens += chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                last = level.arrived(start, last)
    except openai.APIError as e:
        print(f"request failed: {e}", file=sys.stderr)
        level.errors += 1


async def one_raw_request(port: int, model: str, prompt: list[int], max_tokens: int, level: Level) -> None:
    """The same request as one_request over a bare asyncio connection (HTTP/1.0: the stream ends when the server
    closes it), parsing only what is measured: a client light enough not to be what limits tens of thousands of
    chunks a second."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": TEMPERATURE[0],
                       "seed": len(prompt),
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    start = time.perf_counter()
    last = None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        status = await reader.readline()
        if b" 200 " not in status:
            print(f"request failed: {status.decode().strip()} {(await reader.read()).decode()[:300]}", file=sys.stderr)
            level.errors += 1
            return
        while (await reader.readline()).strip():  # the headers
            pass
        async for line in reader:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                print(f"request failed: {chunk['error']}", file=sys.stderr)
                level.errors += 1
                return
            if chunk.get("usage"):
                level.output_tokens += chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = level.arrived(start, last)
    finally:
        writer.close()


async def run_level(port: int, model: str, concurrency: int, work: list[tuple[list[int], int]],
                    raw: bool, cpu: bool = False) -> Level:
    level = Level(concurrency)
    queue = list(work)
    client = None
    if not raw:
        import openai

        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                    timeout=600)

    async def worker() -> None:
        while queue:
            prompt, max_tokens = queue.pop(0)
            if raw:
                await one_raw_request(port, model, prompt, max_tokens, level)
            else:
                await one_request(client, model, prompt, max_tokens, level)

    served = server_cpu_seconds(port) if cpu else {}
    start, client_cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    level.wall = time.perf_counter() - start
    level.client_cpu = (time.process_time() - client_cpu) / level.wall
    if cpu:
        level.server_cpu = {name: seconds - served[name] for name, seconds in server_cpu_seconds(port).items()
                            if name in served}
    if client is not None:
        await client.close()
    return level


def engine_level(engine, concurrency: int, work: list[tuple[list[int], int]]) -> Level:
    """The same closed loop on an LLMEngine in this process, no HTTP: what the engine alone sustains."""
    import threading

    from kiln.runtime.llm.sampling import Sampler
    from kiln.runtime.serve.engine import Generation

    level = Level(concurrency)
    queue = list(work)
    lock, done = threading.Lock(), threading.Semaphore(0)

    def submit() -> bool:
        with lock:
            if not queue:
                return False
            prompt, max_tokens = queue.pop(0)
        start = time.perf_counter()
        times: list[float] = []

        def emit(event) -> None:
            if event.kind == "token":
                times.append(time.perf_counter())
            elif event.kind in ("done", "error"):
                with lock:
                    level.errors += event.kind == "error"
                    level.output_tokens += len(times)
                    if times:
                        level.ttft.append(times[0] - start)
                        level.itl.extend(np.diff(times).tolist())
                done.release()

        engine.submit(Generation(prompt, max_tokens, Sampler(TEMPERATURE[0], seed=len(prompt)), [], [], emit))
        return True

    start = time.perf_counter()
    running = sum(submit() for _ in range(concurrency))
    while running:
        done.acquire()
        running -= 1
        running += submit()
    level.wall = time.perf_counter() - start
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
    TEMPERATURE[0] = args.temperature
    levels = [int(c) for c in args.concurrency.split(",")]
    prompt_lengths = [int(n) for n in args.prompt_lengths.split(",")]
    output_lengths = [int(n) for n in args.output_lengths.split(",")]
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "benchmarks"))
    if args.export_llama and not args.program.exists():
        export_llama_shape(args.program, args.export_llama, args.dtype, args.slots, args.max_context,
                           args.prefill_chunk, args.quantize)
    import kiln
    from kiln.runtime.llm.info import LLMInfo

    program = kiln.load(args.program)
    info = LLMInfo.from_metadata(program.metadata)
    vocab = info.vocab_size or 1000
    rng = np.random.default_rng(args.seed)
    pairs = itertools.cycle(itertools.product(prompt_lengths, output_lengths))
    work = [(rng.integers(0, vocab, n).tolist(), m) for n, m in itertools.islice(pairs, 4 * args.requests)]

    def level_work(concurrency: int) -> list[tuple[list[int], int]]:
        count = max(args.requests, args.rounds * concurrency)
        return list(itertools.islice(itertools.cycle(work), count))

    print(f"single-stream decode (Generator, {args.backend}) ...", file=sys.stderr, flush=True)
    reference = single_stream_decode(args.program, args.backend, work[0][0], max(output_lengths))

    port = free_port()
    server = start_server(args.program, port, ["--backend", args.backend, "--max-queue",
                                               str(max(len(level_work(c)) for c in levels)), "--engine-in",
                                               args.engine_in]
                          + ({True: ["--overlap"], False: ["--no-overlap"]}.get(args.overlap, [])))
    raw = args.client == "raw"
    try:
        for c in levels:  # warm-up: every batch size's plan (and graph) before anything is timed
            asyncio.run(run_level(port, "bench", c, [(p, 4) for p, _ in level_work(c)[:c]], raw))
        results = []
        for number in range(args.passes):
            for c in levels:
                print(f"pass {number + 1}, concurrency {c}: {len(level_work(c))} requests ...", file=sys.stderr,
                      flush=True)
                results.append(asyncio.run(run_level(port, "bench", c, level_work(c), raw, cpu=True)))
    finally:
        server.terminate()
        server.wait(60)

    engine_results = []
    if args.engine:
        from kiln.runtime.serve.engine import EngineMetrics, LLMEngine

        class StepTime(EngineMetrics):
            seconds = 0.0

            def step(self, batch: int, seconds: float) -> None:
                self.seconds += seconds

        steps = StepTime()
        engines = {}  # by whether the engine overlaps its steps: both with --overlap, else as the server's engine
        for setting in (False, True) if args.overlap else (args.overlap,):
            engine = LLMEngine(program, args.backend, max_queue=max(len(level_work(c)) for c in levels),
                               metrics=steps, overlap=setting)
            engines[engine.overlap] = engine.warm_up().start()
        try:
            for c in levels:
                for overlap, engine in engines.items():
                    engine_level(engine, c, [(p, 4) for p, _ in level_work(c)[:c]])
                    print(f"engine alone{' (overlap)' if overlap else ''}, concurrency {c} ...", file=sys.stderr,
                          flush=True)
                    before = steps.seconds
                    engine_results.append(engine_level(engine, c, level_work(c)))
                    engine_results[-1].decode_seconds = steps.seconds - before
                    engine_results[-1].overlap = overlap
        finally:
            for engine in engines.values():
                engine.shutdown()
    del program

    print(f"\nProgram {args.program.name}: slots {info.slots or 1}, context {info.max_context}, backend "
          f"{args.backend}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; client "
          f"{args.client}; server engine in a {args.engine_in}")
    print(f"Mix: at least {args.requests} requests (and {args.rounds} per worker) per level, prompt lengths "
          f"{prompt_lengths} x output lengths {output_lengths}, "
          f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, ignore_eos. Single-stream decode "
          f"without "
          f"a server (Generator): {reference:.1f} tokens/s.\n")
    for number in range(args.passes):
        if args.passes > 1:
            print(f"{'' if number == 0 else chr(10)}Pass {number + 1} of {args.passes}:")
        table("server", results[number * len(levels):(number + 1) * len(levels)], show_client=True)
    if args.passes > 1:
        passes_summary(results, levels, args.passes)
    if any(r.server_cpu for r in results):
        print()
        server_cpu_table(results)
    for overlap in sorted({r.overlap for r in engine_results}):
        print()
        table("engine alone (no HTTP" + (", overlapped steps)" if overlap else ")"),
              [r for r in engine_results if r.overlap == overlap], show_client=False)
    first = results[0]
    per_stream = 1 / statistics.median(first.itl) if first.itl else float("nan")
    print(f"\nconcurrency {first.concurrency}: {per_stream:.1f} tokens/s per stream (1 / median inter-token gap), "
          f"{per_stream / reference:.2f}x the single-stream decode without a server ({reference:.1f})")
    return 1 if any(r.errors for r in results + engine_results) else 0


def server_cpu_table(results: list[Level]) -> None:
    """Each server process's CPU over a level: the share of one core it kept busy and its CPU microseconds per
    output token. A process near 100% of a core is the ceiling of the server's tokens/s, whatever the device."""
    names = [name for name in CPU_SERIES if name in results[0].server_cpu]
    print("| server CPU: concurrency | " + " | ".join(f"{n} cores | {n} us/token" for n in names) + " |")
    print("|---:|" + "---:|---:|" * len(names))
    for r in results:
        cells = [f"{r.server_cpu[n] / r.wall:.0%} | {r.server_cpu[n] / max(r.output_tokens, 1) * 1e6:.1f}"
                 for n in names]
        print(f"| {r.concurrency} | " + " | ".join(cells) + " |")


def passes_summary(results: list[Level], levels: list[int], passes: int) -> None:
    """Each level's median output tokens/s over the passes, and against the first level: the median of the passes'
    own ratios (each pass's levels ran minutes apart, not a whole run apart) and their range."""
    rates = [[r.output_tokens / r.wall for r in results[n * len(levels):(n + 1) * len(levels)]]
             for n in range(passes)]
    print(f"\n| medians of {passes} passes: concurrency | output tokens/s | x concurrency {levels[0]} (median of "
          f"the passes' ratios) | range of the passes' ratios |")
    print("|---:|---:|---:|---:|")
    for i, c in enumerate(levels):
        ratios = [rate[i] / rate[0] for rate in rates]
        print(f"| {c} | {statistics.median(rate[i] for rate in rates):.1f} | {statistics.median(ratios):.2f} | "
              f"{min(ratios):.2f}-{max(ratios):.2f} |")


def table(title: str, results: list[Level], show_client: bool) -> None:
    """Markdown rows; the server's with the client process's CPU share (near 100%: the client limits), the
    engine's with the share of its wall time in batched decode steps (the rest: prefill and the engine's own
    work between steps; with overlapped steps each counts from its launch to its picks' read, two at a time, so
    the share passes 100%)."""
    client = " client CPU |" if show_client else " decode steps |"
    print(f"| {title}: concurrency | output tokens/s | x concurrency 1 | TTFT p50 / p99 ms | ITL p50 / p99 ms "
          f"| errors |{client}")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = results[0].output_tokens / results[0].wall
    for r in results:
        rate = r.output_tokens / r.wall
        cpu = f" {r.client_cpu if show_client else r.decode_seconds / r.wall:.0%} |"
        print(f"| {r.concurrency} | {rate:.1f} | {rate / base:.2f} | {percentile(r.ttft, 50) * 1e3:.1f} / "
              f"{percentile(r.ttft, 99) * 1e3:.1f} | {percentile(r.itl, 50) * 1e3:.2f} / "
              f"{percentile(r.itl, 99) * 1e3:.2f} | {r.errors} |{cpu}")


if __name__ == "__main__":
    sys.exit(main())
