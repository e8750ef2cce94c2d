"""kiln's serving engine against transformers' continuous batching (`generate_batch`) on one GPU: the same random
Llama, the same requests, all submitted at once, output tokens/s over the whole batch.

    PYTHONPATH=src python3 benchmarks/serve_peer_transformers.py PROGRAM.kiln --shape llama-3.2-1b
        [--requests 128] [--prompt-lengths 128,512] [--output 256]

PROGRAM.kiln must be serve_load.py's export of the shape (`--export-llama SHAPE`, seed 0): this script builds the
same model in transformers (seed 0, bfloat16) for the peer. Every request generates exactly --output tokens (stop
tokens ignored on both sides), so both produce the same number of tokens; kiln's engine holds at most its program's
slots at once, transformers schedules as its ContinuousBatchingConfig defaults decide. The two run one after the
other in this process, kiln first, each after a warm-up batch.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("program", type=Path, help="serve_load.py's export of --shape (with --slots)")
    p.add_argument("--shape", default="llama-3.2-1b", help="cpu_compare.LLAMA_SIZES key (default: llama-3.2-1b)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-lengths", default="128,512")
    p.add_argument("--output", type=int, default=256, help="tokens each request generates (default: 256)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def kiln_batch(program: Path, work: list[list[int]], output: int) -> tuple[float, int]:
    """(seconds, output tokens) of kiln's engine over every request, all queued at once."""
    import kiln
    from kiln.runtime.llm.sampling import Sampler
    from kiln.runtime.serve.engine import Generation, LLMEngine

    engine = LLMEngine(kiln.load(program), "cuda", max_queue=len(work) + 1).warm_up().start()
    try:
        def run(prompts: list[list[int]]) -> tuple[float, int]:
            done = threading.Semaphore(0)
            counts = [0] * len(prompts)

            def emitter(i: int):
                def emit(event) -> None:
                    if event.kind == "token":
                        counts[i] += 1
                    elif event.kind in ("done", "error"):
                        done.release()
                return emit

            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                engine.submit(Generation(prompt, output, Sampler(), [], [], emitter(i)))
            for _ in prompts:
                done.acquire()
            return time.perf_counter() - start, sum(counts)

        run(work[:8])  # warm-up
        return run(work)
    finally:
        engine.shutdown()


def transformers_batch(shape: str, work: list[list[int]], output: int) -> tuple[float, int, str]:
    """(seconds, output tokens, how it ran) of transformers' generate_batch over every request."""
    import torch
    import transformers
    from cpu_compare import LLAMA_SIZES
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    errors = []
    for attention in ("sdpa_paged", "paged|sdpa", "sdpa"):
        try:
            torch.manual_seed(0)
            config = LlamaConfig(**LLAMA_SIZES[shape], attn_implementation=attention)
            model = LlamaForCausalLM(config).to(torch.bfloat16).to("cuda").eval()
            if not hasattr(model, "generate_batch"):
                raise RuntimeError(f"transformers {transformers.__version__} has no generate_batch")
            generation = GenerationConfig(max_new_tokens=output, min_new_tokens=output, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
            model.generate_batch(work[:8], generation_config=generation, progress_bar=False)  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            results = model.generate_batch(work, generation_config=generation, progress_bar=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            tokens = sum(len(r.generated_tokens) for r in results.values())
            return seconds, tokens, f"transformers {transformers.__version__}, attn_implementation={attention}"
        except Exception as e:  # noqa: BLE001 (try the next attention implementation, report all at the end)
            errors.append(f"{attention}: {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.empty_cache()
    raise SystemExit("transformers' continuous batching did not run:\n  " + "\n  ".join(errors))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    vocab = 128256 if args.shape == "llama-3.2-1b" else 8192
    work = [rng.integers(0, vocab, n).tolist() for n in itertools.islice(itertools.cycle(lengths), args.requests)]
    print(f"{args.requests} requests, prompts {lengths}, {args.output} tokens each", flush=True)
    kiln_seconds, kiln_tokens = kiln_batch(args.program, work, args.output)
    print(f"kiln: {kiln_tokens} tokens in {kiln_seconds:.2f} s", flush=True)
    peer_seconds, peer_tokens, how = transformers_batch(args.shape, work, args.output)
    print(f"peer ({how}): {peer_tokens} tokens in {peer_seconds:.2f} s", flush=True)
    print("\n| engine | output tokens | seconds | output tokens/s | x transformers |")
    print("|---|---:|---:|---:|---:|")
    peer_rate = peer_tokens / peer_seconds
    print(f"| kiln LLMEngine (cuda graphs) | {kiln_tokens} | {kiln_seconds:.2f} | {kiln_tokens / kiln_seconds:,.0f} | "
          f"{kiln_tokens / kiln_seconds / peer_rate:.2f} |")
    print(f"| {how} | {peer_tokens} | {peer_seconds:.2f} | {peer_rate:,.0f} | 1.00 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
