"""LLM prefill and decode on one GPU: kiln's cuda backend vs PyTorch eager vs torch.compile(mode="reduce-overhead").

    PYTHONPATH=src python3 benchmarks/gpu_llm.py [--shape llama-3.2-1b] [--dtype bfloat16] [--markdown]

A random-weight Llama of the given shape (default Llama-3.2-1B's: d 2048, 16 layers, 32 heads, 8 KV heads, MLP
8192, vocabulary 128256), or a mixture-of-experts Qwen3-MoE (`--shape qwen3-30b-a3b`: Qwen3-30B-A3B's layout, 128
experts, 8 active, expert MLP 768; `--layers N` keeps its first N layers so that the model and kiln's program fit
one GPU together), one static KV cache of --max-context slots for every contestant (kiln.models.llm's
StaticCacheLM: the same module is exported for kiln and run by PyTorch). Prefill of 128 and 512 tokens; decode of
one token at context 128 and 1024, timed over --steps back-to-back steps per sample. Contestants interleaved round
by round, medians of --repeat rounds, the GPU synchronized at the end of each sample. The roofline is the time to
read what a step must read (every weight once, the KV cache up to the context; of a MoE layer's experts only the
active ones: experts per token / experts of the stacks) at the copy bandwidth measured in the same run. Progress
goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_compare import LLAMA_SIZES  # noqa: E402
from gpu_harness import copy_bandwidth, device_line, gpu_op_times, print_table, time_round_robin  # noqa: E402
from harness import stderr_log  # noqa: E402

CONTESTANTS = ("kiln cuda", "torch eager", "torch.compile")

MOE_SIZES = {
    # Qwen3-30B-A3B's shape (Qwen/Qwen3-30B-A3B config) with random weights
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
                          rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6),
}
"""Mixture-of-experts shapes (transformers' Qwen3MoeConfig), beside cpu_compare's LLAMA_SIZES."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES) + sorted(MOE_SIZES), default="llama-3.2-1b",
                        help="model shape")
    parser.add_argument("--layers", type=int, help="keep the shape's first N layers (default: all)")
    parser.add_argument("--distinct-layers", type=int, metavar="N",
                        help="build only N layers' weights and cycle through them to the full depth (each layer "
                             "its own KV cache; see cycle_layers): a deep shape where its weights do not fit")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--max-context", type=int, default=1280, help="KV-cache slots (default 1280)")
    parser.add_argument("--prefill", default="128,512", help="prefill lengths (default 128,512)")
    parser.add_argument("--decode-at", default="128,1024", help="decode contexts (default 128,1024)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per sample (default 8)")
    parser.add_argument("--repeat", type=int, default=15, help="samples per contestant and case (default 15)")
    parser.add_argument("--torch-experts", default="grouped_mm",
                        help="the torch peers' experts implementation for a MoE shape (transformers' "
                             "set_experts_implementation: grouped_mm, batched_mm or eager; default grouped_mm, its "
                             "fastest on a GPU; the export always traces batched_mm)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out (it compiles for minutes)")
    parser.add_argument("--skip-passes", default="", help="export passes to leave out, comma-separated (A/B runs)")
    parser.add_argument("--program", type=Path, metavar="PATH",
                        help="the exported .kiln file: loaded from PATH when it is there, else exported and saved "
                             "there (A/B runs of runtime changes share one export; same shape, dtype, context and "
                             "prefill lengths, or the file does not fit the run)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write each case's medians (seconds) and roofline to PATH (gpu_ab.py reads it)")
    parser.add_argument("--op-times", type=int, default=0, metavar="N",
                        help="also print the N ops that take the most GPU time in the last prefill and a decode step")
    args = parser.parse_args(argv)
    prefills = [int(t) for t in args.prefill.split(",")]
    contexts = [int(c) for c in args.decode_at.split(",")]

    import cupy as cp
    import numpy as np
    import torch

    dtype = getattr(torch, args.dtype)
    skip = {p for p in args.skip_passes.split(",") if p}
    model, lm, program = llama_program(args.shape, dtype, args.max_context, max(prefills), args.program, skip,
                                       args.layers, args.distinct_layers)
    config = model.config
    torch_experts = ""
    if args.shape in MOE_SIZES:
        model.set_experts_implementation(args.torch_experts)
        torch_experts = f"; torch experts: {args.torch_experts}"
    lm = lm.cuda()
    session = program.session("cuda")
    itemsize = torch.tensor([], dtype=dtype).element_size()
    param_bytes = step_weight_bytes(model)
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * itemsize
    bandwidth = copy_bandwidth(cp)
    stderr_log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {param_bytes / 1e9:.2f} GB")

    compiled_prefill = compiled_decode = None
    if not args.no_compile:
        compiled_prefill = torch.compile(lm.prefill, mode="reduce-overhead", dynamic=False)
        compiled_decode = torch.compile(lm.decode, mode="reduce-overhead", dynamic=False)

    def kiln_calls(method: str, inputs: tuple, steps: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                session.run(method, *inputs)
            cp.cuda.Device().synchronize()
        return run

    def torch_calls(fn: Callable, inputs: tuple, steps: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                for _ in range(steps):
                    fn(*inputs)
            torch.cuda.synchronize()
        return run

    rows = []
    for length in prefills:
        tokens = np.arange(length, dtype=np.int64)[None] % config.vocab_size + 7
        positions = np.arange(length, dtype=np.int64)
        kiln_inputs = prefill_inputs = (cp.asarray(tokens), cp.asarray(positions))
        torch_inputs = (torch.as_tensor(tokens, device="cuda"), torch.as_tensor(positions, device="cuda"))
        cases = {"kiln cuda": kiln_calls("prefill", kiln_inputs, 1),
                 "torch eager": torch_calls(lm.prefill, torch_inputs, 1)}
        if compiled_prefill is not None:
            stderr_log(f"compiling prefill {length}")
            cases["torch.compile"] = torch_calls(compiled_prefill, torch_inputs, 1)
        stderr_log(f"timing prefill {length}")
        medians = time_round_robin(cases, args.repeat)
        flops = 2 * length * param_bytes / itemsize  # (a MoE's active parameters per token)
        rows.append((f"prefill {length} tokens", medians, None, f"{flops / medians['kiln cuda'] / 1e12:.0f} TFLOP/s"))

    for context in contexts:
        token, position = np.array([[42]], dtype=np.int64), np.array([context], dtype=np.int64)
        kiln_inputs = (cp.asarray(token), cp.asarray(position))
        torch_inputs = (torch.as_tensor(token, device="cuda"), torch.as_tensor(position, device="cuda"))
        cases = {"kiln cuda": kiln_calls("decode", kiln_inputs, args.steps),
                 "torch eager": torch_calls(lm.decode, torch_inputs, args.steps)}
        if compiled_decode is not None:
            stderr_log(f"compiling decode at {context}")
            cases["torch.compile"] = torch_calls(compiled_decode, torch_inputs, args.steps)
        stderr_log(f"timing decode at {context}")
        medians = {k: v / args.steps for k, v in time_round_robin(cases, args.repeat).items()}
        roofline = (param_bytes + kv_bytes_per_token * context) / bandwidth
        rows.append((f"decode at {context}", medians, roofline, f"{1 / medians['kiln cuda']:.0f} tok/s"))

    # agreement: the last decode's logits, kiln vs eager
    with torch.inference_mode():
        want = lm.decode(*torch_inputs).float().cpu().numpy()
    got = cp.asnumpy(session.run("decode", *kiln_inputs)[0]).astype(np.float32)
    agreement = (f"kiln vs eager, last decode logits: max |diff| {np.abs(got - want).max():.3g} "
                 f"(logit scale {np.abs(want).max():.3g}), same argmax: {bool(got.argmax() == want.argmax())}")

    header = ["case"] + [f"{c} ms" for c in CONTESTANTS] + ["kiln/eager", "kiln/compile", "roofline ms",
                                                              "kiln % roofline", "kiln rate"]
    body = []
    for name, medians, roofline, rate in rows:
        cells = [name] + [f"{medians[c] * 1e3:.3f}" if c in medians else "-" for c in CONTESTANTS]
        cells.append(f"{medians['kiln cuda'] / medians['torch eager']:.2f}")
        cells.append(f"{medians['kiln cuda'] / medians['torch.compile']:.2f}" if "torch.compile" in medians else "-")
        cells.append(f"{roofline * 1e3:.3f}" if roofline else "-")
        cells.append(f"{100 * roofline / medians['kiln cuda']:.0f}%" if roofline else "-")
        cells.append(rate)
        body.append(cells)
    layers = f" ({config.num_hidden_layers} layers)" if args.layers or args.distinct_layers else ""
    layers += f", weights of {args.distinct_layers} layers cycled" if args.distinct_layers else ""
    print(f"{args.shape}{layers}, {args.dtype}, random weights, KV cache {args.max_context} slots, on "
          f"{device_line(cp, torch)} (copy bandwidth {bandwidth / 1e12:.2f} TB/s); medians of {args.repeat}, "
          f"decode over {args.steps} steps per sample{torch_experts}"
          + (f"; passes skipped: {sorted(skip)}" if skip else ""))
    print_table(body, header, args.markdown)
    print(agreement)
    if args.json:
        write_results(args.json, rows)
    if args.op_times:
        print(gpu_op_times(program, cp, "prefill", prefill_inputs, args.op_times))
        print(gpu_op_times(program, cp, "decode", kiln_inputs, args.op_times))
    host_ops = sorted(session.backend.host_ops) or "none"
    print(f"kiln: graphs captured per method {session.captured_graphs}; ops on the host: {host_ops}")
    return 0


def step_weight_bytes(model) -> int:
    """Bytes of weights one token's step reads: every parameter, but of a stack of E experts (a 3-d parameter of a
    MoE layer's experts) only the k a token is routed to, and of an input embedding table not tied to the LM head
    one row (a step looks up one token; before the thirteenth stop the whole table was counted). Each decoder layer
    counts its own parameters, so cycle_layers' shared weights count once per layer that reads them; everything
    else once (a tied embedding and LM head are one table)."""
    config = model.config
    experts, active = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    embedding = model.get_input_embeddings().weight
    untied = embedding is not model.get_output_embeddings().weight

    def read(p) -> int:
        nbytes = p.numel() * p.element_size()
        if untied and p is embedding:
            nbytes //= p.shape[0]
        return nbytes * active // experts if experts and p.ndim == 3 and p.shape[0] == experts else nbytes

    layers = model.model.layers
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    return (sum(read(p) for p in model.parameters() if id(p) not in in_layers)
            + sum(read(p) for layer in layers for p in layer.parameters()))


def llama_program(shape: str, dtype, max_context: int, prefill_chunk: int, path: Path | None = None,
                  skip_passes: set[str] | frozenset[str] = frozenset(), layers: int | None = None,
                  distinct_layers: int | None = None, quantize=None) -> tuple:
    """(model, lm, program): a random-weight Llama (or, for a MOE_SIZES shape, Qwen3-MoE) of `shape` (seed 0;
    `layers`: its first N layers; `distinct_layers`: see cycle_layers) on the CPU, its StaticCacheLM and the loaded
    export of that (weights quantized by `quantize`, a kiln.export.Quantize, when given), read from `path` when it
    is there (else exported and, with a path, saved there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    import kiln
    from kiln.models.llm import StaticCacheLM, export_llama

    torch.manual_seed(0)
    moe = shape in MOE_SIZES
    sizes = {**(MOE_SIZES if moe else LLAMA_SIZES)[shape], **({"num_hidden_layers": layers} if layers else {})}
    config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (LlamaConfig, LlamaForCausalLM)
    depth = sizes["num_hidden_layers"]
    if distinct_layers:
        sizes["num_hidden_layers"] = min(distinct_layers, depth)
    config = config_class(**sizes, attn_implementation="sdpa")
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = model_class(config).to(dtype).eval()
    if distinct_layers and depth > distinct_layers:
        cycle_layers(model, depth)
    lm = StaticCacheLM(model.cpu(), max_context, prefill_chunk).eval()
    stderr_log(f"model built in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    if path is not None and path.exists():
        program = kiln.load(path)
        stderr_log(f"loaded {path} in {time.perf_counter() - t0:.1f} s")
    else:
        exported = export_llama(lm, max_context, prefill_chunk, skip_passes=skip_passes, quantize=quantize)
        program = kiln.load(exported.save(path)) if path is not None else exported.load()
        stderr_log(f"exported in {time.perf_counter() - t0:.1f} s")
    return model, lm, program


def cycle_layers(model, depth: int) -> None:
    """Deepen `model` to `depth` decoder layers whose weights cycle through its own: layer i is a copy of layer
    i % N sharing that layer's parameters, with its own layer index (so its own KV cache). A full-depth step then
    fits where the full-depth weights do not (Qwen3-30B-A3B's 48 layers are 61 GB in bfloat16, and the run holds the
    torch peers beside the program): every layer still does its own work and its weights still come from DRAM, since
    a layer's weights are read again only after the N - 1 other layers' (~110 MB each for that shape, far past a
    GPU's 50-60 MB of L2) have gone through. A run at a depth the full weights fit tells whether that holds."""
    import copy

    layers = model.model.layers
    distinct = len(layers)
    for i in range(distinct, depth):
        source = layers[i % distinct]
        shared = (*source.parameters(), *source.buffers(), model.config)  # (the config too: one experts switch)
        layer = copy.deepcopy(source, memo={id(t): t for t in shared})
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = i
        layers.append(layer)
    model.config.num_hidden_layers = depth
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i % distinct] for i in range(depth)]


def write_results(path: Path, rows: list[tuple]) -> None:
    """{case: {"medians": {contestant: seconds}, "roofline": seconds or null}} as JSON."""
    path.write_text(json.dumps({name: {"medians": medians, "roofline": roofline}
                                for name, medians, roofline, _ in rows}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
