"""Text in, token arrays out: a torch-free tokenizer for programs that take `input_ids` and `attention_mask`.

A Hugging Face `tokenizer.json` holds the whole pipeline (normalizer, WordPiece/BPE model, special-token template),
so the `tokenizers` package alone reproduces what transformers' tokenizer gives a model, without torch or
transformers. `tokenizers` is an optional dependency of the runtime (`pip install tokenizers`); it is imported
only when a tokenizer is made.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError("kiln.runtime.text needs the 'tokenizers' package to read tokenizer.json; install it with "
                          "`pip install tokenizers` (it does not need torch)") from None
    return tokenizers


class TextTokenizer:
    """Batches of strings -> (input_ids, attention_mask), both int64 [batch, seq], padded to the longest text.

    max_length: truncate each text to this many tokens (special tokens included); None keeps the file's own
    truncation setting. Padding uses the file's pad token (id 0, "[PAD]", for BERT).
    """

    def __init__(self, path: str | os.PathLike | None, max_length: int | None = None, json_text: str | None = None):
        tk = _tokenizers()
        self.path = os.fspath(path) if path is not None else None
        self._tok = tk.Tokenizer.from_str(json_text) if json_text is not None else tk.Tokenizer.from_file(self.path)
        padding = self._tok.padding or {}
        pad_id, pad_token = padding.get("pad_id", 0), padding.get("pad_token", "[PAD]")
        self._tok.enable_padding(pad_id=pad_id, pad_token=pad_token)  # to the longest text, not a fixed length
        if max_length is not None:
            self._tok.enable_truncation(max_length=max_length)
        truncation = self._tok.truncation
        self.max_length: int | None = truncation["max_length"] if truncation else None

    def __call__(self, texts: str | Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(texts, str):
            texts = [texts]
        if not texts:
            raise ValueError("give at least one text to tokenize")
        encodings = self._tok.encode_batch(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return ids, mask

    def tokens(self, text: str) -> list[str]:
        """The tokens of one text (special tokens included), for showing what the model sees."""
        return self._tok.encode(text).tokens  # padding to the longest of one text adds nothing


TOKENIZER_KEY = "kiln.text.tokenizer_json"
"""Program metadata: the whole tokenizer.json of a text encoder (an embedding program), so the file is enough."""


def program_tokenizer(metadata: dict[str, str], max_length: int | None = None) -> TextTokenizer | None:
    """The tokenizer a program carries in its metadata (TOKENIZER_KEY), or None."""
    text = metadata.get(TOKENIZER_KEY)
    return TextTokenizer(None, max_length, json_text=text) if text else None


def load_tokenizer(path: str | os.PathLike, max_length: int | None = None) -> TextTokenizer:
    """A TextTokenizer from a tokenizer.json file (or a directory that holds one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return TextTokenizer(path, max_length)


__all__ = ["TOKENIZER_KEY", "TextTokenizer", "load_tokenizer", "program_tokenizer"]
