"""Gemma 3 with images (transformers' Gemma3ForConditionalGeneration): a SigLIP vision tower, a projector (average
pooling to mm_tokens_per_image rows, RMSNorm, a projection) and the Gemma 3 decoder, exported as one program that
answers a prompt about an image.

Methods (the decoder's KV cache in state buffers, as kiln.models.llm's programs have it):
  encode_image(pixels [1, 3, S, S]) -> image embeddings [N, d]: the preprocessed image (kiln.runtime.image_text
      makes it: a bilinear resize to S x S, then (x / 255 - mean) / std) through the tower and the projector.
  embed(tokens [1, T]) -> [1, T, d]: the decoder's (scaled) input embedding rows.
  prefill_embeds(embeds [1, T, d], positions [T], blocks [T]) -> logits [1, vocab]: a prompt chunk from embedding
      rows, the image tokens' rows the encoder's; positions of one block (an image's tokens: block ids >= 0, -1
      for text) see each other both ways, as Gemma 3 attends an image's tokens (token_type_ids).
  prefill(tokens, positions) and decode(token, position): as every LLM program of kiln's.

`export_gemma3_vision` is the recipe; the tokenizer, the image tokens and the preprocessing settings go into the
metadata (kiln.runtime.image_text), so `kiln generate --image` needs nothing but the .kiln file.
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
from kiln.runtime import image_text as keys
from kiln.runtime.llm import info as llm_keys


class Gemma3VisionProgram(nn.Module):
    """The methods above over one Gemma 3 model (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, max_context: int, prefill_chunk: int):
        super().__init__()
        self.vision_tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        self.lm = StaticCacheLM(causal_language_model(model), max_context, prefill_chunk)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision_tower(pixel_values=pixels).last_hidden_state)[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm.model.get_input_embeddings()(tokens)

    def prefill_embeds(self, embeds: torch.Tensor, cache_position: torch.Tensor,
                       blocks: torch.Tensor) -> torch.Tensor:
        return self.lm.prefill_embeds(embeds, cache_position, blocks)

    def prefill(self, tokens: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.lm.prefill(tokens, cache_position)

    def decode(self, token: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.lm.decode(token, cache_position)


def export_gemma3_vision(model_or_path: PreTrainedModel | str | os.PathLike, max_context: int = 2048,
                         prefill_chunk: int | None = None, tokenizer: Any = None,
                         quantize: Quantize | str | None = None, **export_options: Any) -> ProgramBuilder:
    """Export a Gemma3ForConditionalGeneration (or a checkpoint folder) as described in the module docstring.

    prefill_chunk: the most prompt rows one prefill call takes; at least an image's tokens plus its two markers
    (an image is attended within one chunk), by default that plus 64. tokenizer: a fast transformers tokenizer, by
    default the one beside the model. quantize: weight-only quantization (kiln.export.Quantize).
    """
    from transformers import Gemma3ForConditionalGeneration

    model, tokenizer = load_pretrained(model_or_path, Gemma3ForConditionalGeneration, tokenizer)
    config = model.config
    image_tokens = int(config.mm_tokens_per_image)
    prefill_chunk = image_tokens + 66 if prefill_chunk is None else prefill_chunk
    if prefill_chunk < image_tokens + 2:
        raise ValueError(f"prefill_chunk {prefill_chunk} cannot hold an image's {image_tokens} tokens and its markers")
    if max_context <= prefill_chunk:
        raise ValueError(f"max_context {max_context} must exceed prefill_chunk {prefill_chunk}")
    program = Gemma3VisionProgram(model, max_context, prefill_chunk)
    size = int(config.vision_config.image_size)
    d = config.text_config.hidden_size
    seq = torch.export.Dim("seq", min=1, max=prefill_chunk)
    rows = torch.export.Dim("rows", min=1, max=max_context)
    methods = {
        "encode_image": Method((torch.zeros(1, 3, size, size),)),
        "embed": Method((torch.zeros((1, 2), dtype=torch.long),), dynamic_shapes=({1: rows},)),
        "prefill_embeds": Method((torch.zeros(1, 2, d), torch.arange(2), torch.full((2,), -1)),
                                 dynamic_shapes=({1: seq}, {0: seq}, {0: seq})),
        "prefill": Method((torch.zeros((1, 2), dtype=torch.long), torch.arange(2)),
                          dynamic_shapes=({1: seq}, {0: seq})),
        "decode": Method((torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long))),
    }
    metadata = llm_metadata(causal_language_model(model), tokenizer)
    metadata.update({
        llm_keys.MAX_CONTEXT_KEY: str(max_context), llm_keys.PREFILL_CHUNK_KEY: str(prefill_chunk),
        llm_keys.RING_CACHE_KEY: "1" if any(program.lm.layer_is_ring) else "0",
        keys.KIND_KEY: "gemma3", keys.IMAGE_SIZE_KEY: str(size), keys.IMAGE_TOKENS_KEY: str(image_tokens),
        keys.MEAN_KEY: json.dumps([0.5, 0.5, 0.5]), keys.STD_KEY: json.dumps([0.5, 0.5, 0.5]),
        keys.TOKEN_IDS_KEY: json.dumps({"image": int(config.image_token_id), "begin": int(config.boi_token_id),
                                        "end": int(config.eoi_token_id), "bos": int(config.text_config.bos_token_id)}),
    })
    metadata.update(export_options.pop("metadata", None) or {})
    program.lm.reset()
    return export(program, methods=methods, metadata=metadata, quantize=quantize, **export_options)


__all__ = ["Gemma3VisionProgram", "export_gemma3_vision"]
