"""Speech recognition with exported programs, torch-free: the audio front end (kiln.runtime.audio), the program's
speech metadata (info) and each model family's decoding (whisper)."""

from kiln.runtime.speech.info import SpeechInfo
from kiln.runtime.speech.whisper import Transcript, WhisperTranscriber

__all__ = ["SpeechInfo", "Transcript", "WhisperTranscriber"]
