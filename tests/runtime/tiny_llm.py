"""A tiny exported language model with its tokenizer in the program, for the kiln.llm and `kiln generate` tests.

The model is kiln.models.zoo's random-weight Llama (vocabulary 128); the tokenizer is the zoo's word-level one
("w0".."w119" plus <s>, </s>, <|im_start|>, <|im_end|> and the chat roles), built with the `tokenizers` package,
with its ChatML-like template. Stop tokens are </s> (2) and <|im_end|> (4).
"""

from __future__ import annotations

import json

from kiln.export import ProgramBuilder
from kiln.models.llm import export_llama
from kiln.models.zoo import CHAT_TEMPLATE, tiny_decoder, tiny_tokenizer
from kiln.runtime.llm import info

MAX_CONTEXT = 64
CHUNK = 8
STOP_TOKENS = [2, 4]


def words(*ids: int) -> str:
    """The text of word tokens: words(5, 6) == "w5 w6" (w_i is token id i + 8)."""
    return " ".join(f"w{i}" for i in ids)


def tokenizer_metadata() -> dict[str, str]:
    tokenizer = tiny_tokenizer()
    return {info.TOKENIZER_KEY: tokenizer.backend_tokenizer.to_str(), info.CHAT_TEMPLATE_KEY: CHAT_TEMPLATE,
            info.SPECIAL_TOKENS_KEY: json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})}


def export_tiny_llm(family: str = "llama", with_tokenizer: bool = True, slots: int | None = None,
                    max_context: int = MAX_CONTEXT) -> tuple[object, ProgramBuilder]:
    """(eager model, exported program) with max_context 64 (unless given) and prefill chunks of 8; slots: a
    KV cache of that many sequences."""
    model = tiny_decoder(family)
    metadata = {info.VOCAB_SIZE_KEY: "128", info.STOP_TOKENS_KEY: json.dumps(STOP_TOKENS), info.NAME_KEY: "tiny"}
    if with_tokenizer:
        metadata.update(tokenizer_metadata())
    return model, export_llama(model, max_context, CHUNK, slots=slots, metadata=metadata)
