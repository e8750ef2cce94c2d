"""CTranslate2 model files (faster-whisper's `model.bin`) read without CTranslate2, and Whisper rebuilt from one.

The format (version 6 here; DEVELOPERS.md has the layout): a header `u32 version; str spec; u32 revision; u32
count`, then `count` variables, each `str name; u8 rank; u32 dims[rank]; u8 dtype; u32 nbytes; data`, then
`u32 count` aliases of `str alias; str target`. A `str` is a u16 length and that many bytes, the last a NUL. dtype
codes: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16. Scalars (rank 0) hold the spec's settings (head
counts, activation, pre-norm).

`whisper_from_ctranslate2` maps a WhisperSpec's variables onto transformers' WhisperForConditionalGeneration: the
converter stacked each self-attention's q/k/v projections into one `linear_0` (k without a bias: the stacked bias
holds zeros there) and each cross-attention's k/v into `linear_1`; the output projection is an alias of the token
embedding. The folder's tokenizer.json and config.json (suppressed tokens, language ids) come along.

The file is untrusted: every count, rank, size and dtype is checked before use (a variable's bytes must be in the
file, so nothing allocated is larger than the file), a variable's shape is checked before it is indexed, and the
Whisper rebuilt from one is first built on the meta device and compared against the mapped weights, so sizes
that lie are refused before a real model is allocated. Anything wrong raises ModelFileError.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kiln.errors import FileFormatError
from kiln.models.state_fit import misfit

DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.int8), 2: np.dtype(np.int16), 3: np.dtype(np.int32),
          4: np.dtype(np.float16), 5: np.dtype(ml_dtypes.bfloat16)}
SUPPORTED_VERSIONS = range(5, 7)
MAX_RANK = 8
"""Most dimensions a variable may have (CTranslate2's own tensors have at most 4)."""


class ModelFileError(FileFormatError):
    """A CTranslate2 model.bin that is truncated, of an unknown version, or not the spec expected."""


@dataclass
class CTranslate2Model:
    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> np.ndarray:
        """A variable by name, following an alias."""
        name = self.aliases.get(name, name)
        if name not in self.variables:
            raise ModelFileError(f"the {self.spec} model.bin has no variable {name!r}")
        return self.variables[name]

    def scalar(self, name: str) -> int:
        value = self.get(name)
        number = float(value.reshape(-1)[0]) if value.size == 1 else math.nan
        if not number.is_integer():
            raise ModelFileError(f"the {self.spec} model.bin's {name!r} is {value.dtype}{list(value.shape)} "
                                 f"{value.reshape(-1)[:4].tolist()}, not one whole number")
        return int(number)

    def array(self, name: str, rank: int) -> np.ndarray:
        """A variable that must have `rank` dimensions (checked before any of its dimensions is read)."""
        value = self.get(name)
        if value.ndim != rank:
            raise ModelFileError(f"the {self.spec} model.bin's {name!r} has shape {list(value.shape)}; "
                                 f"{rank} dimensions expected")
        return value


class _Reader:
    def __init__(self, data: bytes, where: str):
        self.data, self.at, self.where = data, 0, where

    def take(self, size: int) -> memoryview:
        if self.at + size > len(self.data):
            raise ModelFileError(f"{self.where} ends at byte {len(self.data)}, inside a field at {self.at}: truncated")
        view = memoryview(self.data)[self.at:self.at + size]
        self.at += size
        return view

    def u(self, fmt: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def text(self) -> str:
        at = self.at
        raw = bytes(self.take(self.u("<H"))).rstrip(b"\0")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.where}: the string at byte {at} is not UTF-8: {raw[:40]!r}") from None


def read_model_bin(path: str | os.PathLike) -> CTranslate2Model:
    """Every variable of a model.bin, as NumPy arrays over a copy of the file's bytes."""
    path = Path(path)
    reader = _Reader(path.read_bytes(), str(path))
    version = reader.u("<I")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{path}: CTranslate2 format version {version}; kiln reads versions "
                             f"{SUPPORTED_VERSIONS.start}-{SUPPORTED_VERSIONS.stop - 1}")
    spec, revision, count = reader.text(), reader.u("<I"), reader.u("<I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(count):  # (each variable takes at least 8 bytes: a lying count ends in a 'truncated' error)
        name, value = _variable(reader, path)
        if name in variables:
            raise ModelFileError(f"{path}: variable {name!r} appears twice")
        variables[name] = value
    aliases = {}
    if reader.at < len(reader.data):
        for _ in range(reader.u("<I")):
            alias = reader.text()
            aliases[alias] = reader.text()
    return CTranslate2Model(spec, revision, variables, aliases)


def _variable(reader: _Reader, path: Path) -> tuple[str, np.ndarray]:
    """One `str name; u8 rank; u32 dims[rank]; u8 dtype; u32 nbytes; data` record, its size checked against its
    shape in exact integers (a NumPy product of u32 dimensions could wrap around to match)."""
    name = reader.text()
    rank = reader.u("<B")
    if rank > MAX_RANK:
        raise ModelFileError(f"{path}: variable {name!r} has {rank} dimensions; at most {MAX_RANK} expected")
    dims = struct.unpack(f"<{rank}I", reader.take(4 * rank))
    code, nbytes = reader.u("<B"), reader.u("<I")
    if code not in DTYPES:
        raise ModelFileError(f"{path}: variable {name!r} has unknown dtype code {code}")
    dtype = DTYPES[code]
    if nbytes != dtype.itemsize * math.prod(dims):
        raise ModelFileError(f"{path}: variable {name!r} {list(dims)} {dtype} holds {nbytes} bytes; "
                             f"{dtype.itemsize * math.prod(dims)} expected")
    return name, np.frombuffer(reader.take(nbytes), dtype=dtype).reshape(dims)


def _layers(model: CTranslate2Model, prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)/")
    indices = {int(m.group(1)) for m in map(pattern.match, model.variables) if m}
    if indices != set(range(len(indices))):
        raise ModelFileError(f"{prefix}N variables are not numbered 0..{len(indices) - 1}: {sorted(indices)}")
    return len(indices)


def whisper_state_dict(model: CTranslate2Model) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """transformers' Whisper parameter names -> float32 arrays, and the sizes its WhisperConfig needs."""
    if model.spec != "WhisperSpec":
        raise ModelFileError(f"the model.bin holds a {model.spec}, not a WhisperSpec")
    for name, want in (("encoder/pre_norm", 1), ("decoder/pre_norm", 1), ("decoder/scale_embeddings", 0)):
        if name in model.variables and model.scalar(name) != want:
            raise ModelFileError(f"{name} is {model.scalar(name)}: not Whisper's layout")
    d = model.array("decoder/embeddings/weight", 2).shape[1]
    state: dict[str, np.ndarray] = {}

    def put(target: str, source: str) -> None:
        state[target] = np.asarray(model.get(source), dtype=np.float32)

    def linear(target: str, source: str) -> None:
        put(f"{target}.weight", f"{source}/weight")
        put(f"{target}.bias", f"{source}/bias")

    def norm(target: str, source: str) -> None:
        put(f"{target}.weight", f"{source}/gamma")
        put(f"{target}.bias", f"{source}/beta")

    def stacked(target: str, source: str, parts: tuple[str, ...]) -> None:
        """A CTranslate2 linear of stacked projections split into transformers' q/k/v (k has no bias there)."""
        weight = np.asarray(model.array(f"{source}/weight", 2), dtype=np.float32)
        bias = np.asarray(model.array(f"{source}/bias", 1), dtype=np.float32)
        for i, part in enumerate(parts):
            state[f"{target}.{part}_proj.weight"] = weight[i * d:(i + 1) * d]
            if part != "k":
                state[f"{target}.{part}_proj.bias"] = bias[i * d:(i + 1) * d]

    def layer(ours: str, theirs: str) -> None:
        """What encoder and decoder layers share: self-attention and the feed-forward block, each with its norm."""
        stacked(f"{ours}.self_attn", f"{theirs}/self_attention/linear_0", ("q", "k", "v"))
        linear(f"{ours}.self_attn.out_proj", f"{theirs}/self_attention/linear_1")
        norm(f"{ours}.self_attn_layer_norm", f"{theirs}/self_attention/layer_norm")
        linear(f"{ours}.fc1", f"{theirs}/ffn/linear_0")
        linear(f"{ours}.fc2", f"{theirs}/ffn/linear_1")
        norm(f"{ours}.final_layer_norm", f"{theirs}/ffn/layer_norm")

    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    put("model.encoder.embed_positions.weight", "encoder/position_encodings/encodings")
    norm("model.encoder.layer_norm", "encoder/layer_norm")
    encoder_layers = _layers(model, "encoder/layer_")
    for i in range(encoder_layers):
        layer(f"model.encoder.layers.{i}", f"encoder/layer_{i}")
    put("model.decoder.embed_tokens.weight", "decoder/embeddings/weight")
    put("model.decoder.embed_positions.weight", "decoder/position_encodings/encodings")
    norm("model.decoder.layer_norm", "decoder/layer_norm")
    decoder_layers = _layers(model, "decoder/layer_")
    for i in range(decoder_layers):
        ours, theirs = f"model.decoder.layers.{i}", f"decoder/layer_{i}"
        layer(ours, theirs)
        stacked(f"{ours}.encoder_attn", f"{theirs}/attention/linear_0", ("q",))
        stacked(f"{ours}.encoder_attn", f"{theirs}/attention/linear_1", ("k", "v"))
        linear(f"{ours}.encoder_attn.out_proj", f"{theirs}/attention/linear_2")
        norm(f"{ours}.encoder_attn_layer_norm", f"{theirs}/attention/layer_norm")
    if not encoder_layers or not decoder_layers:
        raise ModelFileError(f"the model.bin has {encoder_layers} encoder and {decoder_layers} decoder layers")

    def dim(target: str, rank: int, axis: int) -> int:
        if state[target].ndim != rank:
            raise ModelFileError(f"the model.bin's weight for {target} has shape {list(state[target].shape)}; "
                                 f"{rank} dimensions expected")
        return int(state[target].shape[axis])

    sizes = {
        "d_model": d, "vocab_size": dim("model.decoder.embed_tokens.weight", 2, 0),
        "encoder_layers": encoder_layers, "decoder_layers": decoder_layers,
        "encoder_attention_heads": model.scalar("encoder/num_heads"),
        "decoder_attention_heads": model.scalar("decoder/num_heads"),
        "encoder_ffn_dim": dim("model.encoder.layers.0.fc1.weight", 2, 0),
        "decoder_ffn_dim": dim("model.decoder.layers.0.fc1.weight", 2, 0),
        "num_mel_bins": dim("model.encoder.conv1.weight", 3, 1),
        "max_source_positions": dim("model.encoder.embed_positions.weight", 2, 0),
        "max_target_positions": dim("model.decoder.embed_positions.weight", 2, 0),
    }
    for side in ("encoder", "decoder"):
        heads = sizes[f"{side}_attention_heads"]
        if heads < 1 or d % heads or min(sizes.values()) < 1:
            raise ModelFileError(f"the model.bin's sizes do not make a Whisper: {side}/num_heads {heads} for "
                                 f"d_model {d}; {sizes}")
    return state, sizes


def whisper_from_ctranslate2(folder: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """(transformers WhisperForConditionalGeneration in float32, the folder's extras) from a faster-whisper model
    folder: model.bin, tokenizer.json and config.json (suppress_ids, suppress_ids_begin, lang_ids). The extras:
    tokenizer_json (its text), suppress_tokens, begin_suppress_tokens, lang_ids."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    folder = Path(folder)
    model_bin = folder / "model.bin" if folder.is_dir() else folder
    folder = model_bin.parent
    tokenizer_json, special = _tokenizer(folder / "tokenizer.json")
    extra = _extra_config(folder / "config.json")
    state, sizes = whisper_state_dict(read_model_bin(model_bin))
    eot = special["<|endoftext|>"]
    config = WhisperConfig(**sizes, activation_function="gelu", decoder_start_token_id=special["<|startoftranscript|>"],
                           eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
                           suppress_tokens=extra.get("suppress_ids"),
                           begin_suppress_tokens=extra.get("suppress_ids_begin"))
    with torch.device("meta"):  # shapes only: a size that lies is refused before real weights are allocated
        skeleton = WhisperForConditionalGeneration(config)
    _check_shapes({k: tuple(v.shape) for k, v in skeleton.state_dict().items()}, state, model_bin)
    model = WhisperForConditionalGeneration(config).eval()
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=False)
    model.tie_weights()
    extras = {"tokenizer_json": tokenizer_json, "suppress_tokens": extra.get("suppress_ids", []),
              "begin_suppress_tokens": extra.get("suppress_ids_begin", []), "lang_ids": extra.get("lang_ids", [])}
    return model, extras


def _check_shapes(expected: dict[str, tuple[int, ...]], state: dict[str, np.ndarray], model_bin: Path) -> None:
    """Every weight transformers' Whisper has (but the LM head, tied to the token embedding) mapped, nothing else,
    each of the shape the model has: what load_state_dict would refuse, refused as the file's fault."""
    problem = misfit(expected, state, optional=("proj_out.weight",))
    if problem:
        raise ModelFileError(f"{model_bin}: the mapped weights do not fit transformers' Whisper: {problem}")


def _json(path: Path) -> Any:
    """A JSON file's contents, or a ModelFileError naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path} is not valid JSON: {e}") from None


def _extra_config(path: Path) -> dict[str, list[int]]:
    """faster-whisper's config.json (absent: {}): suppress_ids, suppress_ids_begin and lang_ids, lists of ids."""
    if not path.is_file():
        return {}
    data = _json(path)
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: a JSON object expected, found {type(data).__name__}")
    for key in ("suppress_ids", "suppress_ids_begin", "lang_ids"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ModelFileError(f"{path}: {key} must be a list of token ids, found {str(value)[:80]}")
    return data


def _tokenizer(path: Path) -> tuple[str, dict[str, int]]:
    """(tokenizer.json's text, its added tokens' ids by content), with the two special tokens Whisper's decoding
    starts and stops on."""
    if not path.is_file():
        raise ModelFileError(f"{path.parent} has no tokenizer.json beside model.bin; kiln stores it in the program")
    data = _json(path)
    added = data.get("added_tokens") if isinstance(data, dict) else None
    if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("content"), str)
                                              and isinstance(t.get("id"), int) for t in added):
        raise ModelFileError(f"{path}: no 'added_tokens' list of {{content, id}} entries")
    special = {token["content"]: token["id"] for token in added}
    for name in ("<|endoftext|>", "<|startoftranscript|>"):
        if name not in special:
            raise ModelFileError(f"{path}: no {name} among its added tokens: not a Whisper tokenizer")
    return path.read_text(encoding="utf-8"), special
