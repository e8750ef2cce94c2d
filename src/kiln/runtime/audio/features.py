"""Log-mel features as the speech models were trained on them, in NumPy.

Both families take a power spectrogram (Hann-windowed STFT, 10 ms hop at 16 kHz) through a Slaney-style mel filter
bank (librosa's default, as transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")`); they differ
after that:

  Whisper  30 s windows (zero-padded or cut), 400-point FFT, the last frame dropped: 3000 frames; log10 floored at
           1e-10, then clamped to 8 decades below the window's peak and scaled as (x + 4) / 4.
  NeMo     (Parakeet, FastConformer) pre-emphasis 0.97, a 400-sample symmetric window in a 512-point FFT, zero
           padding at the ends, natural log of mel + 2^-24, then each mel bin normalized to zero mean and unit
           (unbiased) standard deviation over the frames that hold audio; the frame past them is zeroed.

The spectrogram and the filter products run in float64 and the result is float32, so both match the reference
extractors (transformers' WhisperFeatureExtractor and ParakeetFeatureExtractor, float32 torch.stft) to ~1e-5.
"""

from __future__ import annotations

import functools

import numpy as np

SAMPLE_RATE = 16000
WHISPER_WINDOW_SAMPLES = 30 * SAMPLE_RATE
"""Whisper reads 30 s at a time: 480000 samples, 3000 feature frames."""
WHISPER_N_FFT, WHISPER_HOP = 400, 160
NEMO_N_FFT, NEMO_WINDOW, NEMO_HOP, NEMO_PREEMPHASIS = 512, 400, 160, 0.97
NEMO_LOG_GUARD, NEMO_STD_GUARD = 2.0 ** -24, 1e-5


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (3 mels per 200 Hz) up to 1 kHz, logarithmic (27 mels per factor 6.4) above."""
    hz = np.asarray(hz, dtype=np.float64)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, 3.0 * hz / 200.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0)), 200.0 * mel / 3.0)


def mel_filters(n_fft: int, n_mels: int, rate: int = SAMPLE_RATE, fmin: float = 0.0,
                fmax: float | None = None) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters evenly spaced on the Slaney mel scale between fmin and fmax
    (default: the Nyquist rate), each scaled to unit area (Slaney normalization: 2 / its width in Hz)."""
    fmax = rate / 2 if fmax is None else fmax
    bins = np.linspace(0.0, rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    rising = (bins[None, :] - edges[:-2, None]) / (edges[1:-1] - edges[:-2])[:, None]
    falling = (edges[2:, None] - bins[None, :]) / (edges[2:] - edges[1:-1])[:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    return weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]


def power_spectrogram(x: np.ndarray, n_fft: int, hop: int, window: np.ndarray, pad_mode: str) -> np.ndarray:
    """|STFT|^2 [n_fft // 2 + 1, frames] of x, centered frames (x padded by n_fft // 2 each side, `pad_mode` as
    np.pad names it), the window zero-padded to n_fft in the middle, as torch.stft does."""
    if len(window) < n_fft:
        left = (n_fft - len(window)) // 2
        window = np.pad(window, (left, n_fft - len(window) - left))
    padded = np.pad(np.asarray(x, dtype=np.float64), n_fft // 2, mode=pad_mode)
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop]
    spectrum = np.fft.rfft(frames * window, axis=1)
    return (spectrum.real ** 2 + spectrum.imag ** 2).T


@functools.lru_cache(maxsize=8)
def _hann(length: int, periodic: bool) -> np.ndarray:
    n = length if periodic else length - 1
    return _frozen(0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(length) / n))


@functools.lru_cache(maxsize=8)
def _filter_bank(n_fft: int, n_mels: int, fmax: float | None) -> np.ndarray:
    """mel_filters at 16 kHz, made once per shape (every window of a transcription uses the same)."""
    return _frozen(mel_filters(n_fft, n_mels, fmax=fmax))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)  # shared by every caller of the caches above
    return a


def whisper_log_mel(samples: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """[n_mels, 3000] float32 features of one 30 s window: `samples` (mono, 16 kHz) zero-padded or cut to 30 s."""
    x = np.zeros(WHISPER_WINDOW_SAMPLES, dtype=np.float64)
    piece = np.asarray(samples, dtype=np.float64)[:WHISPER_WINDOW_SAMPLES]
    x[:len(piece)] = piece
    power = power_spectrogram(x, WHISPER_N_FFT, WHISPER_HOP, _hann(WHISPER_N_FFT, periodic=True), "reflect")
    mel = _filter_bank(WHISPER_N_FFT, n_mels, 8000.0) @ power[:, :-1]
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).astype(np.float32)


def nemo_log_mel(samples: np.ndarray, n_mels: int = 128) -> tuple[np.ndarray, int]:
    """NeMo's preprocessor features of `samples` (mono, 16 kHz): [n_mels, len // 160 + 1] float32 and the number
    of frames holding audio (len // 160; the one after them is zero), which the encoder takes as the length."""
    x = np.asarray(samples, dtype=np.float64)
    if len(x) < 2:
        raise ValueError(f"NeMo features need at least 2 samples, got {len(x)}")
    x = np.concatenate([x[:1], x[1:] - NEMO_PREEMPHASIS * x[:-1]])
    power = power_spectrogram(x, NEMO_N_FFT, NEMO_HOP, _hann(NEMO_WINDOW, periodic=False), "constant")
    log = np.log(_filter_bank(NEMO_N_FFT, n_mels, None) @ power + NEMO_LOG_GUARD)
    valid = len(x) // NEMO_HOP
    audio = log[:, :valid]
    mean = audio.mean(axis=1, keepdims=True)
    std = np.sqrt(((audio - mean) ** 2).sum(axis=1, keepdims=True) / max(valid - 1, 1))
    out = (log - mean) / (std + NEMO_STD_GUARD)
    out[:, valid:] = 0.0
    return out.astype(np.float32), valid
