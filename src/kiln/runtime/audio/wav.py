"""WAV files as mono float32 samples.

The RIFF container is read by hand: Python's `wave` module takes integer PCM only, and speech tools write float
WAVs too. Every sample format a recorder or a synthesizer writes is read: unsigned 8-bit, signed 16-, 24- and
32-bit PCM, 32- and 64-bit IEEE float, plain or in WAVE_FORMAT_EXTENSIBLE. Integer samples are scaled to [-1, 1)
and channels are mixed down by their mean, as the speech models' own loaders do.

The file is untrusted: every size is checked against the bytes actually present (a chunk that claims more than the
file holds gets what is there), the sample rate must lie in RATES (a rate of 1 Hz or 4 GHz would make resampling
to 16 kHz allocate without bound), and anything malformed raises AudioFormatError, never a struct or NumPy error.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import FileFormatError

PCM, IEEE_FLOAT, EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
"""WAVE format tags (an extensible file names PCM or float in the first two bytes of its subformat GUID)."""
RATES = range(1000, 1_000_001)
"""Sample rates kiln reads (1 kHz to 1 MHz): beyond them resampling to a speech model's 16 kHz would grow the audio
by more than 16x or need filters of thousands of taps, which no real recording asks for."""


class AudioFormatError(FileFormatError):
    """An audio file kiln cannot read: not a WAV, truncated, or a sample format it does not decode."""


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray
    """float32 [n]: the channels' mean, integer PCM scaled to [-1, 1)."""
    rate: int
    """Samples per second."""
    channels: int
    """Channels in the file, before the mix-down."""

    @property
    def duration(self) -> float:
        """Seconds."""
        return len(self.samples) / self.rate


def read_wav(source: str | os.PathLike | bytes) -> Audio:
    """The samples of a WAV file (a path or the file's bytes), mixed down to mono."""
    data = memoryview(bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) else _file_bytes(source))
    where = "" if isinstance(source, (bytes, bytearray, memoryview)) else f" ({source})"
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioFormatError(f"not a WAV file{where}: it does not start with RIFF....WAVE")
    fmt, samples = _chunks(data, where)
    tag, channels, rate, bits = fmt
    frame = bits // 8 * channels
    frames = len(samples) // frame
    with np.errstate(over="ignore"):  # float64 samples past float32's range become inf, refused just below
        values = _DECODERS[(tag, bits)](samples[:frames * frame])
    if tag == IEEE_FLOAT and not np.isfinite(values).all():
        raise AudioFormatError(f"WAV file{where} has NaN or infinite samples")
    mono = values.reshape(frames, channels).mean(axis=1, dtype=np.float64).astype(np.float32)
    return Audio(mono, rate, channels)


def _file_bytes(path: str | os.PathLike) -> bytes:
    """A regular file's bytes: a device or a pipe (/dev/zero, /dev/stdin) could be read forever. A missing file
    stays FileNotFoundError, a folder IsADirectoryError."""
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise AudioFormatError(f"{path} is not a regular file (a device or a pipe?): kiln reads WAV files")
    return path.read_bytes()


def _chunks(data: memoryview, where: str) -> tuple[tuple[int, int, int, int], memoryview]:
    """(the checked fmt chunk, the data chunk's bytes) of a RIFF/WAVE file. A size that runs past the file's end is
    cut to what is there (a writer that streamed may leave the data size wrong), so no size read from the file
    ever decides how much is allocated."""
    fmt, at = None, 12
    while at + 8 <= len(data):
        chunk, size = bytes(data[at:at + 4]), struct.unpack_from("<I", data, at + 4)[0]
        body = data[at + 8:at + 8 + size]
        if chunk == b"fmt ":
            fmt = _format(body, where)
        elif chunk == b"data":
            if fmt is None:
                raise AudioFormatError(f"WAV file{where} has no 'fmt ' chunk before its samples")
            return fmt, body
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    if fmt is None:
        raise AudioFormatError(f"WAV file{where} has no 'fmt ' chunk before its samples")
    raise AudioFormatError(f"WAV file{where} has no 'data' chunk")


def _format(body: memoryview, where: str) -> tuple[int, int, int, int]:
    """(format tag, channels, rate, bits per sample) of a fmt chunk, checked."""
    if len(body) < 16:
        raise AudioFormatError(f"WAV file{where}: its 'fmt ' chunk is {len(body)} bytes, at least 16 expected")
    tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
    if tag == EXTENSIBLE:
        if len(body) < 26:
            raise AudioFormatError(f"WAV file{where}: an extensible 'fmt ' chunk without its subformat")
        tag = struct.unpack_from("<H", body, 24)[0]
    if channels == 0 or rate == 0:
        raise AudioFormatError(f"WAV file{where}: {channels} channels at {rate} Hz")
    if rate not in RATES:
        raise AudioFormatError(f"WAV file{where}: a sample rate of {rate} Hz; kiln reads {RATES.start} Hz to "
                               f"{RATES.stop - 1} Hz (resample it with ffmpeg or sox)")
    if (tag, bits) not in _DECODERS:
        kind = {PCM: "integer PCM", IEEE_FLOAT: "float"}.get(tag, f"format tag 0x{tag:04x} (compressed)")
        raise AudioFormatError(f"WAV file{where}: {kind} with {bits}-bit samples is not supported; kiln reads "
                               "8/16/24/32-bit integer PCM and 32/64-bit float (convert it with ffmpeg or sox)")
    return tag, channels, rate, bits


def _pcm24(raw: bytes) -> np.ndarray:
    b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
    value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return (np.where(value >= 1 << 23, value - (1 << 24), value) / float(1 << 23)).astype(np.float32)


_DECODERS = {
    (PCM, 8): lambda raw: (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0,
    (PCM, 16): lambda raw: np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0,
    (PCM, 24): _pcm24,
    (PCM, 32): lambda raw: (np.frombuffer(raw, "<i4") / float(1 << 31)).astype(np.float32),
    (IEEE_FLOAT, 32): lambda raw: np.frombuffer(raw, "<f4").astype(np.float32),
    (IEEE_FLOAT, 64): lambda raw: np.frombuffer(raw, "<f8").astype(np.float32),
}


def load_audio(source: str | os.PathLike | bytes, rate: int = 16000) -> np.ndarray:
    """A WAV file's mono samples at `rate` (resampled when the file has another)."""
    from kiln.runtime.audio.resample import resample

    audio = read_wav(source)
    return audio.samples if audio.rate == rate else resample(audio.samples, audio.rate, rate)
