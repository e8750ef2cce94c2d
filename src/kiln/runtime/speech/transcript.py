"""What a transcription returns, and the window loop every model family shares: load the audio, cut it into the
windows the model reads at once, run each, time its phases and report it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.runtime.audio import SAMPLE_RATE, load_audio

PHASES = ("features", "encode", "decode")


@dataclass
class Transcript:
    text: str
    windows: list[str]
    """The text of each window the audio was cut into (30 s for Whisper)."""
    token_ids: list[list[int]]
    """The emitted token ids of each window (no prompt, end of text or blank)."""
    audio_seconds: float
    seconds: float
    """Wall time of the transcription: features, encoder and decoding."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in features, encode and decode."""

    @property
    def real_time_factor(self) -> float:
        """Processing time over audio time: below 1 is faster than real time."""
        return self.seconds / self.audio_seconds if self.audio_seconds else float("nan")


Lap = Callable[[str], None]
"""lap(phase) adds the time since the previous lap (or the window's start) to that phase."""
WindowStep = Callable[[np.ndarray, Lap], tuple[list[int], str]]
"""One window's samples -> (its token ids, its text), calling lap after each phase."""


def transcribe_windows(audio: np.ndarray | str | os.PathLike, window: int, step: WindowStep,
                       on_window: Callable[[int, int, str], None] | None = None) -> Transcript:
    """`audio` (a WAV file, or mono float samples at 16 kHz) cut into windows of `window` samples, each through
    `step`; on_window(index, count, text) as each is done."""
    started = time.perf_counter()
    samples = load_audio(audio, SAMPLE_RATE) if isinstance(audio, (str, os.PathLike)) else \
        np.asarray(audio, dtype=np.float32).reshape(-1)
    timings = dict.fromkeys(PHASES, 0.0)
    starts = range(0, max(len(samples), 1), window)
    texts, ids = [], []
    for index, begin in enumerate(starts):
        last = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal last
            now = time.perf_counter()
            timings[phase] += now - last
            last = now

        window_ids, text = step(samples[begin:begin + window], lap)
        texts.append(text)
        ids.append(window_ids)
        if on_window is not None:
            on_window(index, len(starts), text)
    return Transcript(" ".join(t for t in texts if t), texts, ids, len(samples) / SAMPLE_RATE,
                      time.perf_counter() - started, timings)


def host_scores(session: Any, logits: Any) -> np.ndarray:
    """A method's logits as a float32 NumPy vector the decoding loop may edit (a copy off the GPU, or of the
    session's output)."""
    return np.array(session.backend.to_numpy(logits), dtype=np.float32).reshape(-1)
