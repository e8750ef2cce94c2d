"""The loader trusts nothing: every truncation, flipped byte, lying header and inconsistent table raises
ProgramFormatError (never another exception, never a hang) with a message that says what is wrong."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.errors import ProgramFormatError
from kiln.format import ALIGNMENT, writer
from kiln.format.header import HEADER_SIZE, MAGIC, Header
from kiln.ir import ops
from kiln.ir.graph import Blob, Program, StateUpdate, ValueKind
from kiln.ir.ops import AttrDef, AttrType, OpDef
from kiln.ir.symbolic import Symbol

TIME_BOUND_S = 10.0
"""A hang detector, not a speed test: each case takes milliseconds on files of a few kB (the decoding blow-ups
below took over a minute and a gigabyte before the decoder bounded them)."""

REPO = Path(__file__).resolve().parents[2]


class Stateful(nn.Module):
    """State buffer with an initial value, a dynamic batch, ops with required and symbolic attributes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj = nn.Linear(8, 8)
        self.register_buffer("total", torch.arange(8, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        return torch.softmax(self.proj(x) * self.total, dim=-1)[1:, :4]


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> dict:
    batch = torch.export.Dim("batch", min=3, max=64)
    builder = kiln.export(Stateful(), (torch.randn(3, 8),), dynamic_shapes=({0: batch},))
    path = builder.save(tmp_path_factory.mktemp("valid") / "valid.kiln")
    program, data = builder.build()
    raw = path.read_bytes()
    kiln.load(raw).session().run("forward", np.ones((4, 8), np.float32))  # the starting point is valid
    return {"program": program, "data": data, "raw": raw, "path": path, "header": Header.unpack(raw)[1],
            "builder": builder}


def assert_rejected(source, phrase: str | None = None, **load_options) -> ProgramFormatError:
    """Loading `source` raises ProgramFormatError (mentioning `phrase`) quickly; any other exception fails."""
    start = time.perf_counter()
    with pytest.raises(ProgramFormatError) as info:
        kiln.load(source, **load_options)
    elapsed = time.perf_counter() - start
    assert elapsed < TIME_BOUND_S, f"took {elapsed:.1f}s to reject"
    if phrase is not None:
        assert phrase.lower() in str(info.value).lower(), f"{phrase!r} not in: {info.value}"
    return info.value


def with_header(raw: bytes, recompute_crc: bool = True, **fields) -> bytes:
    """`raw` with header fields replaced; by default the checksums are recomputed over the sections the new
    header names, so the only defect left is the one under test."""
    h = replace(Header.unpack(raw)[1], **fields)
    if recompute_crc:
        h = replace(h, meta_crc32=zlib.crc32(raw[h.meta_offset:h.meta_offset + h.meta_size]),
                    const_crc32=zlib.crc32(raw[h.const_offset:h.const_offset + h.const_size]))
    return h.pack() + raw[HEADER_SIZE:]


def assemble(meta: bytes, const: bytes) -> bytes:
    """A file with a consistent header around the given metadata table and constant segment."""
    const_offset = -(-(HEADER_SIZE + len(meta)) // ALIGNMENT) * ALIGNMENT
    h = Header(1, ops.OPSET_VERSION, HEADER_SIZE, len(meta), const_offset, len(const), const_offset + len(const),
               zlib.crc32(meta), zlib.crc32(const))
    return h.pack() + meta + b"\0" * (const_offset - HEADER_SIZE - len(meta)) + const


# ---- truncation ----

def section_boundaries(valid) -> list[int]:
    h, program = valid["header"], valid["program"]
    cuts = {0, 1, 7, 8, 12, 16, HEADER_SIZE // 2, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1,
            h.meta_offset + h.meta_size // 2, h.meta_offset + h.meta_size - 1, h.meta_offset + h.meta_size,
            h.const_offset - 1, h.const_offset, h.const_offset + 1, h.file_size - 1}
    for b in program.blobs:
        start = h.const_offset + b.offset
        cuts |= {start, start + 1, start + b.nbytes // 2, start + b.nbytes - 1, start + b.nbytes}
    return sorted(c for c in cuts if 0 <= c < h.file_size)


def test_truncation_at_every_section_boundary(valid, tmp_path):
    raw = valid["raw"]
    for cut in section_boundaries(valid):
        phrase = "truncated" if cut >= HEADER_SIZE else "shorter than the 64-byte kiln header"
        assert_rejected(raw[:cut], phrase)
        path = tmp_path / f"cut{cut}.kiln"
        path.write_bytes(raw[:cut])
        assert_rejected(path, "empty file" if cut == 0 else phrase)


def test_truncation_at_sampled_offsets(valid):
    raw = valid["raw"]
    for cut in np.random.default_rng(0).choice(len(raw), size=60, replace=False):
        assert_rejected(raw[:int(cut)])


def test_trailing_data(valid):
    assert_rejected(valid["raw"] + b"\0", "trailing data")


def test_truncated_constants_with_a_header_rewritten_to_match(valid):
    """Cut the last blob off and make the header agree: the blob table now points outside the segment."""
    raw, h, last = valid["raw"], valid["header"], valid["program"].blobs[-1]
    for keep in (last.offset, 0):
        cut = raw[:h.const_offset + keep]
        assert_rejected(with_header(cut, const_size=keep, file_size=len(cut)), "outside the")


# ---- flipped bytes ----

def flipped(raw: bytes, offset: int, mask: int = 0xFF) -> bytes:
    buf = bytearray(raw)
    buf[offset] ^= mask
    return bytes(buf)


def test_every_header_bit_flip_is_caught(valid):
    raw = valid["raw"]
    for offset in range(HEADER_SIZE):
        for bit in range(8):
            assert_rejected(flipped(raw, offset, 1 << bit))


def test_metadata_flips_fail_the_metadata_checksum(valid):
    raw, h = valid["raw"], valid["header"]
    for offset in np.linspace(h.meta_offset, h.meta_offset + h.meta_size - 1, 60).astype(int):
        assert_rejected(flipped(raw, int(offset)), "metadata checksum mismatch")


def test_constant_flips_fail_the_constant_checksum(valid):
    raw, h = valid["raw"], valid["header"]
    for offset in np.linspace(h.const_offset, h.file_size - 1, 40).astype(int):
        bad = flipped(raw, int(offset))
        assert_rejected(bad, "constant segment checksum mismatch")
    # Only the checksum catches a flipped weight: with verification off the file loads (a documented trade-off).
    blob = valid["program"].blobs[0]
    kiln.load(flipped(raw, h.const_offset + blob.offset), verify_checksums=False)


def test_padding_after_the_metadata_must_be_zero(valid):
    builder = valid["builder"]
    for length in range(64):  # a metadata entry of the right length leaves padding before the constants
        builder.metadata["padding_probe"] = "x" * length
        raw = builder.to_bytes()
        h = Header.unpack(raw)[1]
        gap = range(h.meta_offset + h.meta_size, h.const_offset)
        if gap:
            break
    for offset in (gap[0], gap[-1]):
        assert_rejected(flipped(raw, offset), "padding")


def test_metadata_flips_behind_a_valid_checksum_never_crash(valid):
    """A flip with the checksum recomputed reaches the decoder and the validator: the file must either load as a
    consistent program or raise ProgramFormatError; running whatever loads raises nothing but kiln errors."""
    raw, h = valid["raw"], valid["header"]
    x = np.ones((4, 8), np.float32)
    rejected = 0
    for offset in range(h.meta_offset, h.meta_offset + h.meta_size, 3):
        bad = with_header(flipped(raw, offset))
        start = time.perf_counter()
        try:
            program = kiln.load(bad)
        except ProgramFormatError:
            rejected += 1
            continue
        finally:
            assert time.perf_counter() - start < TIME_BOUND_S
        try:
            program.session(validate=True).run("forward", x)
        except kiln.KilnError:
            pass
    assert rejected > h.meta_size // 6  # most flips break something the validator checks


# ---- the header lies ----

def test_wrong_magic(valid):
    raw = valid["raw"]
    assert_rejected(b"PK\x03\x04" + raw[4:], "not a .kiln file")
    assert_rejected(raw.replace(b"\r\n", b"\n", 1), "not a .kiln file")  # a text-mode transfer


@pytest.mark.parametrize("version", [2, 1000, 0])
def test_unsupported_format_version(valid, version):
    assert_rejected(with_header(valid["raw"], format_version=version), f"format version {version} is not supported")


def test_newer_op_set_version(valid, tmp_path):
    newer = ops.OPSET_VERSION + 1
    error = assert_rejected(with_header(valid["raw"], opset_version=newer), f"op set version {newer}")
    assert "upgrade kiln" in str(error).lower()
    program = copy.deepcopy(valid["program"])
    program.opset_version = newer
    writer.write_program(program, valid["data"], tmp_path / "newer.kiln")
    assert_rejected(tmp_path / "newer.kiln", f"op set version {newer}")
    # header and metadata disagree
    raw = (tmp_path / "newer.kiln").read_bytes()
    assert_rejected(with_header(raw, opset_version=ops.OPSET_VERSION), "disagree")


def header_lies(h: Header) -> list[tuple[dict, str]]:
    return [
        ({"meta_offset": 0}, "metadata section"),
        ({"meta_offset": HEADER_SIZE + ALIGNMENT}, "metadata section"),
        ({"meta_size": 0}, "metadata section"),
        ({"meta_size": 4}, "metadata section"),
        ({"meta_size": h.file_size}, "metadata section"),
        ({"meta_size": 2**63}, "metadata section"),
        ({"meta_size": h.meta_size // 2}, "constant segment"),
        ({"meta_size": h.meta_size + ALIGNMENT}, "constant segment"),
        ({"const_offset": h.const_offset + ALIGNMENT}, "constant segment"),
        ({"const_offset": h.const_offset - ALIGNMENT}, "constant segment"),
        ({"const_offset": h.const_offset + 1}, "constant segment"),
        ({"const_offset": 2**64 - ALIGNMENT}, "constant segment"),
        ({"const_size": h.const_size - ALIGNMENT}, "constant segment"),
        ({"const_size": h.const_size + ALIGNMENT}, "constant segment"),
        ({"const_size": 0}, "constant segment"),
        ({"file_size": h.file_size - 1}, "header says the file is"),
        ({"file_size": h.file_size + 1}, "header says the file is"),
        ({"file_size": 2**64 - 1}, "header says the file is"),
        ({"meta_crc32": h.meta_crc32 ^ 1}, "metadata checksum"),
        ({"const_crc32": h.const_crc32 ^ 1}, "constant segment checksum"),
    ]


def test_header_lies_about_sizes_and_offsets(valid):
    raw, h = valid["raw"], valid["header"]
    for fields, phrase in header_lies(h):
        recompute = not any(k.endswith("crc32") for k in fields)
        assert_rejected(with_header(raw, recompute_crc=recompute, **fields), phrase)


def test_metadata_size_a_few_bytes_short(valid):
    """The cut-off tail of the table becomes 'padding', which must be zeros; the checksum is recomputed.

    (Cutting only the table's own trailing zero padding changes nothing the decoder reads, so it is not a defect.)
    """
    raw, h = valid["raw"], valid["header"]
    meta = raw[h.meta_offset:h.meta_offset + h.meta_size]
    last_nonzero = max(i for i, b in enumerate(meta) if b)
    for size in (last_nonzero, last_nonzero - 3, last_nonzero - 9):
        assert_rejected(with_header(raw, meta_size=size))


# ---- garbage files ----

def test_empty_file(tmp_path):
    (tmp_path / "empty.kiln").write_bytes(b"")
    assert_rejected(tmp_path / "empty.kiln", "empty file")
    assert_rejected(b"", "shorter than")


def test_random_bytes(tmp_path):
    rng = np.random.default_rng(1)
    for size in (1, 63, 64, 65, 4096, 100_000):
        junk = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert_rejected(junk)
        (tmp_path / "junk.kiln").write_bytes(junk)
        assert_rejected(tmp_path / "junk.kiln")
        # the same junk behind a valid magic, and as a metadata table behind a consistent header
        assert_rejected(MAGIC + junk)
        assert_rejected(assemble(junk.ljust(8, b"\0")[:4] + b"KILN" + junk[8:], b""))


def test_a_directory_is_not_a_program(tmp_path):
    assert_rejected(tmp_path, "directory")


# ---- inconsistent metadata written by the real writer ----

def _node(p: Program, op: str):
    return next(n for n in p.methods["forward"].nodes if n.op == op)


def _value(p: Program, **match):
    m = p.methods["forward"]
    return next(i for i, v in enumerate(m.values) if all(getattr(v, k) == w for k, w in match.items()))


def _retyped(op: str, attr: str, kind: AttrType) -> dict:
    d = ops.OPS[op]
    return {op: OpDef(op, d.inputs, tuple(AttrDef(a.name, kind if a.name == attr else a.type, a.default)
                                          for a in d.attrs), d.num_outputs, d.doc)}


def case_bad_value_index(p):
    p.methods["forward"].nodes[0].inputs[0] = 999


def case_read_before_produced(p):
    m = p.methods["forward"]
    m.nodes[0].inputs[0] = m.nodes[-1].outputs[0]


def case_unknown_op(p):
    node = p.methods["forward"].nodes[0]
    d = ops.OPS[node.op]
    node.op = "frobnicate"
    return {"frobnicate": replace(d, name="frobnicate")}


def case_wrong_attr_type(p):
    return _retyped("softmax", "dim", AttrType.FLOAT)


def case_unknown_attr(p):
    d = ops.OPS["softmax"]
    _node(p, "softmax").attrs["temperature"] = 2
    return {"softmax": OpDef("softmax", d.inputs, d.attrs + (AttrDef("temperature", AttrType.INT, 1),),
                             d.num_outputs, d.doc)}


def case_missing_required_attr(p):
    del _node(p, "softmax").attrs["dim"]


def case_bad_value_dtype(p):
    p.methods["forward"].values[0].dtype = 99


def case_bad_state_dtype(p):
    p.states[0].dtype = 77


def case_bad_attr_dtype(p):
    _node(p, "softmax").attrs["dim"] = 99  # written as a dtype attribute with code 99
    return _retyped("softmax", "dim", AttrType.DTYPE)


def case_constant_shape_vs_blob(p):
    p.constants[0].shape = (8, 9)


def case_value_vs_constant(p):
    m = p.methods["forward"]
    m.values[_value(p, kind=ValueKind.CONSTANT)].shape = (3, 3)


def case_state_update_shape(p):
    m = p.methods["forward"]
    for node in m.nodes:  # so that the value it now keeps is not also freed early
        node.free_after = []
    m.state_updates[0] = StateUpdate(_node(p, "softmax").outputs[0], 0)


def case_state_update_target(p):
    p.methods["forward"].state_updates[0].state = 5


def case_state_init_index(p):
    p.states[0].init = 42


def case_undeclared_symbol(p):
    m = p.methods["forward"]
    m.values[_node(p, "softmax").outputs[0]].shape = ("nope", 8)


def case_malformed_expression(p):
    m = p.methods["forward"]
    m.values[_node(p, "softmax").outputs[0]].shape = ("batch +* 2", 8)


def case_malformed_attr_expression(p):
    _node(p, "slice").attrs["end"] = "max(batch"


def case_unbindable_symbol(p):
    m = p.methods["forward"]
    m.symbols.append(Symbol("hidden", 1, 8))
    m.values[_node(p, "softmax").outputs[0]].shape = ("hidden", 8)


def case_symbol_bounds(p):
    s = p.methods["forward"].symbols[0]
    p.methods["forward"].symbols[0] = Symbol(s.name, 10, 2)


def case_output_never_produced(p):
    m = p.methods["forward"]
    m.outputs[0] = len(m.values) + 3


def case_produced_twice(p):
    m = p.methods["forward"]
    m.nodes[1].outputs = list(m.nodes[0].outputs)


def case_not_an_input(p):
    m = p.methods["forward"]
    m.inputs[0] = _value(p, kind=ValueKind.CONSTANT)


def case_wrong_input_count(p):
    _node(p, "softmax").inputs.append(_node(p, "softmax").inputs[0])


def case_free_read_later(p):
    m = p.methods["forward"]
    x = m.inputs[0]
    m.nodes[0].free_after.append(x)  # x is read again by the linear node after it


def case_free_an_output(p):
    m = p.methods["forward"]
    producer = next(n for n in m.nodes if m.outputs[0] in n.outputs)
    producer.free_after.append(m.outputs[0])


def case_free_a_constant(p):
    m = p.methods["forward"]
    m.nodes[-1].free_after.append(_value(p, kind=ValueKind.CONSTANT))


SEMANTIC_CASES = {
    "bad_value_index": (case_bad_value_index, "out of range"),
    "read_before_produced": (case_read_before_produced, "before it is produced"),
    "unknown_op": (case_unknown_op, "unknown op 'frobnicate'"),
    "wrong_attr_type": (case_wrong_attr_type, "attribute 'dim' is float, expected int"),
    "unknown_attr": (case_unknown_attr, "unknown attribute 'temperature'"),
    "missing_required_attr": (case_missing_required_attr, "required attribute 'dim' is missing"),
    "bad_value_dtype": (case_bad_value_dtype, "unknown dtype code 99"),
    "bad_state_dtype": (case_bad_state_dtype, "unknown dtype code 77"),
    "bad_attr_dtype": (case_bad_attr_dtype, "attribute 'dim': unknown dtype code 99"),
    "constant_shape_vs_blob": (case_constant_shape_vs_blob, "needs 288 bytes but its blob holds 256"),
    "value_vs_constant": (case_value_vs_constant, "but constant"),
    "state_update_shape": (case_state_update_shape, "state update writes"),
    "state_update_target": (case_state_update_target, "missing value or state buffer"),
    "state_init_index": (case_state_init_index, "initial value index 42 out of range"),
    "undeclared_symbol": (case_undeclared_symbol, "undeclared symbol(s) ['nope']"),
    "malformed_expression": (case_malformed_expression, "dimension expression"),
    "malformed_attr_expression": (case_malformed_attr_expression, "dimension expression"),
    "unbindable_symbol": (case_unbindable_symbol, "not the size of any input dimension"),
    "symbol_bounds": (case_symbol_bounds, "has bounds [10, 2]"),
    "output_never_produced": (case_output_never_produced, "never produced"),
    "produced_twice": (case_produced_twice, "produced twice"),
    "not_an_input": (case_not_an_input, "not an input value"),
    "wrong_input_count": (case_wrong_input_count, "has 2 inputs"),
    "free_read_later": (case_free_read_later, "free_after drops"),
    "free_an_output": (case_free_an_output, "free_after drops"),
    "free_a_constant": (case_free_a_constant, "free_after drops"),
}


@pytest.mark.parametrize("name", list(SEMANTIC_CASES))
def test_inconsistent_metadata(valid, tmp_path, monkeypatch, name):
    edit, phrase = SEMANTIC_CASES[name]
    program = copy.deepcopy(valid["program"])
    overrides = edit(program) or {}
    with monkeypatch.context() as patched:  # ops the real table would refuse to write, undone before loading
        for op, opdef in overrides.items():
            patched.setitem(ops.OPS, op, opdef)
        writer.write_program(program, valid["data"], tmp_path / f"{name}.kiln", verify=False)
    assert_rejected(tmp_path / f"{name}.kiln", phrase)


@pytest.mark.parametrize(("offset", "phrase"), [(32, "unaligned"), (1 << 20, "outside the")])
def test_blob_table_lies(valid, offset, phrase):
    """A blob offset the writer refuses to produce: the metadata is encoded directly around a real segment."""
    raw, h = valid["raw"], valid["header"]
    program = copy.deepcopy(valid["program"])
    program.blobs[0] = Blob(offset, program.blobs[0].nbytes)
    assert_rejected(assemble(writer.encode_metadata(program), raw[h.const_offset:]), phrase)


def test_shared_strings_cannot_blow_up_decoding(valid):
    """FlatBuffers lets every value name point at one long string: a small file that would decode into
    gigabytes. The decoder bounds the total text it decodes by the table's size."""
    program = copy.deepcopy(valid["program"])
    m = program.methods["forward"]
    long_name = "v" * 200_000
    m.values.extend(replace(m.values[0], name=long_name) for _ in range(2000))
    meta = writer.encode_metadata(program)  # the encoder stores each distinct string once
    assert len(meta) < 400_000
    assert_rejected(assemble(meta, valid["raw"][valid["header"].const_offset:]), "strings decoded exceed")


def test_shared_vectors_cannot_blow_up_decoding(valid, monkeypatch):
    """The same with one long shape vector shared by many values (an encoder that shares vectors)."""
    program = copy.deepcopy(valid["program"])
    m = program.methods["forward"]
    m.values.extend(replace(m.values[0], shape=tuple(range(3000))) for _ in range(3000))
    cache: dict = {}
    original = writer._Encoder.dims

    def shared_dims(self, shape):
        key = (id(self), tuple(shape))
        if key not in cache:
            cache[key] = original(self, shape)
        return cache[key]

    monkeypatch.setattr(writer._Encoder, "dims", shared_dims)
    meta = writer.encode_metadata(program)
    monkeypatch.undo()
    assert len(meta) < 200_000
    assert_rejected(assemble(meta, valid["raw"][valid["header"].const_offset:]), "vectors shared or overlapping")


# ---- no pickle ----

def test_no_unpickling_code_in_the_runtime():
    runtime_sources = [*(REPO / "src/kiln/runtime").rglob("*.py"), *(REPO / "src/kiln/format").glob("*.py"),
                       *(REPO / "src/kiln/ir").glob("*.py"), REPO / "src/kiln/errors.py"]
    for path in runtime_sources:
        text = path.read_text()
        for banned in ("import pickle", "from pickle", "allow_pickle=True", "marshal", "np.load(", "numpy.load("):
            assert banned not in text, f"{path.relative_to(REPO)} contains {banned!r}"


NO_PICKLE_SCRIPT = """
import builtins, sys
import numpy  # numpy imports pickle itself; what matters is that no kiln module does, and nothing unpickles
real_import, importers = builtins.__import__, []
def spy(name, globals=None, locals=None, fromlist=(), level=0):
    if name.split(".")[0] in ("pickle", "_pickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"):
        importers.append((globals or {}).get("__name__"))
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = spy
import pickle
def refuse(*args, **kwargs):
    raise AssertionError("pickle used")
pickle.load = pickle.loads = pickle.Unpickler = refuse
import kiln, kiln.runtime
program = kiln.load(sys.argv[1])
session = program.session()
out = session.run("forward", numpy.ones((4, 8), numpy.float32))
assert out[0].shape == (3, 4), out[0].shape
offenders = sorted({m for m in importers if m and m.startswith("kiln")})
assert not offenders, f"kiln modules import pickle: {offenders}"
holders = [n for n, mod in list(sys.modules.items()) if n.startswith("kiln") and
           any(v is pickle for v in vars(mod).values())]
assert not holders, f"kiln modules hold the pickle module: {holders}"
assert "torch" not in sys.modules, "the runtime imported torch"
print("clean")
"""


def test_runtime_never_unpickles_nor_imports_torch(valid):
    result = subprocess.run([sys.executable, "-c", NO_PICKLE_SCRIPT, str(valid["path"])], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "clean"
