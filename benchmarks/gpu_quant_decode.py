"""Decode steps of a weight-only quantized LLM on the GPU: bf16 vs int8 vs int4, each against its own roofline.

    PYTHONPATH=src python3 benchmarks/gpu_quant_decode.py [--shape llama-3.2-1b] [--context 128] [--repeat 15]

A random-weight Llama of the given shape exported three times (kiln.models.llm.export_llama, bfloat16
activations): weights in bfloat16, int8 per output channel, int4 in groups of 64 (`--quantize`). Each program's
decode step at one context runs from its session's CUDA graph, --steps back to back per sample, the contestants
interleaved round by round, medians. For the quantized programs the step runs once per few-row kernel of quant.cu
(`--kernels`, gpu_harness.QUANT_KERNELS: qgemv_dot "dot", qgemv_staged "staged", qgemv "direct", qlinear_rows
"rows"; "-apart" after a name: the gated activation as a kernel of its own, not the kernel's epilogue), each a
session of its own whose graph was captured with that kernel. `--op-times N` prints each program's N costliest ops
of a step (run op by op, the first kernel named).
`--json PATH` writes the medians for gpu_ab.py (`gpu_ab.py main=.ab/main/src new=src --script
benchmarks/gpu_quant_decode.py -- --cache DIR ...`: source trees alternated over the same programs).
`--prefill N` also times each program's prefill of N tokens in one call (exported with a prefill chunk of N; its
rows take the quantized linears' many-row path, so once a program), the programs interleaved as for decode.
The roofline of a step is what it must read: every constant of the decode method once (codes, scales, zero points,
the bf16 tensors; of an embedding table no other node reads, one row), plus the KV cache up to the context, at the
copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_harness  # noqa: E402
from cpu_compare import LLAMA_SIZES  # noqa: E402
from gpu_harness import copy_bandwidth, device_line, gpu_op_times, print_table, time_round_robin  # noqa: E402
from gpu_llm import write_results  # noqa: E402
from harness import quantize_spec, stderr_log  # noqa: E402


def step_bytes(program) -> int:
    """The constants a decode step reads: all of them, less an embedding table's rows but one where no other node
    reads the table (an untied model's input embedding: a step looks up one token)."""
    from kiln.ir.graph import ValueKind

    method = program.method("decode")
    readers: dict[int, set[str]] = {}
    for node in method.nodes:
        for v in node.inputs:
            if v >= 0 and method.values[v].kind == ValueKind.CONSTANT:
                readers.setdefault(method.values[v].ref, set()).add(node.op)
    total = 0
    for ref, ops in readers.items():
        array = program.constant(ref)
        table = ops <= {"embedding", "quantized_embedding"}
        total += array.nbytes // array.shape[0] if table and array.ndim == 2 else array.nbytes
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES), default="llama-3.2-1b")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--quantize", default="int8,int4",
                        help="comma-separated kiln modes besides bf16, each MODE[-gGROUP][-sym] (int4-g32-sym is "
                             "GGUF Q4_0's layout, int8-g32-sym Q8_0's)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--skip-bf16", action="store_true", help="leave the bf16 program out (an 8B shape exports "
                        "for minutes a program)")
    parser.add_argument("--compare-fusion", action="store_true",
                        help="also export each quantized program without fuse_gated_linear and fuse_norm_linear (its "
                             "norms and gated activations as kernels of their own) and time both")
    parser.add_argument("--kernels", default="dot,staged",
                        help="quant.cu kernels for the quantized programs (gpu_harness.QUANT_KERNELS), each with any "
                             "of these after it: " + "; ".join(f"{k}: {v}" for k, v in
                                                              gpu_harness.QUANT_VARIANTS.items()))
    parser.add_argument("--op-times", type=int, default=0, metavar="N", help="print each program's N costliest ops")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="keep the exported programs here and load them from here when present (an 8B shape "
                             "exports for minutes)")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="also time each program's prefill of N tokens (exports with a prefill chunk of N)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write each case's median (seconds, as kiln cuda) and roofline to PATH: gpu_ab.py "
                             "--script gpu_quant_decode.py alternates source trees over the same --cache programs")
    parser.add_argument("--no-compile", action="store_true", help="(no effect: this script runs no torch.compile; "
                                                                  "taken for gpu_ab.py)")
    args = parser.parse_args(argv)
    gpu_harness.check_quant_kernels(parser, args.kernels.split(","))
    if args.prefill > args.max_context:
        parser.error(f"--prefill {args.prefill} is longer than --max-context {args.max_context}")

    import cupy as cp
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models.llm import export_llama
    from kiln.runtime.program import load

    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA_SIZES[args.shape], "max_position_embeddings": args.max_context})
    model = None  # made on first need: every program may come from --cache
    bandwidth = copy_bandwidth(cp)
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 2 * (args.context + 1)
    token, position = cp.asarray(np.array([[42]], np.int64)), cp.asarray(np.array([args.context], np.int64))
    cases, rooflines, prefills = {}, {}, {}
    chunk = max(32, args.prefill)  # (the export's prefill chunk: 32 unless a longer prefill is timed)
    prompt = (cp.asarray(np.arange(args.prefill, dtype=np.int64)[None] % config.vocab_size + 7),
              cp.asarray(np.arange(args.prefill, dtype=np.int64)))
    quantized = [m for m in args.quantize.split(",") if m]
    runs = [*([] if args.skip_bf16 else ["bf16"]),
            *[v for m in quantized for v in ([m, m + "-unfused"] if args.compare_fusion else [m])]]
    for mode in runs:
        t0 = time.perf_counter()
        skip = ("fuse_gated_linear", "fuse_norm_linear") if mode.endswith("-unfused") else ()
        name = f"{args.shape}-{mode}-ctx{args.max_context}{'' if chunk == 32 else f'-chunk{chunk}'}.kiln"
        path = args.cache / name if args.cache else None
        if path is not None and path.exists():
            program = load(path, verify_checksums=False)  # (written by this script)
        else:
            if model is None:
                with torch.device("cuda"):  # (initialized on the GPU, exported from the CPU: an 8B model's
                    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()  # CPU init takes minutes)
                model = model.cpu()
                torch.cuda.empty_cache()  # (torch's cached blocks back to the device for CuPy's pool)
                stderr_log(f"random {args.shape} model made in {time.perf_counter() - t0:.0f} s")
            spec = None if mode == "bf16" else quantize_spec(mode.removesuffix("-unfused"))
            t1 = time.perf_counter()
            exported = export_llama(model, args.max_context, chunk, quantize=spec, skip_passes=skip)
            stderr_log(f"{mode}: export_llama {time.perf_counter() - t1:.0f} s")  # (where an 8B shape's time goes)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                exported.save(path)
            program = exported.load()
        stderr_log(f"{mode}: ready in {time.perf_counter() - t0:.0f} s, {program.constant_bytes / 1e9:.3f} GB")
        kernels = [k for k in args.kernels.split(",") if k]
        if mode == "bf16":  # (no quantized kernel: only the variants that apply to any program)
            kernels = list(dict.fromkeys(gpu_harness.variant_suffixes(k) for k in kernels))
        if args.op_times:
            gpu_harness.select_quant_kernel(kernels[0])
            print(f"{mode} {kernels[0]}: " + gpu_op_times(program, cp, "decode", (token, position), args.op_times))
        for kernel in kernels:
            label = f" {kernel}" if kernel else ""
            gpu_harness.select_quant_kernel(kernel)
            session = program.session("cuda")
            for _ in range(3):  # the first runs capture the graph, with the kernel chosen now
                session.run("decode", token, position)
            cp.cuda.Device().synchronize()

            def run(session=session) -> None:
                for _ in range(args.steps):
                    session.run("decode", token, position)
                cp.cuda.Device().synchronize()
            cases[mode + label] = run
            rooflines[mode + label] = (step_bytes(program) + kv_bytes) / bandwidth
            if args.prefill and kernel == kernels[0]:
                for _ in range(3):
                    session.run("prefill", *prompt)

                def prefill(session=session) -> None:
                    session.run("prefill", *prompt)
                    cp.cuda.Device().synchronize()
                prefills[mode] = prefill
        gpu_harness.select_quant_kernel("")
    medians = {k: v / args.steps for k, v in time_round_robin(cases, args.repeat).items()}
    print(f"{args.shape} decode at context {args.context}, bfloat16 activations, on {device_line(cp, torch)} (copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s); CUDA graphs, median of {args.repeat} rounds of {args.steps} steps")
    body = [[name, f"{t * 1e3:.3f}", f"{1 / t:.0f}", f"{rooflines[name] * 1e3:.3f}",
             f"{100 * rooflines[name] / t:.0f}%", f"{medians['bf16'] / t:.2f}x" if "bf16" in medians else ""]
            for name, t in medians.items()]
    print_table(body, ["program", "step ms", "tokens/s", "roofline ms", "% of roofline", "x bf16"], args.markdown)
    rows = [(f"{name} decode", {"kiln cuda": t}, rooflines[name], "") for name, t in medians.items()]
    if prefills:
        times = time_round_robin(prefills, args.repeat)
        rows += [(f"{name} prefill {args.prefill}", {"kiln cuda": t}, None, "") for name, t in times.items()]
        print(f"\nprefill of {args.prefill} tokens in one call (median of {args.repeat} rounds)")
        body = [[name, f"{t * 1e3:.3f}", f"{args.prefill / t:.0f}",
                 f"{times['bf16'] / t:.2f}x" if "bf16" in times else ""] for name, t in times.items()]
        print_table(body, ["program", "ms", "tokens/s", "x bf16"], args.markdown)
    if args.json:
        write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
