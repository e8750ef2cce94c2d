"""A mixture-of-experts decoder on the CPU: kiln's gathered experts against the same program with the experts'
weights gathered out per row, and against PyTorch eager with transformers' own experts implementations.

    .venv/bin/python benchmarks/moe_cpu.py [--threads 1] [--rounds 10] [--steps 8] [--markdown]

A random-weight Qwen3-MoE of a reduced shape (`--layers`, d 512, 64 experts, 8 active, expert MLP 256, 8/2
heads, vocabulary 32000: the Qwen3-30B-A3B layout at about a fiftieth of its width) exported twice: as the export
makes it (each layer's experts two gathered_linear nodes, reading only the picked experts' weights) and without the
fuse_experts pass (index + matmul: each row's expert weight copied out, then a batched product, transformers'
"batched_mm" as traced). Decode at context 128 and prefill of 128 tokens, contestants interleaved round by round,
medians; eager runs StaticCacheLM with the experts as transformers' "grouped_mm" (its default here) and "eager"
(the loop over the experts hit). Greedy tokens of every contestant are compared first. The decode step's bytes
are what it must read (attention, router, 8 experts a layer, the LM head and one embedding row), as GB/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness import configure_threads, machine_report, print_table, start_torch, time_round_robin  # noqa: E402

SHAPE = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 64,
         "num_experts_per_tok": 8, "moe_intermediate_size": 256, "intermediate_size": 1024, "vocab_size": 32000,
         "norm_topk_prob": True, "tie_word_embeddings": False}


def step_bytes(config) -> int:
    """float32 bytes a decode step must read: attention, router, the active experts, norms, LM head, one row."""
    d, e = config.hidden_size, config.head_dim
    attention = d * e * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    experts = config.num_experts_per_tok * 3 * d * config.moe_intermediate_size
    per_layer = attention + d * config.num_experts + experts + 2 * d
    return 4 * (config.num_hidden_layers * per_layer + config.vocab_size * d + 2 * d)



PYTHON_PLAN = "kiln, Python plan (no native executor)"
MLX_COMPOSED = "kiln mlx, experts dequantized (no gather_qmm)"


class MLXSession:
    """An mlx session whose runs wait for their results (MLX evaluates lazily: a step is timed to its end) and
    whose plans are built without the preparers named in `without` (the composed kernels' A/B in one process)."""

    def __init__(self, session, without: tuple[str, ...] = ()):
        self.session, self.without = session, without

    def run(self, method: str, *args):
        from kiln.runtime.backends.mlx.prepare import PREPARERS

        held = {op: PREPARERS.preparers.pop(op) for op in self.without if op in PREPARERS.preparers}
        try:
            return [self.session.backend.to_numpy(o) for o in self.session.run(method, *args)]
        finally:
            PREPARERS.preparers.update(held)

    def __getattr__(self, name: str):
        return getattr(self.session, name)


class PythonPlan:
    """A session whose plans are built with KILN_EXECUTOR=python (each run sets it, so plans built on a later first
    run of a new signature are Python plans too): the native executor's A/B in the same process."""

    def __init__(self, session):
        self.session = session

    def __getattr__(self, name: str):
        attribute = getattr(self.session, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            before = os.environ.get("KILN_EXECUTOR")
            os.environ["KILN_EXECUTOR"] = "python"
            try:
                return attribute(*args, **kwargs)
            finally:
                if before is None:
                    del os.environ["KILN_EXECUTOR"]
                else:
                    os.environ["KILN_EXECUTOR"] = before
        return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="compute threads for every contestant (default 1)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round (default 8)")
    parser.add_argument("--quantize", choices=("int8", "int4"),
                        help="quantize kiln's weights (experts included; int4 in groups of 32); eager stays float32")
    parser.add_argument("--mlx", action="store_true",
                        help="also kiln's mlx backend (MLX's CPU build here); with --quantize, also with the quantized "
                             "experts composed (dequantized picked experts) instead of mx.gather_qmm")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    torch = start_torch(args.threads)
    import numpy as np
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from kiln.export import Quantize
    from kiln.models.llm import StaticCacheLM, export_llama
    from kiln.runtime.llm.decoding import greedy_generate

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**SHAPE, num_hidden_layers=args.layers, max_position_embeddings=256)
    model = Qwen3MoeForCausalLM(config).eval()
    max_context, chunk, context = 256, 128, 128
    sessions = {}
    for name, skip in (("kiln", ()), ("kiln, experts gathered out", ("fuse_experts",))):
        t0 = time.perf_counter()
        quantize = None if args.quantize is None else Quantize(args.quantize,
                                                                group_size=32 if args.quantize == "int4" else None)
        program = export_llama(model, max_context, chunk, skip_passes=skip, quantize=quantize).load()
        print(f"{name}: exported in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        sessions[name] = program.session("cpu")
        if not skip:  # the same program with its plans built for the Python loop (KILN_EXECUTOR=python)
            sessions[PYTHON_PLAN] = PythonPlan(program.session("cpu"))
        if not skip and args.mlx:
            sessions["kiln mlx"] = MLXSession(program.session("mlx"))
            if args.quantize:
                sessions[MLX_COMPOSED] = MLXSession(program.session("mlx"), without=("gathered_quantized_linear",))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, context).astype(np.int64)
    eagers = {}
    for implementation in ("grouped_mm", "eager"):
        model.set_experts_implementation(implementation)
        eagers[f"eager ({implementation})"] = (implementation, StaticCacheLM(model, max_context, chunk))

    answers = {name: greedy_generate(s, prompt[:16].tolist(), 8) for name, s in sessions.items()}
    if args.quantize:  # the quantized contestants agree with each other, not with the float32 eager model
        reference = answers["kiln"]
        for name in sessions:
            print(f"greedy 8 tokens, {name}: {'same as kiln (cpu)' if answers[name] == reference else answers[name]}")
    for name, (implementation, lm) in eagers.items():
        model.set_experts_implementation(implementation)
        lm.reset()
        tokens, out = prompt[:16].tolist(), []
        with torch.no_grad():
            logits = lm.prefill(torch.tensor([tokens]), torch.arange(len(tokens)))
            for k in range(8):
                out.append(int(logits.argmax()))
                logits = lm.decode(torch.tensor([[out[-1]]]), torch.tensor([len(tokens) + k]))
        answers[name] = out
    reference = answers["eager (eager)"]
    for name, tokens in answers.items():
        print(f"greedy 8 tokens, {name}: {'same as eager (eager)' if tokens == reference else tokens}")

    token, position = np.array([[7]], np.int64), np.array([context], np.int64)
    for s in sessions.values():
        s.reset_state()
        s.run("prefill", prompt[None, :], np.arange(context))

    def kiln_decode(s=None):
        for _ in range(args.steps):
            s.run("decode", token, position)

    def kiln_prefill(s=None):
        s.run("prefill", prompt[None, :], np.arange(context))

    def eager_step(entry, prefill_run: bool):
        implementation, lm = entry
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            if prefill_run:
                lm.prefill(torch.from_numpy(prompt[None, :]), torch.arange(context))
            else:
                for _ in range(args.steps):
                    lm.decode(torch.tensor([[7]]), torch.tensor([context]))

    decode = {name: (lambda s=s: kiln_decode(s)) for name, s in sessions.items()}
    decode.update({name: (lambda e=e: eager_step(e, False)) for name, e in eagers.items()})
    prefill = {name: (lambda s=s: kiln_prefill(s)) for name, s in sessions.items()}
    prefill.update({name: (lambda e=e: eager_step(e, True)) for name, e in eagers.items()})
    decode_s = {k: v / args.steps for k, v in time_round_robin(decode, args.rounds, warmup=1).items()}
    prefill_s = time_round_robin(prefill, max(3, args.rounds // 2), warmup=1)
    nbytes = step_bytes(config)
    machine = machine_report()
    print(f"Qwen3-MoE shape ({args.layers} layers, d {config.hidden_size}, {config.num_experts} experts, "
          f"{config.num_experts_per_tok} active, expert MLP {config.moe_intermediate_size}), "
          f"{'kiln ' + args.quantize + ', eager float32' if args.quantize else 'float32'}, "
          f"{args.threads} thread(s), {machine['cpu']}; decode at context {context} (a step reads "
          f"{nbytes / 1e6:.1f} MB), prefill of {context} tokens; medians of {args.rounds} rounds")
    header = ["contestant", "decode ms", "tokens/s", "GB/s", "x eager (grouped_mm)", "prefill ms", "prefill tok/s"]
    base = decode_s["eager (grouped_mm)"]
    body = [[name, f"{decode_s[name] * 1e3:.2f}", f"{1 / decode_s[name]:.1f}", f"{nbytes / decode_s[name] / 1e9:.1f}",
             f"{base / decode_s[name]:.2f}x", f"{prefill_s[name] * 1e3:.1f}", f"{context / prefill_s[name]:.0f}"]
            for name in decode_s]
    print_table(body, header, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
