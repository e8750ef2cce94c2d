"""One-query (decode) attention over a static KV cache on the GPU: kiln's split-key kernel in its configurations,
against torch's scaled_dot_product_attention on the same cache and mask.

    PYTHONPATH=src python3 benchmarks/gpu_decode_attention.py [--heads 32 --kv-heads 4 --head-dim 128]
        [--cache 1280] [--contexts 128,1024] [--batch 1] [--no-mask] [--markdown]

A configuration sets attention.py's knobs: the most q heads a block serves (DECODE_HEADS: a kv head's group split
over several blocks) and the fewest keys a block reads (DECODE_CHUNK); "mma" the tensor-core kernel (DECODE_MMA).
The cache is read through a bool mask that shows the first `context` slots, as an exported single-sequence decode
step has it, or with --no-mask as views of those slots and no mask (the form a serving step's slots take). GPU time
per call with the calls
queued behind a spinning kernel (gpu_harness.gpu_time): launched early one after another, as a CUDA graph replays a
step's chain. Every result is checked against torch's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_harness import device_line, gpu_time, print_table  # noqa: E402

CONFIGS = {**{f"{heads} heads / {chunk} keys": dict(DECODE_MMA=False, DECODE_HEADS=heads, DECODE_CHUNK=chunk)
              for chunk in (64, 32) for heads in (8, 4, 2, 1)},
           "mma": dict(DECODE_MMA=True), "mma / 4096 blocks": dict(DECODE_MMA=True, DECODE_BLOCKS=4096),
           "mma-unpipelined": dict(DECODE_MMA=True, DECODE_MMA_PIPELINED=False),
           "prefetch-all": dict(DECODE_PREFETCH_VISIBLE=False)}
"""The "N heads / K keys" configurations: decode.cu's split-key attend_chunk. The "mma" configurations: decode.cu's
attend_mma on the tensor cores (the default; with chunks for 4096 blocks, not 1024; with a warp's next keys loaded
only after its step, for fewer registers). "prefetch-all": the default kernel asking L2 for every slot of its chunk
before its wait, the keys the mask hides too (DECODE_PREFETCH_VISIBLE off)."""
KNOBS = ("DECODE_HEADS", "DECODE_CHUNK", "DECODE_MMA", "DECODE_BLOCKS", "DECODE_MMA_PIPELINED",
         "DECODE_PREFETCH_VISIBLE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=32, help="q heads (default 32: Qwen3-30B-A3B)")
    parser.add_argument("--kv-heads", type=int, default=4, help="kv heads (default 4)")
    parser.add_argument("--head-dim", type=int, default=128, help="head width (default 128)")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument("--cache", type=int, default=1280, help="KV-cache slots (default 1280)")
    parser.add_argument("--contexts", default="128,1024", help="visible slots (default 128,1024)")
    parser.add_argument("--configs", default=";".join(CONFIGS), help="configurations, semicolon-separated")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed run (default 200)")
    parser.add_argument("--no-mask", action="store_true",
                        help="pass the keys a context sees as a view of the cache and no mask (as a serving step reads "
                             "a slot; the form the mma configuration takes)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    unknown = [name for name in args.configs.split(";") if name not in CONFIGS]
    if unknown:
        parser.error(f"no configuration {', '.join(map(repr, unknown))} (there are: {'; '.join(CONFIGS)})")

    import cupy as cp
    import torch

    from kiln.runtime.backends.cuda.kernels import attention

    b, hq, hkv, e = args.batch, args.heads, args.kv_heads, args.head_dim
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, e, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, args.cache, e, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, args.cache, e, device="cuda", dtype=torch.bfloat16)
    qc, kc, vc = (cp.from_dlpack(t) for t in (q, k, v))
    defaults = {name: getattr(attention, name) for name in KNOBS}
    rows = []
    for context in contexts:
        mask = torch.arange(args.cache, device="cuda") < context
        mask4 = mask[None, None, None].expand(b, 1, 1, args.cache)
        mc = cp.from_dlpack(mask4.contiguous())
        kk, vv = kc, vc
        if args.no_mask:  # the visible keys as views of the cache (its strides), no mask
            mc, kk, vv = None, kc[:, :, :context], vc[:, :, :context]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask4, enable_gqa=True)

        def torch_call(mask4=mask4) -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask4, enable_gqa=True)

        torch_us = gpu_time(cp, torch_call, calls=args.calls) * 1e6
        for name in args.configs.split(";"):
            for knob, value in {**defaults, **CONFIGS[name]}.items():
                setattr(attention, knob, value)
            got = attention.sdpa(qc, kk, vv, mc, causal=False, scale=None)
            error = float((torch.from_dlpack(got).float() - want.float()).abs().max())
            assert error < 2e-2, (name, context, error)
            us = gpu_time(cp, lambda mc=mc, kk=kk, vv=vv: attention.sdpa(qc, kk, vv, mc, causal=False, scale=None),
                          calls=args.calls) * 1e6
            rows.append([str(context), name, f"{us:.2f}", f"{torch_us:.2f}", f"{torch_us / us:.2f}", f"{error:.1e}"])
        for knob, value in defaults.items():
            setattr(attention, knob, value)
    print(f"decode attention, {b} x {hq}/{hkv} heads of {e}, cache {args.cache}, bfloat16, on {device_line(cp, torch)}")
    print_table(rows, ["context", "kiln configuration", "kiln us", "torch sdpa us", "x torch", "max |diff|"],
                args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
