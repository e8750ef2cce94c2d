"""Torch-free audio front end for speech programs: what `kiln transcribe` runs before the model.

  wav       read a WAV file (integer PCM of 8-32 bits or IEEE float, any channel count) as mono float32
  resample  band-limited (windowed-sinc) resampling to the model's rate, 16 kHz for Whisper and Parakeet
  features  log-mel features as each model family was trained on them: Whisper's (30 s windows, log10, clamped
            to 8 decades below the peak) and NeMo's (pre-emphasis, natural log, per-feature normalization)

Everything is NumPy; the features match transformers' WhisperFeatureExtractor and ParakeetFeatureExtractor (the
tests hold them to 1e-4).
"""

from kiln.runtime.audio.features import SAMPLE_RATE, mel_filters, nemo_log_mel, whisper_log_mel
from kiln.runtime.audio.resample import resample
from kiln.runtime.audio.wav import Audio, AudioFormatError, load_audio, read_wav

__all__ = ["SAMPLE_RATE", "Audio", "AudioFormatError", "load_audio", "mel_filters", "nemo_log_mel", "read_wav",
           "resample", "whisper_log_mel"]
