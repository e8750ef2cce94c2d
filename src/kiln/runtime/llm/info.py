"""What an exported language model's program says about itself: the metadata contract of `kiln.models.llm`.

`export_llm` writes these string entries; the runtime (Generator, `kiln generate`, `kiln chat`) reads them, so a
.kiln file is all a user needs to generate text. Every key is namespaced `kiln.llm.`; JSON where a value is not a
plain string. Only max_context and prefill_chunk are required (programs from `export_llama` have only those).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln.errors import InputError

MAX_CONTEXT_KEY = "kiln.llm.max_context"
PREFILL_CHUNK_KEY = "kiln.llm.prefill_chunk"
VOCAB_SIZE_KEY = "kiln.llm.vocab_size"
STOP_TOKENS_KEY = "kiln.llm.stop_token_ids"
"""JSON list of token ids that end a generation (the generation config's eos ids and the tokenizer's eos)."""
CHAT_TEMPLATE_KEY = "kiln.llm.chat_template"
"""The tokenizer's Jinja chat template, as transformers' apply_chat_template renders it."""
SPECIAL_TOKENS_KEY = "kiln.llm.special_tokens"
"""JSON object of the special tokens the chat template refers to: bos_token, eos_token, pad_token, unk_token."""
TOKENIZER_KEY = "kiln.llm.tokenizer_json"
"""The whole tokenizer.json (Hugging Face `tokenizers` format), so the program needs no file beside it."""
MODEL_TYPE_KEY = "kiln.llm.model_type"
NAME_KEY = "kiln.llm.name"
RING_CACHE_KEY = "kiln.llm.ring_cache"
""""1" when some layers keep a ring-buffer (sliding-window) cache: then a cache can only be rewound by at most
prefill_chunk positions (older slots may already hold newer positions)."""

SLOTS_KEY = "kiln.llm.slots"
"""The sequences the KV cache holds (a program exported with slots, for batched serving): then prefill takes
(tokens, positions, slot [1]) and decode (tokens [B, 1], positions [B], slots [B]). Absent: one sequence."""
DECODE_ROWS_KEY = "kiln.llm.decode_rows"
"""The most rows a slotted program's decode takes in one call: slots + prefill_chunk, so that one step can carry a
token of every sequence and a prompt chunk's tokens (each row a token of some sequence at its own position; rows
of one sequence are written before any row attends). Absent (programs exported before it): slots."""


@dataclass(frozen=True)
class LLMInfo:
    """The LLM metadata of one program, parsed."""

    max_context: int
    prefill_chunk: int
    vocab_size: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    tokenizer_json: str | None = None
    model_type: str | None = None
    name: str | None = None
    ring_cache: bool = False
    slots: int | None = None
    decode_rows: int | None = None
    """See DECODE_ROWS_KEY; None for a program of one sequence."""

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> LLMInfo:
        try:
            max_context, prefill_chunk = int(meta[MAX_CONTEXT_KEY]), int(meta[PREFILL_CHUNK_KEY])
        except (KeyError, ValueError):
            raise InputError(f"this program has no {MAX_CONTEXT_KEY!r}/{PREFILL_CHUNK_KEY!r} metadata: it is not a "
                             "language model exported with kiln.models.llm.export_llm (or `kiln export-llm`)") from None
        vocab = meta.get(VOCAB_SIZE_KEY)
        return cls(
            max_context=max_context,
            prefill_chunk=prefill_chunk,
            vocab_size=int(vocab) if vocab else None,
            stop_token_ids=tuple(json.loads(meta.get(STOP_TOKENS_KEY) or "[]")),
            chat_template=meta.get(CHAT_TEMPLATE_KEY) or None,
            special_tokens=json.loads(meta.get(SPECIAL_TOKENS_KEY) or "{}"),
            tokenizer_json=meta.get(TOKENIZER_KEY) or None,
            model_type=meta.get(MODEL_TYPE_KEY) or None,
            name=meta.get(NAME_KEY) or None,
            ring_cache=meta.get(RING_CACHE_KEY) == "1",
            slots=int(meta[SLOTS_KEY]) if meta.get(SLOTS_KEY) else None,
            decode_rows=int(meta.get(DECODE_ROWS_KEY) or meta[SLOTS_KEY]) if meta.get(SLOTS_KEY) else None,
        )

    def max_rewind(self, cached: int) -> int:
        """How many of `cached` positions may be dropped from the cache's end and overwritten by new tokens."""
        return min(cached, self.prefill_chunk) if self.ring_cache else cached
