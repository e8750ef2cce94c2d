"""A/B of export passes on a gpt-oss decoder: the same model exported with every pass and without the named ones,
decode steps timed interleaved in one process.

    .venv/bin/python benchmarks/gpt_oss_pass_ab.py [--without fuse_rope] [--eager-attention] [--backend cpu]
        [--layers 4] [--rounds 10]

A random-weight GptOssForCausalLM of a reduced shape (d 512, 8/2 heads of 64, 32 experts, 4 active, expert MLP 512,
vocabulary 32000), float32, decode at context 128. Passes worth an A/B here: fuse_rope (gpt-oss's rotation in halves:
9 nodes a rotation without it, one rope node with it) and fuse_router (its router's top-k of the logits and their
softmax: one route_experts node with it, which fuse_router_norm then folds with the norm and router linear before
it). --eager-attention exports the second side with transformers' own attention function (scores, mask, a sink
column, max, softmax, the column dropped, the product) instead of kiln's sdpa with sinks (--without "" for that
alone). Greedy tokens of both are compared first, then the medians of the interleaved rounds; the table counts the
decode step's nodes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness import configure_threads, machine_report, print_table, start_torch, time_round_robin  # noqa: E402

SHAPE = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
         "num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 512, "vocab_size": 32000,
         "sliding_window": 128, "max_position_embeddings": 256}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--without", default="fuse_rope",
                        help="the passes the B side leaves out, comma-separated (default fuse_rope)")
    parser.add_argument("--eager-attention", action="store_true",
                        help="the second side's attention as transformers' eager function, not kiln's sdpa with sinks")
    parser.add_argument("--backend", default="cpu", help="kiln backend (default cpu)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads (default 1)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round (default 8)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    torch = start_torch(args.threads)
    import numpy as np
    from transformers import GptOssConfig, GptOssForCausalLM

    from kiln.models.llm import StaticCacheLM, export_llama
    from kiln.runtime.llm.decoding import greedy_generate

    torch.manual_seed(0)
    layer_types = [("sliding_attention", "full_attention")[i % 2] for i in range(args.layers)]
    config = GptOssConfig(**SHAPE, num_hidden_layers=args.layers, layer_types=layer_types)
    model = GptOssForCausalLM(config).eval()
    max_context, chunk, context = 256, 128, 128
    skipped = tuple(p for p in args.without.split(",") if p)
    other = ", ".join(skipped + (("kiln's sdpa with sinks",) if args.eager_attention else ()))
    sessions, nodes = {}, {}
    for name, skip, eager in (("every pass", (), False), (f"without {other}", skipped, args.eager_attention)):
        lm = StaticCacheLM(model, max_context, chunk)
        lm.sink_attention = not eager  # (False: transformers' eager attention)
        program = export_llama(lm, max_context, chunk, skip_passes=skip).load()
        nodes[name] = len(program.ir.methods["decode"].nodes)
        sessions[name] = program.session(args.backend)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, context).astype(np.int64)
    answers = {name: greedy_generate(s, prompt[:16].tolist(), 8) for name, s in sessions.items()}
    if len({tuple(a) for a in answers.values()}) != 1:
        print(f"greedy tokens differ: {answers}")
        return 1
    token, position = np.array([[7]], np.int64), np.array([context], np.int64)
    for s in sessions.values():
        s.reset_state()
        s.run("prefill", prompt[None, :], np.arange(context))

    def decode(s) -> None:
        for _ in range(args.steps):
            s.run("decode", token, position)

    seconds = time_round_robin({name: (lambda s=s: decode(s)) for name, s in sessions.items()}, args.rounds, warmup=1)
    print(f"gpt-oss shape ({args.layers} layers, d {config.hidden_size}, {config.num_local_experts} experts, "
          f"{config.num_experts_per_tok} active), float32, kiln {args.backend}, {args.threads} thread(s), "
          f"{machine_report()['cpu']}; decode at context {context}, medians of {args.rounds} rounds of {args.steps} "
          f"steps; greedy tokens equal")
    base = seconds[f"without {other}"]
    body = [[name, str(nodes[name]), f"{seconds[name] / args.steps * 1e3:.3f}", f"{base / seconds[name]:.2f}x"]
            for name in sessions]
    print_table(body, ["export", "decode nodes", "decode ms", "speed-up"], args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
