"""Export -> save -> load gives back exactly the program that was built, laid out as the format promises:
64-byte aligned constants, stored once per content, mapped from the file without copying."""

from __future__ import annotations

import mmap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln
from kiln.format import ALIGNMENT, FORMAT_VERSION, writer
from kiln.format.header import HEADER_SIZE, MAGIC, Header
from kiln.ir import ops
from kiln.ir.dtypes import DType
from kiln.ir.graph import Method, Node, Program, Value, ValueKind
from kiln.ir.ops import AttrDef, AttrType, InputDef, OpDef
from kiln.ir.rules import RULES, Spec
from kiln.ir.symbolic import Symbol
from tests.format import small_models

EXPORTS = {
    "duplicated": small_models.export_duplicated,
    "distinct": lambda: small_models.export_duplicated(distinct=True),
    "accumulator": small_models.export_accumulator,
    "dynamic": small_models.export_dynamic,
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """name -> (built ir Program, blob data, path of the saved file) for every small model, exported once."""
    out = {}
    for name, export in EXPORTS.items():
        builder = export()
        path = builder.save(tmp_path_factory.mktemp("roundtrip") / f"{name}.kiln")
        program, data = builder.build()
        out[name] = (program, data, path)
    return out


@pytest.mark.parametrize("name", list(EXPORTS))
def test_program_read_back_equals_built(exported, name):
    built, data, path = exported[name]
    loaded = kiln.load(path)
    got = loaded.ir
    assert got.opset_version == built.opset_version == ops.OPSET_VERSION
    assert list(got.methods) == list(built.methods)
    for mname, want in built.methods.items():
        m = got.methods[mname]
        assert m.values == want.values
        assert m.inputs == want.inputs and m.outputs == want.outputs
        assert len(m.nodes) == len(want.nodes)
        for a, b in zip(m.nodes, want.nodes, strict=True):
            assert (a.op, a.inputs, a.outputs, a.free_after, a.source) == (b.op, b.inputs, b.outputs, b.free_after,
                                                                           b.source)
            assert a.attrs == b.attrs
            assert [type(v) for v in a.attrs.values()] == [type(v) for v in b.attrs.values()]
        assert m.symbols == want.symbols
        assert m.state_updates == want.state_updates
    assert got.constants == built.constants
    assert got.blobs == built.blobs
    assert got.states == built.states
    assert got.metadata == built.metadata and got.metadata["producer"] == "kiln"
    assert got == built
    for i, c in enumerate(built.constants):
        assert loaded.constant(i).tobytes() == data[c.blob].tobytes(), c.name


def test_exported_features_are_in_the_file(exported):
    dynamic = exported["dynamic"][0].methods["forward"]
    assert {s.name: (s.min, s.max) for s in dynamic.symbols} == {"batch": (1, 16), "seq": (3, 32)}
    assert dynamic.values[dynamic.inputs[0]].shape == ("batch", "seq", 8)
    kinds = {(n.op, type(v).__name__) for n in dynamic.nodes for v in n.attrs.values()}
    assert {("layer_norm", "float"), ("gelu", "str"), ("sum", "bool"), ("sum", "tuple"), ("cast", "DType"),
            ("slice", "str")} <= kinds

    acc = exported["accumulator"][0]
    assert [s.name for s in acc.states] == ["total"]
    init = acc.constants[acc.states[0].init]
    assert init.shape == (8,) and init.dtype == DType.float32
    m = acc.methods["forward"]
    assert len(m.state_updates) == 1 and m.state_updates[0].state == 0
    assert [v.name for v in m.values if v.kind == ValueKind.STATE] == ["total"]


def test_every_attribute_kind_round_trips(tmp_path, monkeypatch):
    """A hand-built program whose one node carries every attribute kind, with awkward values."""
    probe = OpDef("probe", (InputDef("x"),), (
        AttrDef("i", AttrType.INT), AttrDef("f", AttrType.FLOAT), AttrDef("s", AttrType.STRING),
        AttrDef("b", AttrType.BOOL), AttrDef("d", AttrType.DTYPE), AttrDef("ii", AttrType.INTS),
        AttrDef("ff", AttrType.FLOATS), AttrDef("si", AttrType.SYMINT), AttrDef("sis", AttrType.SYMINTS),
        AttrDef("empty", AttrType.INTS, ())), 1, "test op")
    monkeypatch.setitem(ops.OPS, "probe", probe)
    monkeypatch.setitem(RULES, "probe", lambda ins, attrs: [Spec(DType.bfloat16, (attrs["si"], 4))])
    attrs = {"i": -(2**40), "f": -1.0e-300, "s": "h\u00e9llo \u2713", "b": True, "d": DType.bfloat16,
             "ii": (-3, 0, 2**62), "ff": (0.1, -2.5, 1e30), "si": "n*2", "sis": (4, "n", "max(n, 3) - 1"),
             "empty": ()}
    method = Method("forward", [Value("x", DType.float32, ("n", 4), ValueKind.INPUT),
                                Value("y", DType.bfloat16, ("n*2", 4))],
                    [0], [1], [Node("probe", [0], [1], dict(attrs), source="model.py:3 in forward: y = probe(x)")],
                    [Symbol("n", 1, 1024)])
    program = Program(ops.OPSET_VERSION, {"forward": method}, [], [], [], {"k": "v"})
    writer.write_program(program, [], tmp_path / "probe.kiln")
    got = kiln.load(tmp_path / "probe.kiln").ir
    assert got.methods["forward"].nodes[0].attrs == {k: v for k, v in attrs.items() if k != "empty"} | {"empty": ()}
    assert got == program


def test_constant_blobs_are_64_byte_aligned_in_the_file(exported):
    for built, data, path in exported.values():
        raw = Path(path).read_bytes()
        _, h = Header.unpack(raw[:HEADER_SIZE])
        assert h.const_offset % ALIGNMENT == 0
        assert built.blobs, "every test model has constants"
        for blob, blob_data in zip(built.blobs, data, strict=True):
            start = h.const_offset + blob.offset
            assert start % ALIGNMENT == 0
            assert raw[start:start + blob.nbytes] == blob_data.tobytes()


def test_equal_constants_are_stored_once(exported):
    dup, dup_data, dup_path = exported["duplicated"]
    distinct, _, distinct_path = exported["distinct"]
    by_name = {c.name: c for c in dup.constants}
    # b.weight has a.weight's bytes and shape: one constant; `flat` has them in another shape: its own constant,
    # the same blob.
    assert "b.weight" not in by_name
    assert by_name["flat"].blob == by_name["a.weight"].blob
    method = dup.methods["forward"]
    weights = {method.values[n.inputs[1]].ref for n in method.nodes if n.op == "linear"}
    assert [dup.constants[r].name for r in weights] == ["a.weight"]  # both layers read the one constant
    assert len(dup.blobs) == len(distinct.blobs) - 2
    weight_bytes = small_models.WIDTH * small_models.WIDTH * 4
    saved = Path(distinct_path).stat().st_size - Path(dup_path).stat().st_size
    assert saved >= 2 * weight_bytes
    assert sum(b.nbytes for b in dup.blobs) == sum(d.nbytes for d in dup_data) < 2 * weight_bytes


def test_a_tensor_is_hashed_once_until_it_is_written(monkeypatch):
    """Every method of an LLM reads the same weights: the builder hashes a tensor's memory once, yet sees an
    in-place write (the version counter) and tells equal bytes from other tensors as before."""
    from kiln.export import builder as builder_module

    hashed = []
    blake2b = builder_module.hashlib.blake2b
    monkeypatch.setattr(builder_module.hashlib, "blake2b", lambda data, **kw: hashed.append(1) or blake2b(data, **kw))
    b = builder_module.ProgramBuilder()
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = b.constant(w, "w")
    assert b.constant(w, "w again") == b.constant(w.detach(), "w detached") == first and len(hashed) == 1
    assert b.constant(w.clone(), "copy") == first and len(hashed) == 2  # other memory: hashed, the same constant
    assert b.constant(w.t(), "transposed") != first and len(hashed) == 3  # not contiguous: hashed every time
    with torch.no_grad():
        w.add_(1)
    written = b.constant(w, "written")
    assert written != first and len(hashed) == 4
    assert np.array_equal(b.constant_array(written), w.numpy())
    with torch.inference_mode():  # no version counter to trust: hashed each time, still one constant
        frozen = torch.arange(5.0)
    assert b.constant(frozen, "frozen") == b.constant(frozen, "frozen again") and len(hashed) == 6


def test_large_constants_hashed_in_chunks_are_told_apart_and_stored_once(monkeypatch):
    """A constant larger than two chunks is hashed chunk by chunk on threads: equal bytes still give one constant,
    and a difference in any chunk (the last byte, a chunk's first) or in the length gives another."""
    from kiln.export import builder as builder_module

    monkeypatch.setattr(builder_module, "HASH_CHUNK_BYTES", 64)
    b = builder_module.ProgramBuilder()
    w = torch.arange(300, dtype=torch.float32)  # 1200 bytes: 19 chunks of 64
    first = b.constant(w, "w")
    assert b.constant(w.clone(), "copy") == first
    for at in (0, 16, 299):  # the first chunk, the second one's first element, the last
        other = w.clone()
        other[at] += 1
        assert b.constant(other, f"changed at {at}") != first
    assert b.constant(w[:-1].clone(), "shorter") != first
    assert len({c.blob for c in b.constants}) == 5


def _base(arr: np.ndarray):
    """The object that owns an array's memory, following views and buffer wrappers."""
    while isinstance(arr, (np.ndarray, memoryview)):
        arr = arr.base if isinstance(arr, np.ndarray) else arr.obj
    return arr


def test_constants_are_zero_copy_views_of_the_mapped_file(exported):
    built, _, path = exported["duplicated"]
    program = kiln.load(path)
    file_start = np.frombuffer(program._buffer, dtype=np.uint8).ctypes.data
    for i, c in enumerate(built.constants):
        arr = program.constant(i)
        assert isinstance(_base(arr), mmap.mmap), c.name
        assert not arr.flags.writeable
        assert arr.ctypes.data - file_start == program.header.const_offset + built.blobs[c.blob].offset
        assert arr.ctypes.data % ALIGNMENT == 0
        with pytest.raises(ValueError):
            arr[...] = 0
        assert program.constant(i) is arr  # wrapped once, shared by every session
    names = [c.name for c in built.constants]
    weight, flat = program.constant(names.index("a.weight")), program.constant(names.index("flat"))
    assert np.shares_memory(weight, flat)  # two constants, one blob, one place in memory
    session = program.session()
    assert session.backend.constant(names.index("a.weight")) is weight


def test_constants_loaded_from_bytes_are_read_only_views(exported):
    _, _, path = exported["duplicated"]
    raw = Path(path).read_bytes()
    program = kiln.load(raw)
    arr = program.constant(0)
    assert not arr.flags.writeable
    assert isinstance(_base(arr), bytes)


def test_header_fields(exported):
    for built, _, path in exported.values():
        raw = Path(path).read_bytes()
        magic, h = Header.unpack(raw[:HEADER_SIZE])
        assert raw[:8] == magic == MAGIC == b"\x89KILN\r\n\x1a"
        assert h.format_version == FORMAT_VERSION == 1
        assert h.opset_version == ops.OPSET_VERSION == built.opset_version
        assert h.meta_offset == HEADER_SIZE
        assert raw[h.meta_offset + 4:h.meta_offset + 8] == b"KILN"  # FlatBuffers file identifier
        assert h.file_size == len(raw) == h.const_offset + h.const_size
        assert h.meta_crc32 == zlib.crc32(raw[h.meta_offset:h.meta_offset + h.meta_size])
        assert h.const_crc32 == zlib.crc32(raw[h.const_offset:])
        assert kiln.load(path).header == h


def test_loaded_programs_run_like_eager(exported):
    x = torch.randn(3, small_models.WIDTH)
    out = kiln.load(exported["duplicated"][2]).session().run("forward", x.numpy())[0]
    with torch.no_grad():
        np.testing.assert_allclose(out, small_models.DuplicatedMLP()(x).numpy(), rtol=1e-5, atol=1e-5)

    session, eager = kiln.load(exported["accumulator"][2]).session(), small_models.Accumulator()
    for _ in range(3):
        x = torch.randn(3, 8)  # exported with a static batch
        with torch.no_grad():
            want = eager(x).numpy()
        np.testing.assert_allclose(session.run("forward", x.numpy())[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(session.state[0], eager.total.numpy(), rtol=1e-5, atol=1e-5)

    session, eager = kiln.load(exported["dynamic"][2]).session(validate=True), small_models.DynamicBlock()
    for shape in ((1, 3, 8), (5, 17, 8)):
        x = torch.randn(*shape)
        with torch.no_grad():
            want = eager(x).numpy()
        np.testing.assert_allclose(session.run("forward", x.numpy())[0], want, rtol=1e-5, atol=1e-5)


def test_failed_write_leaves_the_old_file_and_no_temporary(exported, tmp_path, monkeypatch):
    built, data, _ = exported["duplicated"]
    path = tmp_path / "model.kiln"
    path.write_bytes(b"previous contents")

    class Boom(Header):
        def pack(self) -> bytes:
            raise OSError("disk full")

    monkeypatch.setattr(writer, "Header", Boom)
    with pytest.raises(OSError, match="disk full"):
        writer.write_program(built, data, path)
    assert path.read_bytes() == b"previous contents"
    assert [p.name for p in tmp_path.iterdir()] == ["model.kiln"]


def test_writer_refuses_overlapping_or_unaligned_blobs(exported, tmp_path):
    built, data, _ = exported["distinct"]
    for bad_offset in (built.blobs[0].offset + 1, built.blobs[0].offset):  # unaligned; overlaps blob 0
        blobs = list(built.blobs)
        blobs[1] = type(blobs[1])(bad_offset, blobs[1].nbytes)
        program = Program(built.opset_version, built.methods, built.constants, blobs, built.states)
        with pytest.raises(ValueError, match="blob 1"):
            writer.write_program(program, data, tmp_path / "bad.kiln")
        assert not (tmp_path / "bad.kiln").exists()
