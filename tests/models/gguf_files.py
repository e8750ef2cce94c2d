"""Small GGUF files of any quantized type, written with the gguf package: for the exporter's GGUF tests.

Types the gguf package can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from random weights; the others
(the K-quants, IQ4_NL, ...) are random blocks whose float16 scale fields are set to small positive values, which is
all a block's layout needs to be a valid weight (every bit pattern of the codes and sub-scales is one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FLOAT16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                  "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
"""Byte offsets of each block's float16 scales (and mins)."""


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks of a quantized [rows, k] tensor (uint8 [rows, bytes per row]) with sane scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    for at in FLOAT16_FIELDS[type_name]:
        scales = rng.uniform(0.0002, 0.002, len(blocks)).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def quantized(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A [rows, k] tensor's raw blocks: quantized by the gguf package where it can, else random_blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        return gguf.quants.quantize((rng.standard_normal((rows, k)) * 0.05).astype(np.float32), qtype)
    except NotImplementedError:
        return random_blocks(type_name, rows, k, rng)


LLAMA_TYPES = {"embd": "Q8_0", "q": "Q4_K", "k": "Q4_K", "v": "Q6_K", "o": "Q4_K", "gate": "Q4_K", "up": "Q4_K",
               "down": "Q6_K"}
"""What llama.cpp's Q4_K_M puts where (roughly): Q6_K for the value and down projections of some layers."""


def write_llama(path: Path, types: dict[str, str] | None = None, d: int = 256, ff: int = 512, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, vocab: int = 64, seed: int = 0) -> Path:
    """A Llama GGUF as llama.cpp lays one out (its tensor names and metadata, a SentencePiece-style vocabulary)
    that transformers loads; `types` picks each weight's type by role (LLAMA_TYPES' keys, plus "out" for an untied
    output.weight). Rows are 256 wide so that every K-quant fits."""
    import gguf

    types = {**LLAMA_TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(d)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_rope_dimension_count(d // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(vocab - 3)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def weight(name: str, rows: int, k: int, role: str) -> None:
        kind = types[role]
        if kind == "F32":
            writer.add_tensor(name, (rng.standard_normal((rows, k)) * 0.05).astype(np.float32))
            return
        data = quantized(kind, rows, k, rng)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    weight("token_embd.weight", vocab, d, "embd")
    kv = kv_heads * d // heads
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for part, rows, k in (("q", d, d), ("k", kv, d), ("v", kv, d), ("o", d, d), ("gate", ff, d), ("up", ff, d),
                              ("down", d, ff)):
            gguf_name = {"o": "attn_output", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}.get(
                part, f"attn_{part}")
            weight(f"blk.{i}.{gguf_name}.weight", rows, k, part)
    norm("output_norm.weight")
    if "out" in types:
        weight("output.weight", vocab, d, "out")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen_moe(path: Path, expert_type: str = "Q8_0", arch: str = "qwen3moe", d: int = 256, ff: int = 256,
                   experts: int = 8, used: int = 2, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                   vocab: int = 64, seed: int = 0) -> Path:
    """A Qwen MoE GGUF as llama.cpp lays one out: the router as ffn_gate_inp, the experts as [E, ff, d] / [E, d, ff]
    stacks ffn_{gate,up,down}_exps in `expert_type`, attention in Q8_0, a GPT-2-style vocabulary. "qwen3moe" (the
    Qwen3-30B-A3B files people run with llama.cpp) has q/k norms; "qwen2moe" has q/k/v biases and a shared expert
    (ffn_*_shexp, 2 ff wide, with its sigmoid gate ffn_gate_inp_shexp)."""
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = d // heads
    qwen2 = arch == "qwen2moe"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(128)
    writer.add_embedding_length(d)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_expert_feed_forward_length(ff)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    if qwen2:
        writer.add_expert_shared_feed_forward_length(2 * ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab - 2)] + ["<|im_start|>", "<|im_end|>"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)

    def tensor(name: str, shape: tuple[int, ...], kind: str) -> None:
        rows, k = int(np.prod(shape[:-1])), shape[-1]
        if kind == "F32":
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
            return
        data = quantized(kind, rows, k, rng).reshape(*shape[:-1], -1)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    def norm(name: str, size: int = d) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    tensor("token_embd.weight", (vocab, d), "Q8_0")
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        if qwen2:
            for name, size in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                               ("attn_v", kv_heads * head_dim)):
                writer.add_tensor(f"blk.{i}.{name}.bias", (0.05 * rng.standard_normal(size)).astype(np.float32))
            writer.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", (0.05 * rng.standard_normal(d)).astype(np.float32))
            tensor(f"blk.{i}.ffn_gate_shexp.weight", (2 * ff, d), "Q8_0")
            tensor(f"blk.{i}.ffn_up_shexp.weight", (2 * ff, d), "Q8_0")
            tensor(f"blk.{i}.ffn_down_shexp.weight", (d, 2 * ff), "Q8_0")
        else:
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        for name, shape in (("attn_q", (heads * head_dim, d)), ("attn_k", (kv_heads * head_dim, d)),
                            ("attn_v", (kv_heads * head_dim, d)), ("attn_output", (d, heads * head_dim))):
            tensor(f"blk.{i}.{name}.weight", shape, "Q8_0")
        tensor(f"blk.{i}.ffn_gate_inp.weight", (experts, d), "F32")
        tensor(f"blk.{i}.ffn_gate_exps.weight", (experts, ff, d), expert_type)
        tensor(f"blk.{i}.ffn_up_exps.weight", (experts, ff, d), expert_type)
        tensor(f"blk.{i}.ffn_down_exps.weight", (experts, d, ff), expert_type)
    norm("output_norm.weight")
    tensor("output.weight", (vocab, d), "Q8_0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
