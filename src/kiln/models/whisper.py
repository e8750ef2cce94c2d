"""Whisper (transformers' WhisperForConditionalGeneration) exported as two methods over caches in state buffers.

  encode(features [1, n_mels, 3000]) -> encoder states [1, 1500, d]: runs the encoder once per 30 s window and
      writes every decoder layer's cross-attention keys and values into state buffers (computed once per window,
      read by every decode step).
  decode(token [1, 1], position [1]) -> logits [1, vocab]: one decoder step. Its self-attention keys and values go
      into a [1, heads, max_tokens, head_dim] cache per layer at `position`; a query sees the slots up to its own
      position, so stale slots from an earlier window are never read and nothing needs resetting.

The decoder is written out here over the model's own modules rather than called through transformers, whose
encoder-decoder cache objects torch.export cannot follow; the arithmetic is transformers' (pre-norm layers, q
scaled before the product, exact GELU). `export_whisper` is the recipe: a transformers model, a checkpoint folder,
or a faster-whisper (CTranslate2) folder in; the tokenizer and decoding settings go into the program's metadata
(kiln.runtime.speech.info), so `kiln transcribe` needs nothing but the .kiln file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.export import Method, ProgramBuilder, export
from kiln.runtime.speech import info as keys

MULTILINGUAL_VOCAB = 51865
"""Whisper's multilingual checkpoints have 51865+ tokens (language and task tokens); the .en ones 51864."""


class StaticCacheWhisper(nn.Module):
    """encode and decode as described above; `max_tokens` (at most the model's 448 positions) slots of cache."""

    def __init__(self, model: Any, max_tokens: int | None = None):
        super().__init__()
        config = model.config
        self.model = model.eval()
        self.max_tokens = int(max_tokens or config.max_target_positions)
        if not 1 <= self.max_tokens <= config.max_target_positions:
            raise ValueError(f"max_tokens must be in 1..{config.max_target_positions}, got {self.max_tokens}")
        self.heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.heads
        self.frames = config.max_source_positions
        layers = len(model.model.decoder.layers)
        dtype = model.dtype
        for i in range(layers):
            for kind, slots in (("self", self.max_tokens), ("cross", self.frames)):
                for part in ("key", "value"):
                    self.register_buffer(f"{kind}_{part}_{i}", torch.zeros(1, self.heads, slots, self.head_dim,
                                                                           dtype=dtype), persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T, d] -> [1, heads, T, head_dim]"""
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        states = self.model.model.encoder(input_features=features).last_hidden_state
        for i, layer in enumerate(self.model.model.decoder.layers):
            attention = layer.encoder_attn
            getattr(self, f"cross_key_{i}").copy_(self._heads(attention.k_proj(states)))
            getattr(self, f"cross_value_{i}").copy_(self._heads(attention.v_proj(states)))
        return states

    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        decoder = self.model.model.decoder
        x = decoder.embed_tokens(token) + decoder.embed_positions.weight[position][None]
        visible = (torch.arange(self.max_tokens, device=position.device) <= position[:, None])[None, None]
        for i, layer in enumerate(decoder.layers):
            h = layer.self_attn_layer_norm(x)
            attention = layer.self_attn
            keys, values = getattr(self, f"self_key_{i}"), getattr(self, f"self_value_{i}")
            keys.index_copy_(2, position, self._heads(attention.k_proj(h)))
            values.index_copy_(2, position, self._heads(attention.v_proj(h)))
            q = self._heads(attention.q_proj(h) * attention.scaling)
            x = x + self._merge(attention.out_proj, F.scaled_dot_product_attention(q, keys, values, visible, scale=1.0))
            h = layer.encoder_attn_layer_norm(x)
            attention = layer.encoder_attn
            q = self._heads(attention.q_proj(h) * attention.scaling)
            out = F.scaled_dot_product_attention(q, getattr(self, f"cross_key_{i}"), getattr(self, f"cross_value_{i}"),
                                                 scale=1.0)
            x = x + self._merge(attention.out_proj, out)
            h = layer.final_layer_norm(x)
            x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
        return self.model.proj_out(decoder.layer_norm(x))[:, -1]

    @staticmethod
    def _merge(out_proj: nn.Linear, heads: torch.Tensor) -> torch.Tensor:
        """[1, heads, T, head_dim] -> the output projection of [1, T, d]"""
        return out_proj(heads.transpose(1, 2).reshape(heads.shape[0], heads.shape[2], -1))

    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()


def export_whisper_model(model: Any, max_tokens: int | None = None, **export_options) -> ProgramBuilder:
    """Export `encode` and `decode` (see the module docstring) of a transformers Whisper model."""
    wrapper = model if isinstance(model, StaticCacheWhisper) else StaticCacheWhisper(model, max_tokens)
    wrapper.reset()  # the buffers' contents at export become the program's initial state
    config = wrapper.model.config
    features = torch.zeros(1, config.num_mel_bins, 2 * config.max_source_positions, dtype=wrapper.model.dtype)
    methods = {"encode": Method((features,)),
               "decode": Method((torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long)))}
    metadata = {keys.MODEL_KIND_KEY: "whisper", keys.MAX_TOKENS_KEY: str(wrapper.max_tokens),
                keys.N_MELS_KEY: str(config.num_mel_bins)}
    metadata.update(export_options.pop("metadata", None) or {})
    return export(wrapper, methods=methods, metadata=metadata, **export_options)


def load_whisper(source: Any) -> tuple[Any, dict[str, Any]]:
    """(transformers Whisper model in float32, decoding settings) from a model, a transformers checkpoint folder, or a
    faster-whisper (CTranslate2) folder or model.bin. Settings: tokenizer_json, suppress_tokens,
    begin_suppress_tokens."""
    from transformers import PreTrainedModel

    if isinstance(source, PreTrainedModel):
        return source.float().eval(), _settings_of(source, None)
    path = Path(source)
    if (path / "model.bin").is_file() or (path.suffix == ".bin" and path.is_file()):
        from kiln.models.ctranslate2 import whisper_from_ctranslate2

        return whisper_from_ctranslate2(path)
    from transformers import AutoTokenizer, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, _settings_of(model, AutoTokenizer.from_pretrained(path))


def _settings_of(model: Any, tokenizer: Any) -> dict[str, Any]:
    generation = getattr(model, "generation_config", None)
    settings = {
        "suppress_tokens": list(getattr(generation, "suppress_tokens", None) or model.config.suppress_tokens or []),
        "begin_suppress_tokens": list(getattr(generation, "begin_suppress_tokens", None)
                                      or model.config.begin_suppress_tokens or []),
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        settings["tokenizer_json"] = backend.to_str()
    return settings


def export_whisper(source: Any, max_tokens: int | None = None, tokenizer_json: str | None = None,
                   **export_options) -> ProgramBuilder:
    """A Whisper program that `kiln transcribe` runs alone: from a transformers model, a checkpoint folder or a
    faster-whisper folder. tokenizer_json: the tokenizer.json text, when the source has none (a bare model)."""
    model, settings = load_whisper(source)
    tokenizer_json = tokenizer_json or settings.get("tokenizer_json")
    if tokenizer_json is None:
        raise ValueError("a Whisper program needs its tokenizer: pass tokenizer_json= (the tokenizer.json text) or "
                         "export from a folder that has one")
    metadata = {keys.TOKENIZER_KEY: tokenizer_json, keys.VOCAB_SIZE_KEY: str(model.config.vocab_size),
                keys.SUPPRESS_KEY: json.dumps([int(t) for t in settings["suppress_tokens"]]),
                keys.BEGIN_SUPPRESS_KEY: json.dumps([int(t) for t in settings["begin_suppress_tokens"]]),
                keys.MULTILINGUAL_KEY: "1" if model.config.vocab_size >= MULTILINGUAL_VOCAB else "0"}
    if not hasattr(source, "config"):
        metadata[keys.NAME_KEY] = Path(source).name if Path(source).is_dir() else Path(source).parent.name
    metadata.update(export_options.pop("metadata", None) or {})
    return export_whisper_model(model, max_tokens, metadata=metadata, **export_options)


__all__ = ["StaticCacheWhisper", "export_whisper", "export_whisper_model", "load_whisper"]
