"""Writes a transformers Whisper model as a faster-whisper (CTranslate2) folder, the way its converter lays the
weights out (q/k/v stacked, the k bias as zeros, cross-attention k/v stacked, the LM head an alias), so the tests
can check kiln's reader against a model whose every weight is known."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

CODES = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3,
         np.dtype(np.float16): 4}


def _text(value: str) -> bytes:
    data = value.encode() + b"\0"
    return struct.pack("<H", len(data)) + data


def write_model_bin(path: Path, spec: str, variables: dict[str, np.ndarray], aliases: dict[str, str],
                    version: int = 6) -> None:
    out = [struct.pack("<I", version), _text(spec), struct.pack("<II", 3, len(variables))]
    for name, value in variables.items():
        value = np.ascontiguousarray(value)
        out += [_text(name), struct.pack("<B", value.ndim), struct.pack(f"<{value.ndim}I", *value.shape),
                struct.pack("<BI", CODES[value.dtype], value.nbytes), value.tobytes()]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [_text(alias), _text(target)]
    path.write_bytes(b"".join(out))


def whisper_variables(model, dtype=np.float16) -> dict[str, np.ndarray]:
    """The WhisperSpec variables of a transformers Whisper model, weights in `dtype`."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    d = model.config.d_model
    out: dict[str, np.ndarray] = {}

    def put(name: str, value: np.ndarray) -> None:
        out[name] = value.astype(dtype)

    def linear(ours: str, theirs: str) -> None:
        put(f"{ours}/weight", sd[f"{theirs}.weight"])
        put(f"{ours}/bias", sd[f"{theirs}.bias"])

    def norm(ours: str, theirs: str) -> None:
        put(f"{ours}/gamma", sd[f"{theirs}.weight"])
        put(f"{ours}/beta", sd[f"{theirs}.bias"])

    def stacked(ours: str, theirs: str, parts: str) -> None:
        put(f"{ours}/weight", np.concatenate([sd[f"{theirs}.{p}_proj.weight"] for p in parts]))
        put(f"{ours}/bias", np.concatenate([sd.get(f"{theirs}.{p}_proj.bias", np.zeros(d, np.float32))
                                            for p in parts]))

    for side, heads in (("encoder", model.config.encoder_attention_heads),
                        ("decoder", model.config.decoder_attention_heads)):
        out[f"{side}/num_heads"] = np.array(heads, dtype=np.int16)
        out[f"{side}/pre_norm"] = np.array(1, dtype=np.int8)
    out["decoder/scale_embeddings"] = np.array(0, dtype=np.int8)
    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    put("encoder/position_encodings/encodings", sd["model.encoder.embed_positions.weight"])
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    def layer(ours: str, theirs: str) -> None:
        stacked(f"{ours}/self_attention/linear_0", f"{theirs}.self_attn", "qkv")
        linear(f"{ours}/self_attention/linear_1", f"{theirs}.self_attn.out_proj")
        norm(f"{ours}/self_attention/layer_norm", f"{theirs}.self_attn_layer_norm")
        linear(f"{ours}/ffn/linear_0", f"{theirs}.fc1")
        linear(f"{ours}/ffn/linear_1", f"{theirs}.fc2")
        norm(f"{ours}/ffn/layer_norm", f"{theirs}.final_layer_norm")

    for i in range(model.config.encoder_layers):
        layer(f"encoder/layer_{i}", f"model.encoder.layers.{i}")
    put("decoder/embeddings/weight", sd["model.decoder.embed_tokens.weight"])
    put("decoder/position_encodings/encodings", sd["model.decoder.embed_positions.weight"])
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    for i in range(model.config.decoder_layers):
        ours, theirs = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        layer(ours, theirs)
        stacked(f"{ours}/attention/linear_0", f"{theirs}.encoder_attn", "q")
        stacked(f"{ours}/attention/linear_1", f"{theirs}.encoder_attn", "kv")
        linear(f"{ours}/attention/linear_2", f"{theirs}.encoder_attn.out_proj")
        norm(f"{ours}/attention/layer_norm", f"{theirs}.encoder_attn_layer_norm")
    return out


def write_whisper_folder(model, folder: Path, tokenizer_json: str, dtype=np.float16) -> Path:
    """model.bin, tokenizer.json and config.json (suppressed tokens) of `model` in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    write_model_bin(folder / "model.bin", "WhisperSpec", whisper_variables(model, dtype),
                    {"decoder/projection/weight": "decoder/embeddings/weight"})
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "config.json").write_text(json.dumps({
        "suppress_ids": list(model.config.suppress_tokens or []),
        "suppress_ids_begin": list(model.config.begin_suppress_tokens or []), "lang_ids": []}))
    return folder
