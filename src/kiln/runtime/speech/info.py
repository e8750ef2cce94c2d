"""What an exported speech model's program says about itself: the metadata contract of kiln.models.whisper.

`export_whisper` writes these string entries and the runtime (kiln.runtime.speech, `kiln transcribe`) reads them,
so a .kiln file is all a user needs to transcribe audio. Keys are namespaced `kiln.speech.`; JSON where a value is
not a plain string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from kiln.errors import InputError

MODEL_KIND_KEY = "kiln.speech.kind"
"""The model family, which decides the features and the decoding: "whisper", "parakeet" or "voxtral"."""
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
LABELS_KEY = "kiln.speech.labels"
"""Parakeet: JSON list of the vocabulary's SentencePiece pieces in id order (the blank is the id after them)."""
DURATIONS_KEY = "kiln.speech.durations"
"""Parakeet: JSON list of the durations (in encoder frames) the joint's last outputs score."""
MAX_SYMBOLS_KEY = "kiln.speech.max_symbols"
"""Parakeet: most tokens emitted at one encoder frame before decoding moves on."""
SUBSAMPLING_KEY = "kiln.speech.subsampling"
"""Parakeet: feature frames per encoder frame (8)."""
AUDIO_EMBEDDINGS_KEY = "kiln.speech.audio_embeddings"
"""Voxtral: decoder embedding rows one 30 s window's audio becomes (375)."""
PROMPT_TOKENS_KEY = "kiln.speech.prompt_tokens"
"""Voxtral: JSON object of its prompt tokens' ids by role (bos, inst, inst_end, begin_audio, audio, transcribe)."""
KINDS = ("whisper", "parakeet", "voxtral")


def speech_kind(meta: Mapping[str, str]) -> str:
    """The program's speech model family, or an InputError saying it is not a speech program."""
    kind = meta.get(MODEL_KIND_KEY)
    if kind not in KINDS:
        raise InputError(f"this program is not a speech model kiln can transcribe with (its {MODEL_KIND_KEY!r} is "
                         f"{kind!r}; expected one of {list(KINDS)}): export one with `kiln export-whisper`, "
                         "`kiln export-parakeet` or `kiln export-voxtral`")
    return kind


Info = TypeVar("Info")


def _parsed(meta: Mapping[str, str], kind: str, title: str, command: str, build: Callable[[], Info]) -> Info:
    """build() for a program of this speech kind, with one error for another kind and one for missing or
    malformed metadata."""
    found = speech_kind(meta)
    if found != kind:
        raise InputError(f"this is a {found} program, not a {title} one")
    try:
        return build()
    except (KeyError, ValueError) as e:
        raise InputError(f"this {kind} program's speech metadata is incomplete or malformed ({e}); export it "
                         f"again with `kiln {command}`") from None


@dataclass(frozen=True)
class WhisperInfo:
    """The speech metadata of a Whisper program, parsed."""

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
    def from_metadata(cls, meta: Mapping[str, str]) -> WhisperInfo:
        return _parsed(meta, "whisper", "Whisper", "export-whisper", lambda: cls(
            kind="whisper", max_tokens=int(meta[MAX_TOKENS_KEY]), n_mels=int(meta[N_MELS_KEY]),
            vocab_size=int(meta[VOCAB_SIZE_KEY]), tokenizer_json=meta[TOKENIZER_KEY],
            suppress_tokens=tuple(json.loads(meta.get(SUPPRESS_KEY) or "[]")),
            begin_suppress_tokens=tuple(json.loads(meta.get(BEGIN_SUPPRESS_KEY) or "[]")),
            multilingual=meta.get(MULTILINGUAL_KEY) == "1", name=meta.get(NAME_KEY) or None))


@dataclass(frozen=True)
class ParakeetInfo:
    """The speech metadata of a Parakeet TDT program, parsed."""

    n_mels: int
    labels: tuple[str, ...]
    durations: tuple[int, ...]
    max_symbols: int
    subsampling: int
    name: str | None = None

    @property
    def blank(self) -> int:
        return len(self.labels)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> ParakeetInfo:
        return _parsed(meta, "parakeet", "Parakeet", "export-parakeet", lambda: cls(
            n_mels=int(meta[N_MELS_KEY]), labels=tuple(json.loads(meta[LABELS_KEY])),
            durations=tuple(json.loads(meta[DURATIONS_KEY])), max_symbols=int(meta[MAX_SYMBOLS_KEY]),
            subsampling=int(meta[SUBSAMPLING_KEY]), name=meta.get(NAME_KEY) or None))


VOXTRAL_ROLES = ("bos", "inst", "inst_end", "begin_audio", "audio", "transcribe")


@dataclass(frozen=True)
class VoxtralInfo:
    """The speech metadata of a Voxtral program, parsed (its decoder's cache and tokenizer: kiln.runtime.llm.info)."""

    n_mels: int
    audio_embeddings: int
    prompt_tokens: dict[str, int]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> VoxtralInfo:
        def build() -> VoxtralInfo:
            tokens = {role: int(t) for role, t in json.loads(meta[PROMPT_TOKENS_KEY]).items()}
            missing = [role for role in VOXTRAL_ROLES if role not in tokens]
            if missing:
                raise KeyError(f"prompt tokens {missing}")
            return cls(int(meta[N_MELS_KEY]), int(meta[AUDIO_EMBEDDINGS_KEY]), tokens)
        return _parsed(meta, "voxtral", "Voxtral", "export-voxtral", build)
