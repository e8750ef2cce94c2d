"""Voxtral (transformers' VoxtralForConditionalGeneration): a Whisper-style audio encoder, a projector into the
decoder's embedding space and a Llama decoder, exported as one program that transcribes audio or answers about it.

Methods (the decoder's KV cache in state buffers, as kiln.models.llm's programs have it):
  encode(features [1, n_mels, 3000]) -> audio embeddings [A, d]: one 30 s window of log-mel features through the
      encoder; its 1500 frames grouped by the projector's width (4 frames a row, A = 375) and projected.
  embed(tokens [1, T]) -> [1, T, d]: the decoder's input embedding rows of a prompt's tokens.
  prefill_embeds(embeds [1, T], positions [T]) -> logits [1, vocab]: a prompt chunk from embedding rows, where the
      audio placeholder tokens' rows are the encoder's (what transformers' masked_scatter does).
  prefill(tokens [1, T], positions [T]) and decode(token [1, 1], position [1]): as every LLM program of kiln's.

`export_voxtral` is the recipe (a model or a checkpoint folder in); the tokenizer, the placeholder and prompt
tokens and the window's embedding count go into the metadata (kiln.runtime.speech.info), so `kiln transcribe` and
kiln.runtime.speech.VoxtralTranscriber need nothing but the .kiln file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from kiln.export import Method, ProgramBuilder, Quantize, export
from kiln.models.llm import StaticCacheLM, causal_language_model
from kiln.models.llm_source import llm_metadata, load_pretrained
from kiln.runtime.llm import info as llm_keys
from kiln.runtime.speech import info as keys

PROMPT_TOKENS = {"bos": "<s>", "inst": "[INST]", "inst_end": "[/INST]", "begin_audio": "[BEGIN_AUDIO]",
                 "audio": "[AUDIO]", "transcribe": "[TRANSCRIBE]"}
"""The special tokens of Voxtral's prompts (mistral_common's): a transcription request is <s>[INST][BEGIN_AUDIO]
[AUDIO] x A[/INST]lang:xx[TRANSCRIBE], a question <s>[INST][BEGIN_AUDIO][AUDIO] x A text[/INST]."""


class VoxtralProgram(nn.Module):
    """The methods above over one Voxtral model (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, max_context: int, prefill_chunk: int):
        super().__init__()
        self.audio_tower = model.model.audio_tower
        self.projector = model.model.multi_modal_projector
        self.width = model.config.audio_config.intermediate_size
        self.lm = StaticCacheLM(causal_language_model(model), max_context, prefill_chunk)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        states = self.audio_tower(features).last_hidden_state
        return self.projector(states.reshape(-1, self.width))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm.model.get_input_embeddings()(tokens)

    def prefill_embeds(self, embeds: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.lm.prefill_embeds(embeds, cache_position)

    def prefill(self, tokens: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.lm.prefill(tokens, cache_position)

    def decode(self, token: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.lm.decode(token, cache_position)


def prompt_token_ids(tokenizer: Any, audio_token_id: int) -> dict[str, int]:
    """The ids of PROMPT_TOKENS in `tokenizer`; the audio placeholder is the model's audio_token_id."""
    ids = {"audio": int(audio_token_id)}
    for role, token in PROMPT_TOKENS.items():
        if role == "audio":
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token} token, which Voxtral's prompts need")
        ids[role] = int(token_id)
    return ids


def export_voxtral(model_or_path: PreTrainedModel | str | os.PathLike, max_context: int = 2048,
                   prefill_chunk: int = 128, tokenizer: Any = None, quantize: Quantize | str | None = None,
                   **export_options: Any) -> ProgramBuilder:
    """Export a Voxtral model (or a checkpoint folder) as described in the module docstring.

    max_context: decoder cache slots (a 30 s window takes 375 of them, plus the prompt and the answer).
    prefill_chunk: the most prompt rows one prefill call takes. tokenizer: a fast transformers tokenizer with
    Voxtral's prompt tokens (PROMPT_TOKENS), by default the one beside the model (a tokenizer.json, or Mistral's
    tekken.json, which transformers converts: what Voxtral checkpoints ship). quantize: weight-only
    quantization of the linear and embedding weights (kiln.export.Quantize).
    """
    from transformers import VoxtralForConditionalGeneration

    model, tokenizer = load_pretrained(model_or_path, VoxtralForConditionalGeneration, tokenizer)
    if tokenizer is None:
        raise ValueError("export_voxtral needs the model's tokenizer (a fast one with Voxtral's prompt tokens)")
    config = model.config
    audio = config.audio_config
    frames = audio.max_source_positions
    group = audio.intermediate_size // audio.hidden_size
    if audio.intermediate_size % audio.hidden_size or frames % group:
        raise ValueError(f"Voxtral's projector groups {group} encoder frames a row; {frames} frames do not split so")
    embeddings = frames // group
    if max_context <= embeddings:
        raise ValueError(f"max_context {max_context} leaves no room beside a window's {embeddings} audio embeddings")
    program = VoxtralProgram(model, max_context, prefill_chunk)
    features = torch.zeros(1, audio.num_mel_bins, 2 * frames)
    example = min(prefill_chunk, 2)
    seq = torch.export.Dim("seq", min=1, max=prefill_chunk) if prefill_chunk > 1 else None
    rows = torch.export.Dim("rows", min=1, max=max_context)
    d = config.text_config.hidden_size

    def chunk(*args: torch.Tensor) -> Method:
        dims = tuple({1 if a.dim() > 1 else 0: seq} for a in args) if seq is not None else None
        return Method(args, dynamic_shapes=dims)

    methods = {
        "encode": Method((features,)),
        "embed": Method((torch.zeros((1, 2), dtype=torch.long),), dynamic_shapes=({1: rows},)),
        "prefill_embeds": chunk(torch.zeros(1, example, d), torch.arange(example)),
        "prefill": chunk(torch.zeros((1, example), dtype=torch.long), torch.arange(example)),
        "decode": Method((torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long))),
    }
    metadata = llm_metadata(causal_language_model(model), tokenizer)
    metadata.update({
        llm_keys.MAX_CONTEXT_KEY: str(max_context), llm_keys.PREFILL_CHUNK_KEY: str(prefill_chunk),
        llm_keys.RING_CACHE_KEY: "0",
        keys.MODEL_KIND_KEY: "voxtral", keys.N_MELS_KEY: str(audio.num_mel_bins),
        keys.AUDIO_EMBEDDINGS_KEY: str(embeddings),
        keys.PROMPT_TOKENS_KEY: json.dumps(prompt_token_ids(tokenizer, config.audio_token_id)),
    })
    metadata.update(export_options.pop("metadata", None) or {})
    program.lm.reset()
    return export(program, methods=methods, metadata=metadata, quantize=quantize, **export_options)


__all__ = ["PROMPT_TOKENS", "VoxtralProgram", "export_voxtral", "prompt_token_ids"]
