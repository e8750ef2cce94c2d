"""A decode step's kernels one by one on the GPU: kiln's kernels vs cuBLAS and PyTorch on the shapes of a decoder.

    PYTHONPATH=src python3 benchmarks/gpu_kernels.py [--shape llama-3.2-1b] [--dtype bfloat16] [--markdown]

For each linear layer of one decode step (batch 1; q/k/v and gate/up stacked as kiln's fuse_projections pass
stacks them) the GPU time of kiln's `linear` kernel, of cuBLAS through kiln's bindings, and of torch's F.linear,
with the weight bytes each reads per second as a fraction of the copy bandwidth (each call reads a weight copy not
in L2, as a model's layers do); then the one-query attention
over a static cache at two contexts, kiln's kernel vs torch's scaled_dot_product_attention; then a prompt's
attention written at the start of that cache (a bool mask over [query, slot], as an exported prefill has it):
kiln's kernel, kiln's products path, torch's sdpa with that mask, and torch's causal sdpa over the prompt's keys
only (what a kernel that skips the hidden slots could reach). GPU time is taken with
the calls queued behind a spinning kernel (gpu_harness.gpu_time): Python's launch cost is not in it, as it is not
in a CUDA graph's replay. Every kiln result is checked against torch's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_compare import LLAMA_SIZES  # noqa: E402
from gpu_harness import copy_bandwidth, device_line, gpu_time, print_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES), default="llama-3.2-1b", help="decoder shape")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--rows", type=int, default=1, help="input rows of the linear layers (default 1)")
    parser.add_argument("--gemm-rows", action="store_true",
                        help="kiln's linear at 9-64 rows through quant.cu's gemm_rows (gemm_rows.DENSE_GEMM_ROWS), not "
                             "cuBLAS: the cuBLAS column is then its peer")
    parser.add_argument("--tuned", action="store_true",
                        help="kiln's linear with the algorithm measured fastest for each shape (linalg.TUNED_PRODUCTS, "
                             "cublaslt.py): the cuBLAS column is then its peer, and each shape's tuning is printed")
    parser.add_argument("--max-context", type=int, default=1280, help="KV-cache slots (default 1280)")
    parser.add_argument("--contexts", default="128,1024", help="attention contexts (default 128,1024)")
    parser.add_argument("--prompts", default="128,512", help="prefill attention lengths (default 128,512)")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed run (default 50)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args(argv)

    import cupy as cp
    import torch
    import torch.nn.functional as F  # noqa: N812

    from kiln.runtime.backends.array_api import BFLOAT16
    from kiln.runtime.backends.cuda import cublas
    from kiln.runtime.backends.cuda.kernels import CUDA_KERNELS
    from kiln.runtime.backends.cuda.kernels.attention import _products_attention

    def to_cupy(t: torch.Tensor):  # bfloat16 crosses as its bits
        return cp.asarray(t.view(torch.int16)).view(BFLOAT16) if t.dtype == torch.bfloat16 else cp.asarray(t)

    def to_torch(a) -> torch.Tensor:
        if a.dtype == BFLOAT16:
            return torch.as_tensor(a.view(cp.int16), device="cuda").view(torch.bfloat16)
        return torch.as_tensor(a, device="cuda")

    size = LLAMA_SIZES[args.shape]
    d, inter, heads = size["hidden_size"], size["intermediate_size"], size["num_attention_heads"]
    kv_heads, vocab = size["num_key_value_heads"], size["vocab_size"]
    e = d // heads
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(cp)
    linear, sdpa = CUDA_KERNELS.kernels["linear"], CUDA_KERNELS.kernels["sdpa"]
    if args.gemm_rows:
        from kiln.runtime.backends.cuda.kernels import gemm_rows

        gemm_rows.DENSE_GEMM_ROWS = True
    if args.tuned:
        from kiln.runtime.backends.cuda.kernels import linalg

        linalg.TUNED_PRODUCTS = True
    print(f"{args.shape}, {args.dtype}, on {device_line(cp, torch)} (copy bandwidth {bandwidth / 1e12:.2f} TB/s); "
          f"GPU time per call, median of 5 runs of {args.calls} queued calls")

    shapes = {"q/k/v": (d + 2 * kv_heads * e, d), "o": (d, d), "gate/up": (2 * inter, d), "down": (d, inter),
              "lm head": (vocab, d)}
    body = []
    torch.manual_seed(0)
    l2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    for name, (n, k) in shapes.items():
        w_t = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        x_t = torch.randn(args.rows, k, device="cuda", dtype=dtype)
        w, x = to_cupy(w_t), to_cupy(x_t)
        want = F.linear(x_t, w_t).float()
        got = to_torch(linear(x, w, None)).float()
        error = (got - want).abs().max().item() / want.abs().max().item()
        # as in a model, each call reads a weight that is not in L2: copies, together over twice its size, in turn
        copies = [w_t] + [w_t.clone() for _ in range(-(-2 * l2 // (w_t.numel() * w_t.element_size())))]
        turns = itertools.cycle([(t, to_cupy(t)) for t in copies])
        times = {"kiln": gpu_time(cp, lambda x=x, t=turns: linear(x, next(t)[1], None), args.calls),
                 "cuBLAS": gpu_time(cp, lambda x=x, t=turns: cublas.matmul(x, next(t)[1].T), args.calls),
                 "torch": gpu_time(cp, lambda x=x_t, t=turns: F.linear(x, next(t)[0]), args.calls)}
        nbytes = w_t.numel() * w_t.element_size()
        body.append([f"{name} [{n}, {k}]"] + [f"{t * 1e6:.1f}" for t in times.values()]
                    + [f"{100 * nbytes / t / bandwidth:.0f}%" for t in times.values()] + [f"{error:.1e}"])
    print_table(body, ["linear", "kiln us", "cuBLAS us", "torch us", "kiln % bw", "cuBLAS % bw", "torch % bw",
                       "kiln rel err"], args.markdown)
    if args.tuned:
        from kiln.runtime.backends.cuda import cublaslt

        for key, plan in cublaslt.plans().items():
            ranked = sorted(((n, us) for n, us in plan.timings.items() if n != "chosen"), key=lambda kv: kv[1])[:4]
            print(f"tuned n={key[3]} m={key[4]} k={key[5]}: {'cuBLASLt' if plan.algo else 'GemmEx'} "
                  f"({', '.join(f'{name} {us:.1f} us' for name, us in ranked)})")

    body = []
    slots = args.max_context
    q_t = torch.randn(1, heads, 1, e, device="cuda", dtype=dtype)
    k_t = torch.randn(1, kv_heads, slots, e, device="cuda", dtype=dtype)
    v_t = torch.randn(1, kv_heads, slots, e, device="cuda", dtype=dtype)
    q, k, v = to_cupy(q_t), to_cupy(k_t), to_cupy(v_t)
    for context in (int(c) for c in args.contexts.split(",")):
        mask_t = (torch.arange(slots, device="cuda") <= context)[None, None, None, :]
        mask = cp.asarray(mask_t)
        want = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask_t, enable_gqa=True).float()
        got = to_torch(sdpa(q, k, v, mask, causal=False, scale=None)).float()
        error = (got - want).abs().max().item() / want.abs().max().item()
        times = {"kiln": gpu_time(cp, lambda mask=mask: sdpa(q, k, v, mask, causal=False, scale=None), args.calls),
                 "torch": gpu_time(cp, lambda mask=mask_t: F.scaled_dot_product_attention(
                     q_t, k_t, v_t, attn_mask=mask, enable_gqa=True), args.calls)}
        nbytes = 2 * kv_heads * (context + 1) * e * k_t.element_size()
        body.append([f"context {context} of {slots}"] + [f"{t * 1e6:.1f}" for t in times.values()]
                    + [f"{nbytes / bandwidth * 1e6:.1f}", f"{error:.1e}"])
    print_table(body, ["decode attention", "kiln us", "torch us", "bound us", "kiln rel err"], args.markdown)

    body = []
    for prompt in (int(p) for p in args.prompts.split(",")):
        q_t = torch.randn(1, heads, prompt, e, device="cuda", dtype=dtype)
        q = to_cupy(q_t)
        mask_t = (torch.arange(slots, device="cuda")[None] <= torch.arange(prompt, device="cuda")[:, None])[None, None]
        mask = cp.asarray(mask_t)
        want = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask_t, enable_gqa=True).float()
        got = to_torch(sdpa(q, k, v, mask, causal=False, scale=None)).float()
        error = (got - want).abs().max().item() / want.abs().max().item()
        k_p, v_p = k_t[:, :, :prompt].contiguous(), v_t[:, :, :prompt].contiguous()
        times = {"kiln": gpu_time(cp, lambda q=q, mask=mask: sdpa(q, k, v, mask, causal=False, scale=None), args.calls)}
        if cublas.supports(q.dtype):
            times["products"] = gpu_time(cp, lambda q=q, mask=mask: _products_attention(q, k, v, mask, False, None),
                                         args.calls)
        times["torch"] = gpu_time(cp, lambda q=q_t, mask=mask_t: F.scaled_dot_product_attention(
            q, k_t, v_t, attn_mask=mask, enable_gqa=True), args.calls)
        times["torch causal"] = gpu_time(cp, lambda q=q_t, k=k_p, v=v_p: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), args.calls)
        flops = 4 * heads * e * prompt * (prompt + 1) / 2  # the visible (causal) part only
        body.append([f"{prompt} tokens into {slots} slots"] + [f"{t * 1e6:.1f}" for t in times.values()]
                    + [f"{flops / times['kiln'] / 1e12:.1f}", f"{error:.1e}"])
    print_table(body, ["prefill attention", "kiln us"] + (["products us"] if cublas.supports(q.dtype) else [])
                + ["torch (mask) us", "torch (causal, prompt keys) us", "kiln TFLOP/s", "kiln rel err"],
                args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
