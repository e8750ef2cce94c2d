"""Speech to text with an exported Whisper program, torch-free: features, the encoder once per 30 s window, greedy
decoding one token at a time over the decoder's cache.

The prompt is Whisper's: <|startoftranscript|>, then for multilingual checkpoints the language and the task
(<|en|> <|transcribe|>), then <|notimestamps|>. Each step takes the highest-scoring token after removing the
suppressed tokens (and, at the first step, the ones suppressed at the beginning: a blank, the end of text), as
transformers' greedy `generate` does, until the end-of-text token or the window's token budget. Longer audio is
cut in consecutive 30 s windows whose texts are joined.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.errors import InputError
from kiln.runtime.audio import whisper_log_mel
from kiln.runtime.audio.features import WHISPER_WINDOW_SAMPLES
from kiln.runtime.llm.tokenizer import LLMTokenizer
from kiln.runtime.program import Program, load
from kiln.runtime.speech.info import WhisperInfo
from kiln.runtime.speech.transcript import Lap, Transcript, host_scores, transcribe_windows

TASKS = ("transcribe", "translate")


class WhisperTranscriber:
    """Transcribes audio with one Whisper program on one backend (a session of its own)."""

    def __init__(self, program: Program | str | os.PathLike, backend: str = "cpu"):
        self.program = program if isinstance(program, Program) else load(program)
        self.info = WhisperInfo.from_metadata(self.program.metadata)
        self.session = self.program.session(backend)
        self.tokenizer = LLMTokenizer(self.info.tokenizer_json)
        self.end_of_text = self._special("<|endoftext|>")
        self.start = self._special("<|startoftranscript|>")
        self.no_timestamps = self._special("<|notimestamps|>")

    def _special(self, token: str) -> int:
        token_id = self.tokenizer.token_id(token)
        if token_id is None:
            raise InputError(f"the program's tokenizer has no {token} token: not a Whisper tokenizer")
        return token_id

    def prompt(self, language: str | None = "en", task: str = "transcribe") -> list[int]:
        """The decoder's first tokens for a window."""
        if task not in TASKS:
            raise InputError(f"task must be one of {TASKS}, got {task!r}")
        if not self.info.multilingual:
            if task != "transcribe" or (language or "en") != "en":
                raise InputError(f"this Whisper model is English-only: it cannot {task} {language!r}")
            return [self.start, self.no_timestamps]
        language_id = self.tokenizer.token_id(f"<|{language or 'en'}|>")
        if language_id is None:
            raise InputError(f"this Whisper model has no language {language!r} (give a code such as en, de, fr)")
        return [self.start, language_id, self._special(f"<|{task}|>"), self.no_timestamps]

    def transcribe(self, audio: np.ndarray | str | os.PathLike, language: str | None = "en",
                   task: str = "transcribe", max_new_tokens: int | None = None,
                   on_window: Callable[[int, int, str], None] | None = None) -> Transcript:
        """The text of `audio`: a WAV file, or mono float samples at 16 kHz. on_window(index, count, text) is
        called as each 30 s window is done (progress for long audio)."""
        prompt = self.prompt(language, task)
        budget = self.info.max_tokens - len(prompt)
        limit = budget if max_new_tokens is None else min(max_new_tokens, budget)

        def window(samples: np.ndarray, lap: Lap) -> tuple[list[int], str]:
            features = whisper_log_mel(samples, self.info.n_mels)
            lap("features")
            self.session.run("encode", features[None])
            lap("encode")
            ids = self._greedy(prompt, limit)
            lap("decode")
            return ids, self.tokenizer.decode(ids, skip_special_tokens=True).strip()

        return transcribe_windows(audio, WHISPER_WINDOW_SAMPLES, window, on_window)

    def _greedy(self, prompt: list[int], limit: int) -> list[int]:
        """Generated token ids after `prompt` (its positions from 0), up to the end of text or `limit` tokens."""
        logits: Any = None
        for position, token in enumerate(prompt):
            logits = self._step(token, position)
        suppress = np.array(self.info.suppress_tokens, dtype=np.int64)
        begin = np.array(self.info.begin_suppress_tokens, dtype=np.int64)
        out: list[int] = []
        while len(out) < limit:
            scores = host_scores(self.session, logits)
            scores[suppress] = -np.inf
            if not out:
                scores[begin] = -np.inf
            token = int(np.argmax(scores))
            if token == self.end_of_text:
                break
            out.append(token)
            if len(out) < limit:
                logits = self._step(token, len(prompt) + len(out) - 1)
        return out

    def _step(self, token: int, position: int) -> Any:
        return self.session.run("decode", np.array([[token]], dtype=np.int64),
                                np.array([position], dtype=np.int64))[0]
