"""What an exported speech model's program says about itself: the metadata contract of kiln.models.whisper.

`export_whisper` writes these string entries and the runtime (kiln.runtime.speech, `kiln transcribe`) reads them,
so a .kiln file is all a user needs to transcribe audio. Keys are namespaced `kiln.speech.`; JSON where a value is
not a plain string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from kiln.errors import InputError

MODEL_KIND_KEY = "kiln.speech.kind"
"""The model family, which decides the features and the decoding: "whisper"."""
MAX_TOKENS_KEY = "kiln.speech.max_tokens"
"""Decoder cache slots: the prompt and the generated tokens of one 30 s window together."""
N_MELS_KEY = "kiln.speech.n_mels"
VOCAB_SIZE_KEY = "kiln.speech.vocab_size"
TOKENIZER_KEY = "kiln.speech.tokenizer_json"
"""The whole tokenizer.json (Hugging Face `tokenizers` format)."""
SUPPRESS_KEY = "kiln.speech.suppress_tokens"
"""JSON list of token ids never generated (the generation config's suppress_tokens)."""
BEGIN_SUPPRESS_KEY = "kiln.speech.begin_suppress_tokens"
"""JSON list of token ids not generated first (a blank, end of text)."""
MULTILINGUAL_KEY = "kiln.speech.multilingual"
""""1" when the prompt names a language and a task (multilingual checkpoints); "0" for the English-only ones."""
NAME_KEY = "kiln.speech.name"
KINDS = ("whisper",)


@dataclass(frozen=True)
class SpeechInfo:
    """The speech metadata of one program, parsed."""

    kind: str
    max_tokens: int
    n_mels: int
    vocab_size: int
    tokenizer_json: str
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    multilingual: bool = False
    name: str | None = None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> SpeechInfo:
        kind = meta.get(MODEL_KIND_KEY)
        if kind not in KINDS:
            raise InputError(f"this program is not a speech model kiln can transcribe with (its {MODEL_KIND_KEY!r} is "
                             f"{kind!r}; expected one of {list(KINDS)}): export one with `kiln export-whisper`")
        try:
            return cls(kind=kind, max_tokens=int(meta[MAX_TOKENS_KEY]), n_mels=int(meta[N_MELS_KEY]),
                       vocab_size=int(meta[VOCAB_SIZE_KEY]), tokenizer_json=meta[TOKENIZER_KEY],
                       suppress_tokens=tuple(json.loads(meta.get(SUPPRESS_KEY) or "[]")),
                       begin_suppress_tokens=tuple(json.loads(meta.get(BEGIN_SUPPRESS_KEY) or "[]")),
                       multilingual=meta.get(MULTILINGUAL_KEY) == "1", name=meta.get(NAME_KEY) or None)
        except (KeyError, ValueError) as e:
            raise InputError(f"this {kind} program's speech metadata is incomplete or malformed ({e}); export it "
                             "again with `kiln export-whisper`") from None
