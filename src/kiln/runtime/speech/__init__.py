"""Speech recognition with exported programs, torch-free: the audio front end (kiln.runtime.audio), the program's
speech metadata (info) and each model family's decoding (whisper, parakeet); `transcriber` opens any of them."""

from __future__ import annotations

import os

from kiln.runtime.program import Program, load
from kiln.runtime.speech.info import ParakeetInfo, VoxtralInfo, WhisperInfo, speech_kind
from kiln.runtime.speech.parakeet import ParakeetTranscriber
from kiln.runtime.speech.transcript import Transcript
from kiln.runtime.speech.voxtral import VoxtralTranscriber
from kiln.runtime.speech.whisper import WhisperTranscriber

TRANSCRIBERS = {"whisper": WhisperTranscriber, "parakeet": ParakeetTranscriber, "voxtral": VoxtralTranscriber}
"""The transcriber of each speech model family, by the program's kiln.speech.kind."""


def transcriber(program: Program | str | os.PathLike,
                backend: str = "cpu") -> WhisperTranscriber | ParakeetTranscriber | VoxtralTranscriber:
    """The transcriber for a speech program of any family."""
    program = program if isinstance(program, Program) else load(program)
    return TRANSCRIBERS[speech_kind(program.metadata)](program, backend)


__all__ = ["TRANSCRIBERS", "ParakeetInfo", "ParakeetTranscriber", "Transcript", "VoxtralInfo", "VoxtralTranscriber",
           "WhisperInfo", "WhisperTranscriber", "speech_kind", "transcriber"]
