"""The audio front end (kiln.runtime.audio): WAV files of every sample format read by hand, resampling, and the
Whisper and NeMo log-mel features against transformers' extractors to 1e-4, torch-free."""

from __future__ import annotations

import io
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from kiln.models.whisper_packages import package_dir
from kiln.runtime.audio import (
    AudioFormatError,
    load_audio,
    mel_filters,
    nemo_log_mel,
    read_wav,
    resample,
    whisper_log_mel,
)
from tests.runtime.test_torch_free import run_python

RNG = np.random.default_rng(0)


def riff(*chunks: tuple[bytes, bytes]) -> bytes:
    """A RIFF/WAVE file of the given (id, body) chunks, each padded to an even size."""
    body = b"".join(cid + struct.pack("<I", len(data)) + data + b"\0" * (len(data) & 1) for cid, data in chunks)
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WAVE" + body


def fmt_chunk(tag: int, channels: int, rate: int, bits: int, extensible: bool = False) -> tuple[bytes, bytes]:
    align = channels * bits // 8
    body = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * align, align, bits)
    if extensible:  # cbSize, valid bits, channel mask, subformat GUID (the tag in its first two bytes)
        body += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + bytes(14)
    return b"fmt ", body


def encode(values: np.ndarray, tag: int, bits: int) -> bytes:
    """Samples in [-1, 1) as a WAV's data chunk stores them."""
    if tag == 3:
        return values.astype(f"<f{bits // 8}").tobytes()
    if bits == 8:
        return np.round(values * 128 + 128).astype(np.uint8).tobytes()
    ints = np.round(values * 2.0 ** (bits - 1)).astype(np.int64)
    if bits == 24:
        return b"".join(int(v & 0xFFFFFF).to_bytes(3, "little") for v in ints)
    return ints.astype(f"<i{bits // 8}").tobytes()


@pytest.mark.parametrize("tag,bits,tol", [(1, 8, 1 / 128), (1, 16, 2.0 ** -15), (1, 24, 2.0 ** -23),
                                          (1, 32, 1e-7), (3, 32, 0.0), (3, 64, 1e-7)],
                         ids=["pcm8", "pcm16", "pcm24", "pcm32", "float32", "float64"])
@pytest.mark.parametrize("extensible", [False, True], ids=["plain", "extensible"])
def test_every_sample_format_reads_back(tag, bits, tol, extensible):
    stereo = np.clip(RNG.standard_normal((50, 2)) * 0.3, -1, 0.99)
    data = riff(fmt_chunk(tag, 2, 22050, bits, extensible), (b"data", encode(stereo.reshape(-1), tag, bits)))
    audio = read_wav(data)
    assert (audio.rate, audio.channels, audio.samples.dtype, audio.samples.shape) == (22050, 2, np.float32, (50,))
    np.testing.assert_allclose(audio.samples, stereo.mean(axis=1), atol=tol + 1e-7)


def test_sixteen_bit_matches_the_standard_library(tmp_path):
    values = (RNG.standard_normal(1000) * 8000).astype(np.int16)
    path = tmp_path / "mono.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes(values.tobytes())
    audio = read_wav(path)
    assert audio.rate == 8000 and audio.duration == 1000 / 8000
    np.testing.assert_array_equal(audio.samples, values / np.float32(32768))


def test_chunks_around_the_samples_and_a_streamed_size():
    """An odd-sized chunk before fmt (padded), one after the samples, and a data size past the file's end (as a
    writer that streamed leaves it): the whole frames present are read."""
    samples = encode(np.array([0.5, -0.25, 0.125]), 1, 16)
    data = riff((b"LIST", b"abc"), fmt_chunk(1, 1, 16000, 16), (b"data", samples), (b"cue ", b"1234"))
    np.testing.assert_array_equal(read_wav(data).samples, [0.5, -0.25, 0.125])
    streamed = riff((b"fmt ", fmt_chunk(1, 1, 16000, 16)[1])) + b"data" + struct.pack("<I", 1 << 30) + samples + b"\1"
    np.testing.assert_array_equal(read_wav(streamed).samples, [0.5, -0.25, 0.125])


@pytest.mark.parametrize("data,message", [
    (b"OggS" + bytes(40), "not a WAV file"),
    (riff((b"data", bytes(4))), "no 'fmt ' chunk"),
    (riff(fmt_chunk(1, 1, 16000, 16)), "no 'data' chunk"),
    (riff(fmt_chunk(0x11, 1, 16000, 4), (b"data", bytes(8))), "compressed"),
    (riff(fmt_chunk(1, 1, 16000, 12), (b"data", bytes(8))), "12-bit samples is not supported"),
    (riff(fmt_chunk(1, 0, 16000, 16), (b"data", bytes(8))), "0 channels"),
], ids=["ogg", "no-fmt", "no-data", "adpcm", "12-bit", "no-channels"])
def test_what_it_cannot_read_says_why(data, message):
    with pytest.raises(AudioFormatError, match=message):
        read_wav(data)


def test_resampling_keeps_a_tone_and_gives_ceil_length():
    t = np.arange(44100) / 44100
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    out = resample(tone, 44100, 16000)
    assert out.dtype == np.float32 and out.shape == (16000,)
    want = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert np.abs(out - want)[100:-100].max() < 1e-3  # the edges see the zero padding
    assert resample(tone[:1001], 48000, 16000).shape == (334,)  # ceil(1001 / 3)
    assert resample(tone, 16000, 16000) is tone
    up = resample(out, 16000, 48000)
    assert up.shape == (48000,) and np.abs(up[::3] - out)[100:-100].max() < 1e-3
    np.testing.assert_allclose(resample(np.ones((2, 900)), 48000, 16000)[:, 20:-20], 1.0, atol=1e-3)


def test_resampling_removes_what_the_new_rate_cannot_hold():
    """A 7 kHz tone at 48 kHz is above the 4 kHz Nyquist rate of 8 kHz: resampling filters it out, not folds it."""
    t = np.arange(48000) / 48000
    out = resample(np.sin(2 * np.pi * 7000 * t), 48000, 8000)
    assert np.abs(out[100:-100]).max() < 1e-2


def test_load_audio_resamples_to_the_rate_asked(tmp_path):
    path = tmp_path / "a.wav"
    path.write_bytes(riff(fmt_chunk(3, 1, 8000, 32), (b"data", encode(np.full(800, 0.5), 3, 32))))
    got = load_audio(path, 16000)
    assert got.shape == (1600,) and abs(float(got[100:-100].mean()) - 0.5) < 1e-3


def beckett_path() -> Path:
    """The speech sample useful-moonshine-onnx ships (make setup installs it); the test skips without it."""
    try:
        return package_dir("moonshine_onnx", "useful-moonshine-onnx") / "assets" / "beckett.wav"
    except FileNotFoundError:
        pytest.skip("useful-moonshine-onnx (the speech sample) is not installed")


def _beckett() -> np.ndarray:
    return read_wav(beckett_path()).samples


def _synthetic(seconds: float) -> np.ndarray:
    """A chirp in noise that is louder at low frequencies (the inverse of NeMo's pre-emphasis, so every mel bin
    holds energy after it, as in speech): a float32 STFT, as the reference extractors take, is then accurate in every
    bin. Over a flat noise floor the float32 reference's own rounding shows in the quietest bins."""
    n = int(seconds * 16000)
    rng = np.random.default_rng(n)
    tilt = 1.0 - 0.97 * np.exp(-2j * np.pi * np.fft.rfftfreq(n))
    noise = np.fft.irfft(np.fft.rfft(rng.standard_normal(n)) / tilt, n)
    t = np.arange(n) / 16000
    chirp = np.sin(2 * np.pi * (100 + 1500 * t) * t) * np.exp(-((t % 1.0) - 0.5) ** 2 * 8)
    return (0.1 * chirp + 0.05 * noise / noise.std()).astype(np.float32)


AUDIO = {"beckett": _beckett, "short": lambda: _synthetic(3.3), "long": lambda: _synthetic(31.7)}


def test_mel_filters_match_transformers():
    audio_utils = pytest.importorskip("transformers.audio_utils")
    for n_fft, n_mels, fmax in ((400, 80, 8000.0), (400, 128, 8000.0), (512, 128, 8000.0), (512, 80, 6000.0)):
        want = audio_utils.mel_filter_bank(num_frequency_bins=n_fft // 2 + 1, num_mel_filters=n_mels,
                                           min_frequency=0.0, max_frequency=fmax, sampling_rate=16000,
                                           norm="slaney", mel_scale="slaney")
        np.testing.assert_allclose(mel_filters(n_fft, n_mels, fmax=fmax), want.T, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("clip", sorted(AUDIO))
@pytest.mark.parametrize("n_mels", [80, 128])
def test_whisper_features_match_transformers(clip, n_mels):
    transformers = pytest.importorskip("transformers")
    samples = AUDIO[clip]()
    extractor = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    want = extractor(samples, sampling_rate=16000, return_tensors="np").input_features[0]
    got = whisper_log_mel(samples, n_mels)
    assert got.shape == (n_mels, 3000) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("clip", sorted(AUDIO))
@pytest.mark.parametrize("n_mels", [80, 128])
def test_nemo_features_match_transformers_parakeet(clip, n_mels):
    parakeet = pytest.importorskip("transformers.models.parakeet")
    samples = AUDIO[clip]()
    out = parakeet.ParakeetFeatureExtractor(feature_size=n_mels)(samples, sampling_rate=16000, return_tensors="np")
    got, frames = nemo_log_mel(samples, n_mels)
    assert frames == int(out.attention_mask.sum()) == len(samples) // 160
    assert got.shape == (n_mels, frames + 1) and got.dtype == np.float32
    # 1e-4, relative where the feature is above 1 in size: a frame's quietest bins lie 5 standard deviations out,
    # where the float32 reference's rounding reaches 3e-5 of the value
    np.testing.assert_allclose(got, out.input_features[0].T, atol=1e-4, rtol=1e-4)


def test_the_front_end_runs_without_torch(tmp_path):
    path = tmp_path / "tone.wav"
    stereo = np.tile(_synthetic(22050 / 16000)[:, None], 2)  # 22050 frames: half a second at 44.1 kHz
    path.write_bytes(riff(fmt_chunk(1, 2, 44100, 16), (b"data", encode(stereo.reshape(-1), 1, 16))))
    script = ("import sys; sys.modules['torch'] = None\n"
              "from kiln.runtime.audio import load_audio, whisper_log_mel, nemo_log_mel\n"
              f"x = load_audio({str(path)!r})\n"
              "print(x.shape, whisper_log_mel(x).shape, nemo_log_mel(x)[0].shape)\n"
              "assert sys.modules['torch'] is None and 'transformers' not in sys.modules")
    result = run_python("-c", script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "(8000,) (80, 3000) (128, 51)"


def test_bytes_and_file_objects_are_not_mixed_up():
    """A path that happens to be given as bytes of a file's contents is read as contents."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.zeros(10, np.int16).tobytes())
    assert read_wav(buffer.getvalue()).samples.shape == (10,)
