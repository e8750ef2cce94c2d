"""Every reader of a file kiln did not write refuses bad input with its own error, fuzzed: WAV files and images here
(tests/models/test_reader_fuzz_models.py: GGUF, .nemo, CTranslate2 model.bin), with the mutator they share.

The mutator knows each format's fields: it lies in size and count fields (0, 1, off by one, the file's length,
2**31, all ones), truncates at every field boundary, and flips, overwrites, inserts, deletes and duplicates bytes.
A fixed seed makes each run the same sample. Every mutant must either read or raise the reader's documented error;
anything else is an escape: another exception, a call that runs past HANG_SECONDS, or one whose Python and NumPy
allocations (tracemalloc sees both) peak past the format's cap.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import random
import signal
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.audio import AudioFormatError, load_audio, read_wav, resample
from kiln.runtime.vision import MAX_PIXELS, ImageFormatError, load_image

HANG_SECONDS = 10.0
"""A reader that takes longer on a file of a few KB is stuck (the slowest mutant here takes well under 1 s)."""

LIES = (0, 1, 2, 7, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 1 << 31, (1 << 32) - 1, (1 << 63) - 1, (1 << 64) - 1)
"""Values a lying size or count field is set to (cut to the field's width), besides off-by-one and the file's own
length."""


@dataclass(frozen=True)
class Field:
    """An integer field of a format: where it is, its struct format ('<I', '<Q', ...) and what it is."""

    offset: int
    fmt: str
    name: str

    @property
    def end(self) -> int:
        return self.offset + struct.calcsize(self.fmt)


@dataclass
class Sample:
    """A valid file and its fields: what the mutator starts from."""

    data: bytes
    fields: list[Field]
    name: str = "sample"


class Hang(Exception):
    """Raised by the alarm when a reader runs past HANG_SECONDS."""


@dataclass
class Tally:
    """How many mutants read, how many were refused with the documented error, and every escape."""

    read: int = 0
    refused: int = 0
    escapes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.read + self.refused + len(self.escapes)

    def __str__(self) -> str:
        return f"{self.total} mutants: {self.read} read, {self.refused} refused, {len(self.escapes)} escapes"


def lie(data: bytes, f: Field, value: int) -> bytes:
    width = struct.calcsize(f.fmt)
    packed = (value % (1 << (8 * width))).to_bytes(width, "little")
    return data[:f.offset] + packed + data[f.end:]


def truncations(sample: Sample) -> Iterator[tuple[str, bytes]]:
    """The sample cut at every field boundary (each field's start, end and middle)."""
    cuts = sorted({c for f in sample.fields for c in (f.offset, f.end, (f.offset + f.end) // 2)} | {0})
    for cut in cuts:
        if cut < len(sample.data):
            yield f"truncated at {cut}", sample.data[:cut]


def lies(sample: Sample) -> Iterator[tuple[str, bytes]]:
    """Every field set to every lie, and to its own value +-1."""
    for f in sample.fields:
        own = struct.unpack_from(f.fmt, sample.data, f.offset)[0]
        for value in (*LIES, len(sample.data), own + 1, own - 1):
            yield f"{f.name}@{f.offset}={value}", lie(sample.data, f, value)


def random_mutant(sample: Sample, rng: random.Random) -> tuple[str, bytes]:
    """One random edit, or a few stacked: bit flips, a byte overwritten, bytes inserted, deleted or duplicated, a
    field lying, or a cut."""
    data, steps = sample.data, []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        kind = rng.choice(("flip", "byte", "insert", "delete", "duplicate", "lie", "lie", "truncate"))
        at = rng.randrange(max(len(data), 1))
        if kind == "flip" and data:
            data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
        elif kind == "byte" and data:
            data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
        elif kind == "insert":
            data = data[:at] + rng.randbytes(rng.choice((1, 2, 4, 8, 64))) + data[at:]
        elif kind == "delete":
            data = data[:at] + data[at + rng.choice((1, 2, 4, 8, 64)):]
        elif kind == "duplicate":
            data = data[:at] + data[at:at + 32] + data[at:]
        elif kind == "lie" and sample.fields:
            f = rng.choice(sample.fields)
            if f.end <= len(data):
                own = struct.unpack_from(f.fmt, data, f.offset)[0]
                value = rng.choice((*LIES, len(data), own + 1, own - 1, own * 2, rng.randrange(1 << 32)))
                data, at = lie(data, f, value), f"{f.name}@{f.offset}={value}"
        elif kind == "truncate":
            data = data[:at]
        steps.append(f"{kind} {at}")
    return "; ".join(steps), data


def mutants(sample: Sample, count: int, seed: int, most_lies: int | None = None) -> Iterator[tuple[str, bytes]]:
    """Every truncation of the sample, every lie (or a sample of `most_lies` of them, for a format with hundreds
    of fields), then `count` random mutants, all from a fixed seed."""
    rng = random.Random(seed)
    yield from truncations(sample)
    every_lie = list(lies(sample))
    yield from every_lie if most_lies is None or most_lies >= len(every_lie) else rng.sample(every_lie, most_lies)
    for _ in range(count):
        yield random_mutant(sample, rng)


def _alarm(signum: int, frame: object) -> None:
    raise Hang(f"still running after {HANG_SECONDS} s")


def fuzz(read: Callable[[bytes], object], cases: Iterator[tuple[str, bytes]], refused: type[BaseException]
         | tuple[type[BaseException], ...], max_bytes: int = 256 << 20) -> Tally:
    """Run `read` on every case, sorting each outcome into read / refused / escape (see the module docstring)."""
    tally = Tally()
    previous = signal.signal(signal.SIGALRM, _alarm)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        for what, data in cases:
            tracemalloc.reset_peak()
            signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
            try:
                read(data)
                tally.read += 1
            except refused:
                tally.refused += 1
            except Exception as e:  # an escape: recorded with the mutant that caused it
                tally.escapes.append(f"{what}: {type(e).__name__}: {str(e)[:160]}")
                continue
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            peak = tracemalloc.get_traced_memory()[1]
            if peak > max_bytes:
                tally.escapes.append(f"{what}: allocated {peak} bytes (cap {max_bytes})")
    finally:
        signal.signal(signal.SIGALRM, previous)
        if not tracing:
            tracemalloc.stop()
    return tally


def assert_no_escapes(tally: Tally, at_least: int) -> None:
    print(tally)  # (pytest -s shows the counts)
    assert not tally.escapes, f"{tally}; the first ones:\n" + "\n".join(tally.escapes[:20])
    assert tally.total >= at_least and tally.refused > 0


# ---------------------------------------------------------------------------------------------------------------
# WAV
# ---------------------------------------------------------------------------------------------------------------


def wav_sample(tag: int = 1, bits: int = 16, channels: int = 2, rate: int = 22050, frames: int = 64,
               extensible: bool = False) -> Sample:
    """A WAV with a LIST chunk before fmt, the samples, and a chunk after them; its size fields recorded."""
    rng = np.random.default_rng(0)
    values = np.clip(rng.standard_normal(frames * channels) * 0.3, -1, 0.99)
    if tag == 3:
        samples = values.astype(f"<f{bits // 8}").tobytes()
    else:
        ints = np.round(values * 2.0 ** (bits - 1)).astype(np.int64) + (128 if bits == 8 else 0)
        samples = b"".join(int(v & ((1 << bits) - 1)).to_bytes(bits // 8, "little") for v in ints)
    align = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * align, align, bits)
    if extensible:
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + bytes(14)
    chunks = [(b"LIST", b"INFOabc"), (b"fmt ", fmt), (b"data", samples), (b"cue ", b"1234")]
    data, fields = bytearray(b"RIFF\0\0\0\0WAVE"), [Field(4, "<I", "riff size")]
    for cid, body in chunks:
        at = len(data)
        fields.append(Field(at + 4, "<I", f"{cid.decode()} size"))
        if cid == b"fmt ":
            fields += [Field(at + 8, "<H", "format tag"), Field(at + 10, "<H", "channels"),
                       Field(at + 12, "<I", "rate"), Field(at + 16, "<I", "byte rate"),
                       Field(at + 20, "<H", "block align"), Field(at + 22, "<H", "bits")]
            if extensible:
                fields += [Field(at + 24, "<H", "cb size"), Field(at + 32, "<H", "subformat")]
        data += cid + struct.pack("<I", len(body)) + body + b"\0" * (len(body) & 1)
    struct.pack_into("<I", data, 4, len(data) - 8)
    return Sample(bytes(data), fields, f"wav tag {tag} {bits}-bit x{channels}")


def read_and_resample(data: bytes) -> None:
    """What `kiln transcribe` does with a WAV: read it, then resample it to 16 kHz."""
    audio = read_wav(data)
    assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1 and np.isfinite(audio.samples).all()
    load_audio(data, 16000)


WAV_SAMPLES = [dict(), dict(tag=3, bits=32, extensible=True), dict(bits=24, channels=1, rate=44100),
               dict(bits=8, channels=3, rate=8000), dict(tag=3, bits=64, channels=1, rate=48000)]


@pytest.mark.parametrize("settings", WAV_SAMPLES, ids=["pcm16", "float32-ext", "pcm24", "pcm8", "float64"])
def test_wav_reader_has_no_escapes(settings):
    sample = wav_sample(**settings)
    read_and_resample(sample.data)  # the unmutated file reads
    tally = fuzz(read_and_resample, mutants(sample, 150, seed=7), AudioFormatError, max_bytes=128 << 20)
    assert_no_escapes(tally, 300)


@pytest.mark.parametrize("rate,message", [(0, "0 channels|at 0 Hz"), (1, "1 Hz"), (999, "999 Hz"),
                                          (1_000_001, "1000001 Hz"), ((1 << 32) - 1, "4294967295 Hz")])
def test_sample_rates_that_would_explode_resampling_are_refused(rate, message):
    """A rate of 1 Hz would grow the audio 16000-fold at 16 kHz; 4 GHz would need filters of millions of taps."""
    sample = wav_sample(rate=22050)
    rate_field = next(f for f in sample.fields if f.name == "rate")
    with pytest.raises(AudioFormatError, match=message):
        read_wav(lie(sample.data, rate_field, rate))


@pytest.mark.parametrize("rate", [1000, 1009, 44101, 999_983, 1_000_000])
def test_awkward_rates_resample_in_bounded_memory(rate):
    """A rate whose ratio to 16 kHz does not reduce (44101/16000) once built a 16000 x 44135 filter bank (5.6 GB);
    it now takes the direct path, whose memory stays bounded, and keeps a tone."""
    seconds = 0.25
    t = np.arange(int(rate * seconds)) / rate
    tracemalloc.start()
    try:
        out = resample(np.sin(2 * np.pi * 100 * t), rate, 16000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (int(np.ceil(16000 * len(t) / rate)),) and peak < 128 << 20
    want = np.sin(2 * np.pi * 100 * np.arange(len(out)) / 16000)
    assert np.abs(out - want)[200:-200].max() < 2e-3


def test_the_direct_path_equals_the_polyphase_one(monkeypatch):
    """The two resampling paths evaluate the same filter: forcing the direct one changes nothing but rounding."""
    resample_module = importlib.import_module("kiln.runtime.audio.resample")  # (the package exports the function)
    x = np.random.default_rng(1).standard_normal((2, 3001))
    for rate_in, rate_out in ((44100, 16000), (8000, 16000), (48000, 16000), (22050, 16000)):
        polyphase = resample(x, rate_in, rate_out)
        monkeypatch.setattr(resample_module, "MAX_FILTER_TAPS", 0)
        monkeypatch.setattr(resample_module, "BLOCK_VALUES", 5000)  # several blocks
        direct = resample(x, rate_in, rate_out)
        monkeypatch.undo()
        np.testing.assert_allclose(direct, polyphase, rtol=0, atol=1e-12)


def test_huge_declared_lengths_read_what_is_there():
    """A data size of 4 GiB in a file of a few hundred bytes: the frames present are read, nothing more is
    allocated."""
    sample = wav_sample(channels=1)
    data_size = next(f for f in sample.fields if f.name == "data size")
    tally = fuzz(read_wav, iter([("data size 4 GiB", lie(sample.data, data_size, (1 << 32) - 1))]), AudioFormatError,
                 max_bytes=1 << 20)
    assert tally.read == 1 and not tally.escapes
    rest = len(sample.data) - (data_size.offset + 4)  # the samples and the cue chunk after them, as 16-bit frames
    assert read_wav(lie(sample.data, data_size, (1 << 32) - 1)).samples.shape == (rest // 2,)


def test_devices_are_not_read_forever():
    """/dev/zero would be read until memory runs out: only regular files are read."""
    with pytest.raises(AudioFormatError, match="not a regular file"):
        read_wav("/dev/zero")
    with pytest.raises(ImageFormatError, match="not a regular file"):
        load_image("/dev/zero")


def test_non_finite_float_samples_are_refused():
    sample = wav_sample(tag=3, bits=32, channels=1)
    data_at = sample.data.index(b"data") + 8
    nan = sample.data[:data_at] + struct.pack("<f", float("nan")) + sample.data[data_at + 4:]
    with pytest.raises(AudioFormatError, match="NaN or infinite"):
        read_wav(nan)


# ---------------------------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------------------------


def grace_hopper() -> Path:
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("matplotlib (its sample_data/grace_hopper.jpg) is not installed")
    return Path(spec.submodule_search_locations[0]) / "mpl-data" / "sample_data" / "grace_hopper.jpg"


def png_sample() -> Sample:
    """A small RGBA PNG with its chunk lengths, IHDR width and height as fields (the CRCs are not recomputed: a
    lie in a chunk must be caught either way)."""
    from PIL import Image

    buffer = io.BytesIO()
    pixels = np.random.default_rng(2).integers(0, 256, (12, 10, 4), dtype=np.uint8)
    Image.fromarray(pixels, "RGBA").save(buffer, "PNG")
    data = buffer.getvalue()
    fields, at = [], 8
    while at + 8 <= len(data):
        (length,) = struct.unpack_from(">I", data, at)
        fields.append(Field(at, ">I", f"{data[at + 4:at + 8].decode()} length"))
        if data[at + 4:at + 8] == b"IHDR":
            fields += [Field(at + 8, ">I", "width"), Field(at + 12, ">I", "height")]
        at += 12 + length
    return Sample(data, fields, "png")


def bmp_sample() -> Sample:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (7, 9, 3), dtype=np.uint8), "RGB").save(buffer, "BMP")
    fields = [Field(2, "<I", "file size"), Field(10, "<I", "pixel offset"), Field(14, "<I", "header size"),
              Field(18, "<i", "width"), Field(22, "<i", "height"), Field(28, "<H", "bits"),
              Field(30, "<I", "compression"), Field(34, "<I", "image size")]
    return Sample(buffer.getvalue(), fields, "bmp")


def jpeg_sample() -> Sample:
    """grace_hopper.jpg cut down to its first 4 KB plus the end marker would not decode; the whole file is used,
    with the length field of each marker segment before the scan as a field."""
    data = grace_hopper().read_bytes()
    fields, at = [], 2
    while at + 4 <= len(data) and data[at] == 0xFF and data[at + 1] not in (0xD9, 0xDA):
        fields.append(Field(at + 2, ">H", f"marker {data[at + 1]:02x} length"))
        if data[at + 1] in (0xC0, 0xC2):
            fields += [Field(at + 5, ">H", "height"), Field(at + 7, ">H", "width")]
        at += 2 + struct.unpack_from(">H", data, at + 2)[0]
    return Sample(data, fields, "jpeg")


def image_reader(folder: Path) -> Callable[[bytes], object]:
    path = folder / "mutant.img"

    def read(data: bytes) -> object:
        path.write_bytes(data)
        image = load_image(path)
        assert image.mode == "RGB" and image.size[0] * image.size[1] <= MAX_PIXELS
        return image

    return read


@pytest.mark.parametrize("make,count", [(png_sample, 250), (bmp_sample, 200), (jpeg_sample, 60)],
                         ids=["png", "bmp", "jpeg"])
def test_image_reader_has_no_escapes(tmp_path, make, count):
    sample = make()
    image_reader(tmp_path)(sample.data)
    tally = fuzz(image_reader(tmp_path), mutants(sample, count, seed=count), ImageFormatError)
    assert_no_escapes(tally, count)


def png_bomb(side: int) -> bytes:
    """png_sample declaring side x side pixels, its IHDR checksum recomputed so that Pillow believes it."""
    sample = png_sample()
    width, height = (next(f for f in sample.fields if f.name == name) for name in ("width", "height"))
    data = bytearray(lie(lie(sample.data, width, side), height, side))
    ihdr = width.offset - 4  # the chunk type, then its 13 bytes of data, then the CRC of both
    struct.pack_into(">I", data, ihdr + 4 + 13, zlib.crc32(data[ihdr:ihdr + 4 + 13]))
    return bytes(data)


@pytest.mark.parametrize("side", [10_000, 100_000], ids=["past-kiln-limit", "past-pillow-error"])
def test_a_decompression_bomb_is_refused_before_decoding(tmp_path, side):
    """A PNG of a few hundred bytes that declares 10000 x 10000 pixels (over the limit, where Pillow only warns)
    or 100000 x 100000 (where Pillow raises its own error): refused from the header, without allocating the 300 MB
    or 30 GB of pixels."""
    bomb = png_bomb(side)
    tally = fuzz(image_reader(tmp_path), iter([("bomb", bomb)]), ImageFormatError, max_bytes=16 << 20)
    assert tally.refused == 1 and not tally.escapes
    with pytest.raises(ImageFormatError, match="over kiln's limit"):
        image_reader(tmp_path)(bomb)


def test_images_kiln_does_not_open(tmp_path):
    """Not an image, a folder, and an EPS file (which Pillow renders by running Ghostscript): each a clear
    ImageFormatError; a missing file stays FileNotFoundError."""
    (tmp_path / "text.jpg").write_text("not an image")
    (tmp_path / "a.eps").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    for name, message in (("text.jpg", "not an image Pillow can read"), ("a.eps", "not an image Pillow can read"),
                          (".", "a folder")):
        with pytest.raises(ImageFormatError, match=message):
            load_image(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        load_image(tmp_path / "missing.png")


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------


def one_line_error(code: int, out: str, err: str, command: str) -> str:
    """The error of a command that must fail cleanly: exit status 2, no traceback, and the error one line, the
    last on stderr (progress lines the command logged may come before it)."""
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and lines, (code, out, err)
    assert lines[-1].startswith(f"kiln {command}: error: ") and sum("error:" in line for line in lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize("what", ["truncated", "zero channels", "unknown format", "rate 1 Hz", "not a WAV",
                                  "missing", "folder"])
def test_transcribe_refuses_a_bad_wav_in_one_line(tmp_path, what):
    from tests.test_cli import cli

    sample = wav_sample()
    by_name = {f.name: f for f in sample.fields}
    data = {"truncated": sample.data[:40], "zero channels": lie(sample.data, by_name["channels"], 0),
            "unknown format": lie(sample.data, by_name["format tag"], 0x55),
            "rate 1 Hz": lie(sample.data, by_name["rate"], 1), "not a WAV": b"OggS" + bytes(60)}.get(what)
    audio = tmp_path / ("folder" if what == "folder" else "bad.wav")
    if data is not None:
        audio.write_bytes(data)
    elif what == "folder":
        audio.mkdir()
    before = sorted(tmp_path.iterdir())
    err = one_line_error(*cli("transcribe", tmp_path / "model.kiln", audio), "transcribe")
    assert str(audio) in err or "WAV" in err
    assert sorted(tmp_path.iterdir()) == before  # nothing written


def npy_file(shape: tuple[int, ...], data: bytes) -> bytes:
    """A .npy file whose header declares float32 `shape`, followed by `data` (however many bytes that is)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue() + data


@pytest.mark.filterwarnings("ignore:Reading `.npy` or `.npz` file required additional header parsing")
def test_run_inputs_reader_has_no_escapes(tmp_path):
    """`kiln run -i x.npy`: np.load trusts the header's shape and allocates it whole before reading (a 100-byte
    file declaring 2**40 float32 once raised MemoryError past the command's error handling)."""
    from kiln.cli.common import CliError
    from kiln.cli.run_cmd import load_inputs

    path = tmp_path / "x.npy"

    def read(data: bytes) -> None:
        path.write_bytes(data)
        load_inputs([str(path)])

    values = np.arange(24, dtype=np.float32).tobytes()
    sample = Sample(npy_file((2, 3, 4), values), [Field(8, "<H", "header length")], "npy")
    lying = [(f"shape {shape}", npy_file(shape, values)) for shape in
             ((1 << 40,), (1 << 32, 1 << 32), (2, 3, 5), (), (0,), (1 << 62, 0), (7, 1 << 61))]
    tally = fuzz(read, iter([*lying, *mutants(sample, 200, seed=4)]), CliError, max_bytes=64 << 20)
    assert_no_escapes(tally, 200)
    (tmp_path / "huge.npy").write_bytes(npy_file((1 << 40,), values))
    with pytest.raises(CliError, match="declares"):
        load_inputs([str(tmp_path / "huge.npy")])
