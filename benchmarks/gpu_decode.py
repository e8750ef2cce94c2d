"""Decode-step latency of a random-weight Llama on the GPU: kiln's cuda backend vs PyTorch eager on the same GPU.

    PYTHONPATH=src python3 benchmarks/gpu_decode.py [--shape smollm2-135m] [--position 128] [--repeat 30]

A first probe for the CUDA backend (issue 6): float32, one token at `--position` of a 512-token static cache,
interleaved rounds, medians, the GPU synchronized around each step. The full GPU benchmark (bf16 Llama-3.2-1B
shape, prefill, torch.compile, roofline) is still to come.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_compare import LLAMA_SIZES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES), default="smollm2-135m", help="model shape")
    parser.add_argument("--position", type=int, default=128, help="decode position (default 128)")
    parser.add_argument("--max-context", type=int, default=512, help="static cache length (default 512)")
    parser.add_argument("--repeat", type=int, default=30, help="timed steps per contestant (default 30)")
    args = parser.parse_args(argv)

    import cupy
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models.llm import StaticCacheLM, export_llama

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_SIZES[args.shape], attn_implementation="sdpa")).eval()
    t0 = time.perf_counter()
    program = export_llama(StaticCacheLM(model, args.max_context, 8), args.max_context, 8).load()
    print(f"export {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    session = program.session("cuda")
    token, pos = np.array([[42]]), np.array([args.position])
    eager = StaticCacheLM(model.cuda(), args.max_context, 8).cuda().eval()
    ttoken, tpos = torch.tensor([[42]], device="cuda"), torch.tensor([args.position], device="cuda")

    def kiln_step() -> None:
        session.run("decode", token, pos)
        cupy.cuda.Device().synchronize()

    def eager_step() -> None:
        with torch.no_grad():
            eager.decode(ttoken, tpos)
        torch.cuda.synchronize()

    times: dict[str, list[float]] = {"kiln cuda": [], "torch eager cuda": []}
    steps = {"kiln cuda": kiln_step, "torch eager cuda": eager_step}
    for fn in steps.values():
        for _ in range(3):
            fn()
    for _ in range(args.repeat):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    kiln_ms = statistics.median(times["kiln cuda"]) * 1e3
    eager_ms = statistics.median(times["torch eager cuda"]) * 1e3
    print(f"{args.shape} decode at {args.position} (cache {args.max_context}), float32, median of {args.repeat}:")
    print(f"  kiln cuda {kiln_ms:.2f} ms  torch eager {eager_ms:.2f} ms  kiln/eager {kiln_ms / eager_ms:.2f}")
    print(f"  ops on the host: {sorted(session.backend.host_ops) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
