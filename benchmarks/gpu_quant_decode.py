"""Decode steps of a weight-only quantized LLM on the GPU: bf16 vs int8 vs int4, each against its own roofline.

    PYTHONPATH=src python3 benchmarks/gpu_quant_decode.py [--shape llama-3.2-1b] [--context 128] [--repeat 15]

A random-weight Llama of the given shape exported three times (kiln.models.llm.export_llama, bfloat16
activations): weights in bfloat16, int8 per output channel, int4 in groups of 64 (`--quantize`). Each program's
decode step at one context runs from its session's CUDA graph, --steps back to back per sample, the contestants
interleaved round by round, medians. For the quantized programs the step runs twice, once with quant.cu's qgemv
and once with qlinear_rows (its predecessor), each a session of its own whose graph was captured with that kernel.
The roofline of a step is what it must read: every constant of the program once (codes, scales, zero points, the
bf16 tensors), plus the KV cache up to the context, at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_compare import LLAMA_SIZES  # noqa: E402
from gpu_harness import copy_bandwidth, device_line, print_table, time_round_robin  # noqa: E402
from harness import stderr_log  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES), default="llama-3.2-1b")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--quantize", default="int8,int4", help="comma-separated kiln modes besides bf16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)

    import cupy as cp
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models.llm import export_llama
    from kiln.runtime.backends.cuda.kernels import linalg

    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA_SIZES[args.shape], "max_position_embeddings": args.max_context})
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    bandwidth = copy_bandwidth(cp)
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 2 * (args.context + 1)
    token, position = cp.asarray(np.array([[42]], np.int64)), cp.asarray(np.array([args.context], np.int64))
    cases, rooflines = {}, {}
    for mode in ["bf16", *[m for m in args.quantize.split(",") if m]]:
        t0 = time.perf_counter()
        program = export_llama(model, args.max_context, 32, quantize=None if mode == "bf16" else mode).load()
        stderr_log(f"{mode}: exported in {time.perf_counter() - t0:.0f} s, {program.constant_bytes / 1e9:.3f} GB")
        kernels = [("", True)] if mode == "bf16" else [(" qgemv", True), (" qlinear_rows", False)]
        for label, flag in kernels:
            linalg.QGEMV = flag
            session = program.session("cuda")
            for _ in range(3):  # the first runs capture the graph, with the kernel chosen now
                session.run("decode", token, position)
            cp.cuda.Device().synchronize()

            def run(session=session) -> None:
                for _ in range(args.steps):
                    session.run("decode", token, position)
                cp.cuda.Device().synchronize()
            cases[mode + label] = run
            rooflines[mode + label] = (program.constant_bytes + kv_bytes) / bandwidth
        linalg.QGEMV = True
    medians = {k: v / args.steps for k, v in time_round_robin(cases, args.repeat).items()}
    print(f"{args.shape} decode at context {args.context}, bfloat16 activations, on {device_line(cp, torch)} (copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s); CUDA graphs, median of {args.repeat} rounds of {args.steps} steps")
    body = [[name, f"{t * 1e3:.3f}", f"{1 / t:.0f}", f"{rooflines[name] * 1e3:.3f}",
             f"{100 * rooflines[name] / t:.0f}%", f"{medians['bf16'] / t:.2f}x"] for name, t in medians.items()]
    print_table(body, ["program", "step ms", "tokens/s", "roofline ms", "% of roofline", "x bf16"], args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
