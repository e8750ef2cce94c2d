"""Speech in, text out with an exported Voxtral program (kiln.models.voxtral), torch-free: transcription, and
answers to a question about the audio.

Each 30 s window of audio becomes Whisper's log-mel features (the program's n_mels, 128), then `encode` turns them
into the decoder's embedding rows (375 a window). The prompt is Voxtral's (mistral_common's): a transcription
request <s>[INST][BEGIN_AUDIO][AUDIO] x 375[/INST]lang:en[TRANSCRIBE], a question <s>[INST][BEGIN_AUDIO][AUDIO] x
375 question[/INST]; its token rows come from `embed`, the [AUDIO] placeholders' rows are replaced by the window's
audio rows (as transformers' masked_scatter does), and `prefill_embeds` feeds them in chunks. Decoding is greedy
over `decode` until a stop token, the token budget or a full cache, as transformers' greedy generate.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from kiln.errors import InputError
from kiln.runtime.audio import SAMPLE_RATE, load_audio, whisper_log_mel
from kiln.runtime.audio.features import WHISPER_WINDOW_SAMPLES
from kiln.runtime.llm.decoding import greedy_continue, prefill_embedded
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.llm.tokenizer import LLMTokenizer
from kiln.runtime.program import Program, load
from kiln.runtime.speech.info import VoxtralInfo
from kiln.runtime.speech.transcript import Lap, Transcript, transcribe_windows


class VoxtralTranscriber:
    """Transcribes audio, or answers about it, with one Voxtral program on one backend (a session of its own)."""

    def __init__(self, program: Program | str | os.PathLike, backend: str = "cpu"):
        self.program = program if isinstance(program, Program) else load(program)
        self.info = VoxtralInfo.from_metadata(self.program.metadata)
        self.llm = LLMInfo.from_metadata(self.program.metadata)
        self.session = self.program.session(backend)
        self.tokenizer = LLMTokenizer.from_info(self.llm) if self.llm.tokenizer_json else None

    def _tokens(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError("this Voxtral program has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, windows: int, question: str | Sequence[int] | None = None,
               language: str | None = "en") -> list[int]:
        """The prompt's token ids for `windows` 30 s windows of audio: a transcription request without a
        question, else the question (text, or its token ids) after the audio."""
        t = self.info.prompt_tokens
        audio = [t["begin_audio"]] + [t["audio"]] * (self.info.audio_embeddings * windows)
        if question is None:
            language_ids = self._tokens(f"lang:{language}") if language else []
            return [t["bos"], t["inst"], *audio, t["inst_end"], *language_ids, t["transcribe"]]
        asked = self._tokens(question) if isinstance(question, str) else [int(i) for i in question]
        return [t["bos"], t["inst"], *audio, *asked, t["inst_end"]]

    def encode(self, samples: np.ndarray) -> list[np.ndarray]:
        """The decoder embedding rows [375, d] of each 30 s window of `samples` (mono, 16 kHz)."""
        starts = range(0, max(len(samples), 1), WHISPER_WINDOW_SAMPLES)
        return [self._encode(self._features(samples[begin:begin + WHISPER_WINDOW_SAMPLES])) for begin in starts]

    def _features(self, window: np.ndarray) -> np.ndarray:
        return whisper_log_mel(window, self.info.n_mels)

    def _encode(self, features: np.ndarray) -> np.ndarray:
        return np.asarray(self.session.backend.to_numpy(self.session.run("encode", features[None])[0]))

    def generate(self, audio: np.ndarray | str | os.PathLike, question: str | Sequence[int] | None = None,
                 max_new_tokens: int = 256, language: str | None = "en") -> list[int]:
        """Greedy token ids answering `question` about `audio` (a WAV file or mono 16 kHz samples), or its
        transcription without a question. The audio and the prompt must fit the program's cache."""
        samples = load_audio(audio, SAMPLE_RATE) if isinstance(audio, (str, os.PathLike)) else \
            np.asarray(audio, dtype=np.float32).reshape(-1)
        return self._answer(self.encode(samples), question, max_new_tokens, language, lambda phase: None)

    def _answer(self, windows: list[np.ndarray], question: str | Sequence[int] | None, max_new_tokens: int,
                language: str | None, lap: Lap) -> list[int]:
        ids = self.prompt(len(windows), question, language)
        logits = prefill_embedded(self.session, ids, self.info.prompt_tokens["audio"], np.concatenate(windows),
                                  self.llm)
        out = greedy_continue(self.session, logits, len(ids), max_new_tokens, set(self.llm.stop_token_ids), self.llm)
        lap("decode")
        return out

    def transcribe(self, audio: np.ndarray | str | os.PathLike, language: str | None = "en",
                   max_new_tokens: int | None = None,
                   on_window: Callable[[int, int, str], None] | None = None) -> Transcript:
        """The text of `audio` (a WAV file, or mono float samples at 16 kHz), one transcription request per 30 s
        window; on_window(index, count, text) as each window is done."""
        budget = self.llm.max_context - len(self.prompt(1, None, language))
        limit = budget if max_new_tokens is None else min(max_new_tokens, budget)

        def window(samples: np.ndarray, lap: Lap) -> tuple[list[int], str]:
            features = self._features(samples)
            lap("features")
            encoded = [self._encode(features)]
            lap("encode")
            ids = [t for t in self._answer(encoded, None, limit, language, lap) if t not in self.llm.stop_token_ids]
            text = self.tokenizer.decode(ids, skip_special_tokens=True).strip() if self.tokenizer else ""
            return ids, text

        return transcribe_windows(audio, WHISPER_WINDOW_SAMPLES, window, on_window)

    def answer(self, audio: np.ndarray | str | os.PathLike, question: str, max_new_tokens: int = 256) -> str:
        """The model's answer to `question` about `audio` (all of it in one prompt), as text."""
        ids = [t for t in self.generate(audio, question, max_new_tokens) if t not in self.llm.stop_token_ids]
        if self.tokenizer is None:
            raise InputError("this Voxtral program has no tokenizer to decode its answer with")
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


__all__ = ["VoxtralTranscriber"]
