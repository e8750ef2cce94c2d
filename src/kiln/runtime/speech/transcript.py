"""What a transcription returns, whatever the model family."""

from __future__ import annotations

from dataclasses import dataclass, field


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
