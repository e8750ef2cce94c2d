r"""llama.cpp's prefill and decode speed on a random-weight Llama, per weight type: the peer for kiln's GPU LLM numbers.

    python3 benchmarks/gpu_llamacpp.py --bin LLAMA_CPP/build/bin --shape llama-3.2-1b --types F16,Q8_0,Q4_0 \
        --work /tmp/llcpp [--prompt 128] [--gen 128] [--depth 0] [--repeat 5] [--ngl 99] [--flash-attn 1] \
        [--pure] [--markdown] [--json PATH]

Writes a GGUF of the shape (cpu_compare.LLAMA_SIZES, the shapes kiln's benchmarks use) in F16 with seeded random
weights (normal, std 0.02; norms ones) and a synthetic SentencePiece vocabulary, quantizes it to each other type
with llama-quantize, then runs llama-bench on each file: prefill is its ppN test (N prompt tokens in one batch),
decode its tgN test (N tokens one at a time, starting at --depth tokens of context), both as llama-bench's mean
tokens/s over --repeat runs after a warm-up. Files are kept in --work and reused when their recorded shape and seed
match. By default llama-quantize keeps its usual mixture (a Q4_0 file stores the output/tied embedding matrix as
Q6_K); --pure quantizes every matrix to the named type. llama-bench and llama-quantize come from a CUDA build of
benchmarks/llamacpp_source.sh's tarball (its header has the cmake lines). Progress goes to stderr, the table to
stdout; the weights' values do not change the time of a dense model.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # kiln.runtime.bench for the text table

from cpu_compare import LLAMA_SIZES  # noqa: E402
from gpu_harness import print_table  # noqa: E402
from harness import stderr_log  # noqa: E402

# LlamaConfig's defaults for what a LLAMA_SIZES entry may leave out
DEFAULTS = dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False)
STD = 0.02


def find_gguf(bin_dir: Path) -> str:
    """Make `import gguf` work: the installed package, else the gguf-py beside the llama.cpp tree that holds
    --bin (llamacpp_source.sh keeps it; the GPU machine's Python has no `gguf` and cannot pip install)."""
    try:
        import gguf
    except ImportError:
        for parent in bin_dir.resolve().parents:
            if (parent / "gguf-py" / "gguf" / "__init__.py").exists():
                sys.path.insert(0, str(parent / "gguf-py"))
                break
        else:
            sys.exit(f"no `gguf` package installed and no gguf-py/ in a folder above {bin_dir}")
        import gguf
    return str(Path(gguf.__file__).parent)


def hyperparameters(shape: str) -> dict:
    """The shape's config with LlamaConfig's defaults filled in and the derived sizes (head_dim, KV heads)."""
    cfg = {**DEFAULTS, **LLAMA_SIZES[shape]}
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def tensor_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor of llama.cpp's "llama" architecture, in file order. Matrices are
    [out, in] as in PyTorch (GGUF stores the dimensions reversed); 1-D tensors are the RMSNorm weights."""
    d, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    yield "token_embd.weight", (cfg["vocab_size"], d)
    for i in range(cfg["num_hidden_layers"]):
        yield f"blk.{i}.attn_norm.weight", (d,)
        yield f"blk.{i}.attn_q.weight", (q, d)
        yield f"blk.{i}.attn_k.weight", (kv, d)
        yield f"blk.{i}.attn_v.weight", (kv, d)
        yield f"blk.{i}.attn_output.weight", (d, q)
        yield f"blk.{i}.ffn_norm.weight", (d,)
        yield f"blk.{i}.ffn_gate.weight", (ff, d)
        yield f"blk.{i}.ffn_up.weight", (ff, d)
        yield f"blk.{i}.ffn_down.weight", (d, ff)
    yield "output_norm.weight", (d,)
    if not cfg["tie_word_embeddings"]:
        yield "output.weight", (cfg["vocab_size"], d)


def _random_f16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal(0, STD) as float16, drawn 16M values at a time so that an 8B model's embedding (525M values) costs its
    1 GB of float16 and no float32/float64 copy of it."""
    out = np.empty(shape, np.float16)
    flat = out.reshape(-1)
    step = 1 << 24
    for start in range(0, flat.size, step):
        chunk = rng.standard_normal(min(step, flat.size - start), dtype=np.float32)
        chunk *= STD
        flat[start : start + chunk.size] = chunk
    return out


def _add_vocabulary(writer, vocab_size: int) -> None:
    """A SentencePiece ("llama") vocabulary llama.cpp accepts: <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF>
    (its SPM tokenizer looks up "<0x0A>" for the newline) and made-up word pieces for the rest."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(vocab_size - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (vocab_size - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab_size - 259)])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)


def write_f16(path: Path, shape: str, seed: int) -> None:
    """The F16 GGUF, streamed one tensor at a time (header and tensor table first, then each tensor as it is drawn),
    so the peak memory is the largest tensor, not the model. Written to a temporary name and renamed when whole."""
    import gguf

    cfg = hyperparameters(shape)
    tmp = path.with_suffix(".part")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"kiln random {shape}")
    writer.add_string("kiln.shape", _identity(shape, seed))
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_vocabulary(writer, cfg["vocab_size"])
    shapes = list(tensor_shapes(cfg))
    for name, dims in shapes:
        dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in shapes:
        writer.write_tensor_data(np.ones(dims, np.float32) if len(dims) == 1 else _random_f16(rng, dims))
    writer.close()
    tmp.rename(path)


def _identity(shape: str, seed: int) -> str:
    return json.dumps({"shape": shape, "seed": seed, **hyperparameters(shape)}, sort_keys=True)


def _recorded_identity(path: Path) -> str | None:
    """The kiln.shape string a GGUF of ours carries (llama-quantize copies it), or None. Remembered per file
    version: reading a 128k-token vocabulary takes seconds, and the F16 file is checked once per quantized type."""
    stat = path.stat()
    return _read_identity(path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _read_identity(path: Path, mtime_ns: int, size: int) -> str | None:
    import gguf

    try:
        field = gguf.GGUFReader(path).fields.get("kiln.shape")
        return None if field is None else str(field.contents())
    except Exception:  # a truncated or foreign file: rewrite it
        return None


def model_file(work: Path, shape: str, kind: str, seed: int, bin_dir: Path, pure: bool) -> Path:
    """The GGUF of `shape` in `kind` (F16 written here, others by llama-quantize from it), reused when present."""
    path = work / f"{shape}-{kind}{'-pure' if pure and kind != 'F16' else ''}.gguf"
    if path.exists() and _recorded_identity(path) == _identity(shape, seed):
        stderr_log(f"reusing {path} ({path.stat().st_size / 1e9:.2f} GB)")
        return path
    start = time.perf_counter()
    if kind == "F16":
        stderr_log(f"writing {path} (random weights, seed {seed})")
        write_f16(path, shape, seed)
    else:
        source = model_file(work, shape, "F16", seed, bin_dir, pure)
        stderr_log(f"quantizing {source.name} -> {path.name}")
        tmp = path.with_suffix(".part")
        command = [str(bin_dir / "llama-quantize"), *(["--pure"] if pure else []), str(source), str(tmp), kind,
                   str(os.cpu_count() or 1)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        tmp.rename(path)
    stderr_log(f"  {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s")
    return path


def bench(bin_dir: Path, path: Path, args: argparse.Namespace) -> list[dict]:
    """llama-bench's JSON records for one file: a ppN and a tgN record per flash-attention setting."""
    command = [str(bin_dir / "llama-bench"), "-m", str(path), "-p", str(args.prompt), "-n", str(args.gen),
               "-d", str(args.depth), "-ngl", str(args.ngl), "-r", str(args.repeat), "-fa", args.flash_attn,
               "-o", "json"]
    stderr_log(" ".join(command))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"llama-bench failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def rows_of(kind: str, path: Path, records: list[dict], pure: bool) -> list[dict]:
    """One row per flash-attention setting: the prefill (n_gen 0) and decode (n_prompt 0) records side by side."""
    rows = []
    for fa in dict.fromkeys(r["flash_attn"] for r in records):
        pp = next(r for r in records if r["flash_attn"] == fa and r["n_gen"] == 0)
        tg = next(r for r in records if r["flash_attn"] == fa and r["n_prompt"] == 0)
        rows.append({"type": kind + ("-pure" if pure and kind != "F16" else ""), "flash_attn": fa,
                     "file_bytes": path.stat().st_size, "model_size": tg["model_size"],
                     "model_n_params": tg["model_n_params"], "n_prompt": pp["n_prompt"], "n_gen": tg["n_gen"],
                     "n_depth": tg["n_depth"], "prefill_tok_s": pp["avg_ts"], "prefill_stddev": pp["stddev_ts"],
                     "decode_tok_s": tg["avg_ts"], "decode_stddev": tg["stddev_ts"],
                     "decode_ms": 1e3 / tg["avg_ts"],
                     **{k: tg[k] for k in ("build_commit", "build_number", "backends", "gpu_info", "cpu_info",
                                           "n_gpu_layers", "n_threads", "n_batch", "n_ubatch", "type_k", "type_v")}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, required=True, help="folder with llama-bench and llama-quantize")
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES), default="llama-3.2-1b", help="model shape")
    parser.add_argument("--types", default="F16,Q8_0,Q4_0", help="llama-quantize types (default F16,Q8_0,Q4_0)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/llcpp"), help="GGUF files, kept and reused")
    parser.add_argument("--prompt", type=int, default=128, help="prefill tokens (default 128)")
    parser.add_argument("--gen", type=int, default=128, help="decode tokens (default 128)")
    parser.add_argument("--depth", type=int, default=0, help="context already in the KV cache (default 0)")
    parser.add_argument("--repeat", type=int, default=5, help="llama-bench repetitions (default 5)")
    parser.add_argument("--ngl", type=int, default=99, help="layers on the GPU (default 99: all; 0: CPU)")
    parser.add_argument("--flash-attn", default="1", help="llama-bench -fa values, comma list of 0/1 (default 1)")
    parser.add_argument("--pure", action="store_true", help="llama-quantize --pure: every matrix in the type")
    parser.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--json", type=Path, help="write the rows (and llama-bench's build fields) here")
    args = parser.parse_args(argv)

    stderr_log(f"gguf from {find_gguf(args.bin)}")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in args.types.split(","):
        path = model_file(args.work, args.shape, kind, args.seed, args.bin, args.pure)
        rows += rows_of(kind, path, bench(args.bin, path, args), args.pure)

    first = rows[0]
    cfg = hyperparameters(args.shape)
    print(f"llama.cpp {first['build_commit']} (build {first['build_number']}, {first['backends']}), "
          f"{first['gpu_info'] or first['cpu_info']}, -ngl {args.ngl}, {args.shape} random weights "
          f"({first['model_n_params'] / 1e6:.0f}M params, vocab {cfg['vocab_size']}), prefill pp{args.prompt}, "
          f"decode tg{args.gen} at depth {args.depth}, mean of {args.repeat} run(s)")
    header = ("type", "fa", "file GB", "prefill tok/s", "decode tok/s", "decode ms/token")
    body = [(r["type"], str(r["flash_attn"]), f"{r['file_bytes'] / 1e9:.3f}",
             f"{r['prefill_tok_s']:.0f} ± {r['prefill_stddev']:.0f}",
             f"{r['decode_tok_s']:.1f} ± {r['decode_stddev']:.1f}", f"{r['decode_ms']:.3f}") for r in rows]
    print_table(body, header, args.markdown)
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "config": cfg, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
