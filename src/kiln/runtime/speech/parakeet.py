"""Speech to text with an exported Parakeet TDT program, torch-free: NeMo's features, the encoder once per window,
then greedy token-and-duration decoding.

The loop is NeMo's default (greedy_batch, label looping; docs/parakeet-tdt-notes.md section 5.3): at encoder frame
t the joint scores the tokens, the blank and each duration. A blank never stays on its frame (duration 0 becomes
1), and blanks are skipped without touching the prediction network. A token is emitted, the prediction network
takes it (its LSTM state changes only then), and t moves by the token's duration: a duration of 0 scores the same
frame again. After max_symbols tokens on one frame, t moves on by one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.runtime.audio import nemo_log_mel
from kiln.runtime.audio.features import NEMO_HOP
from kiln.runtime.program import Program, load
from kiln.runtime.speech.info import ParakeetInfo
from kiln.runtime.speech.transcript import Lap, Transcript, host_scores, transcribe_windows

WORD_START = "\u2581"
"""SentencePiece's word-boundary mark at the start of a piece: a space in the text."""


class ParakeetTranscriber:
    """Transcribes audio with one Parakeet TDT program on one backend (a session of its own)."""

    def __init__(self, program: Program | str | os.PathLike, backend: str = "cpu"):
        self.program = program if isinstance(program, Program) else load(program)
        self.info = ParakeetInfo.from_metadata(self.program.metadata)
        self.session = self.program.session(backend)
        (frames,) = self.program.method("encode").symbols
        self.min_frames, self.max_frames = frames.min, frames.max
        h, _ = self.program.method("predict").input_specs()[1:]
        self.state_shape = tuple(int(d) for d in h.shape)

    def text(self, token_ids: list[int]) -> str:
        """The SentencePiece pieces joined, word marks as spaces."""
        return "".join(self.info.labels[t] for t in token_ids).replace(WORD_START, " ").strip()

    def transcribe(self, audio: np.ndarray | str | os.PathLike,
                   on_window: Callable[[int, int, str], None] | None = None) -> Transcript:
        """The text of `audio`: a WAV file, or mono float samples at 16 kHz. Audio longer than the program's
        encoder takes at once is cut into windows; on_window(index, count, text) reports each."""
        shortest = self.min_frames * NEMO_HOP

        def window(samples: np.ndarray, lap: Lap) -> tuple[list[int], str]:
            if len(samples) < shortest:  # too short for the encoder: pad with silence
                samples = np.pad(samples, (0, shortest - len(samples)))
            features, frames = nemo_log_mel(samples, self.info.n_mels)
            lap("features")
            (encoded,) = self.session.run("encode", features[None, :, :frames])
            lap("encode")
            ids = self._greedy(encoded[0])
            lap("decode")
            return ids, self.text(ids)

        return transcribe_windows(audio, self.max_frames * NEMO_HOP, window, on_window)

    def _greedy(self, encoded: Any) -> list[int]:
        """Token ids of one window from its projected encoder frames [T, joint_hidden]."""
        blank, durations, frames = self.info.blank, self.info.durations, encoded.shape[0]
        h = np.zeros(self.state_shape, dtype=np.float32)
        g, h, c = self.session.run("predict", np.array([[blank]], dtype=np.int64), h, h.copy())

        def score(t: int) -> tuple[int, int]:
            logits = self.session.run("joint", encoded[t:t + 1], g)[0]
            logits = host_scores(self.session, logits)
            label = int(np.argmax(logits[:blank + 1]))
            duration = durations[int(np.argmax(logits[blank + 1:]))]
            return label, 1 if label == blank and duration == 0 else duration

        out: list[int] = []
        t, last_frame, on_frame = 0, -1, 0
        while t < frames:
            frame = t
            label, duration = score(t)
            t += duration
            while label == blank and t < frames:
                frame = t
                label, duration = score(t)
                t += duration
            if label == blank:
                break
            out.append(label)
            g, h, c = self.session.run("predict", np.array([[label]], dtype=np.int64), h, c)
            on_frame = on_frame + 1 if frame == last_frame else 1
            last_frame = frame
            if on_frame >= self.info.max_symbols and frame == t:
                t += 1
        return out
