"""Serialize a kiln.ir.graph.Program with its constant bytes into one .kiln file."""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from typing import Any

import flatbuffers
import numpy as np

from kiln.errors import ProgramFormatError
from kiln.format import ALIGNMENT, FORMAT_VERSION
from kiln.format.generated import Attribute as fbAttribute
from kiln.format.generated import Blob as fbBlob
from kiln.format.generated import Constant as fbConstant
from kiln.format.generated import Dim as fbDim
from kiln.format.generated import Metadata as fbMetadata
from kiln.format.generated import Method as fbMethod
from kiln.format.generated import Node as fbNode
from kiln.format.generated import Program as fbProgram
from kiln.format.generated import StateBuffer as fbStateBuffer
from kiln.format.generated import StateUpdate as fbStateUpdate
from kiln.format.generated import Symbol as fbSymbol
from kiln.format.generated import Value as fbValue
from kiln.format.header import HEADER_SIZE, Header
from kiln.ir import ops
from kiln.ir.dtypes import DType
from kiln.ir.graph import Method, Node, Program
from kiln.ir.ops import AttrType
from kiln.ir.verify import verify_program


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class _Encoder:
    """Builds the FlatBuffers table bottom-up (children before parents, as FlatBuffers requires)."""

    def __init__(self) -> None:
        self.b = flatbuffers.Builder(1 << 16)
        self._strings: dict[str, int] = {}

    def string(self, s: str) -> int:
        off = self._strings.get(s)
        if off is None:
            off = self._strings[s] = self.b.CreateString(s)
        return off

    def ints(self, values: Sequence[int], dtype: Any = np.int64) -> int:
        return self.b.CreateNumpyVector(np.asarray(list(values), dtype=dtype))

    def tables(self, offsets: list[int]) -> int:
        self.b.StartVector(4, len(offsets), 4)
        for off in reversed(offsets):
            self.b.PrependUOffsetTRelative(off)
        return self.b.EndVector()

    def dim(self, d: int | str) -> int:
        expr = self.string(d) if isinstance(d, str) else None
        fbDim.Start(self.b)
        if expr is not None:
            fbDim.AddExpr(self.b, expr)
        else:
            fbDim.AddValue(self.b, int(d))
        return fbDim.End(self.b)

    def dims(self, shape: Sequence[int | str]) -> int:
        return self.tables([self.dim(d) for d in shape])

    def attr_kind(self, node: Node, name: str) -> AttrType:
        """The type an attribute is written as: the op table's (a fuzzer's encoder may say otherwise)."""
        return ops.get(node.op).attr_map[name].type

    def attribute(self, name: str, kind: AttrType, value: Any) -> int:
        name_off, payload = self.string(name), None
        if kind == AttrType.STRING:
            payload = self.string(value)
        elif kind == AttrType.INTS:
            payload = self.ints(value)
        elif kind == AttrType.FLOATS:
            payload = self.b.CreateNumpyVector(np.asarray(list(value), dtype=np.float64))
        elif kind == AttrType.SYMINTS:
            payload = self.dims(value)
        elif kind == AttrType.SYMINT:
            payload = self.dims([value])
        fbAttribute.Start(self.b)
        fbAttribute.AddName(self.b, name_off)
        fbAttribute.AddKind(self.b, int(kind))
        if kind in (AttrType.INT, AttrType.BOOL, AttrType.DTYPE):
            fbAttribute.AddI(self.b, int(value))
        elif kind == AttrType.FLOAT:
            fbAttribute.AddF(self.b, float(value))
        elif kind == AttrType.STRING:
            fbAttribute.AddS(self.b, payload)
        elif kind == AttrType.INTS:
            fbAttribute.AddInts(self.b, payload)
        elif kind == AttrType.FLOATS:
            fbAttribute.AddFloats(self.b, payload)
        else:
            fbAttribute.AddDims(self.b, payload)
        return fbAttribute.End(self.b)

    def method(self, m: Method) -> int:
        b = self.b
        values = []
        for v in m.values:
            name, shape = self.string(v.name), self.dims(v.shape)
            fbValue.Start(b)
            fbValue.AddName(b, name)
            fbValue.AddDtype(b, int(v.dtype))
            fbValue.AddShape(b, shape)
            fbValue.AddKind(b, int(v.kind))
            fbValue.AddRef(b, v.ref)
            values.append(fbValue.End(b))
        nodes = []
        for n in m.nodes:
            attrs = [self.attribute(k, self.attr_kind(n, k), v) for k, v in n.attrs.items() if v is not None]
            op, ins, outs = self.string(n.op), self.ints(n.inputs, np.int32), self.ints(n.outputs, np.int32)
            attr_vec, frees = self.tables(attrs), self.ints(n.free_after, np.int32)
            source = self.string(n.source) if n.source else None
            fbNode.Start(b)
            fbNode.AddOp(b, op)
            fbNode.AddInputs(b, ins)
            fbNode.AddOutputs(b, outs)
            fbNode.AddAttrs(b, attr_vec)
            fbNode.AddFreeAfter(b, frees)
            if source is not None:
                fbNode.AddSource(b, source)
            nodes.append(fbNode.End(b))
        symbols = []
        for s in m.symbols:
            name = self.string(s.name)
            fbSymbol.Start(b)
            fbSymbol.AddName(b, name)
            fbSymbol.AddMin(b, s.min)
            fbSymbol.AddMax(b, s.max)
            symbols.append(fbSymbol.End(b))
        updates = []
        for u in m.state_updates:
            fbStateUpdate.Start(b)
            fbStateUpdate.AddValue(b, u.value)
            fbStateUpdate.AddState(b, u.state)
            updates.append(fbStateUpdate.End(b))
        name = self.string(m.name)
        vec = [self.tables(values), self.ints(m.inputs, np.int32), self.ints(m.outputs, np.int32),
               self.tables(nodes), self.tables(symbols), self.tables(updates)]
        fbMethod.Start(b)
        fbMethod.AddName(b, name)
        fbMethod.AddValues(b, vec[0])
        fbMethod.AddInputs(b, vec[1])
        fbMethod.AddOutputs(b, vec[2])
        fbMethod.AddNodes(b, vec[3])
        fbMethod.AddSymbols(b, vec[4])
        fbMethod.AddStateUpdates(b, vec[5])
        return fbMethod.End(b)

    def program(self, p: Program) -> bytes:
        b = self.b
        methods = [self.method(m) for m in p.methods.values()]
        constants = []
        for c in p.constants:
            name, shape = self.string(c.name), self.ints(c.shape)
            fbConstant.Start(b)
            fbConstant.AddName(b, name)
            fbConstant.AddDtype(b, int(c.dtype))
            fbConstant.AddShape(b, shape)
            fbConstant.AddBlob(b, c.blob)
            constants.append(fbConstant.End(b))
        blobs = []
        for bl in p.blobs:
            fbBlob.Start(b)
            fbBlob.AddOffset(b, bl.offset)
            fbBlob.AddNbytes(b, bl.nbytes)
            blobs.append(fbBlob.End(b))
        states = []
        for s in p.states:
            name, shape = self.string(s.name), self.ints(s.shape)
            fbStateBuffer.Start(b)
            fbStateBuffer.AddName(b, name)
            fbStateBuffer.AddDtype(b, int(s.dtype))
            fbStateBuffer.AddShape(b, shape)
            fbStateBuffer.AddInitialValue(b, s.init)
            states.append(fbStateBuffer.End(b))
        metadata = []
        for k, v in p.metadata.items():
            ko, vo = self.string(k), self.string(v)
            fbMetadata.Start(b)
            fbMetadata.AddKey(b, ko)
            fbMetadata.AddValue(b, vo)
            metadata.append(fbMetadata.End(b))
        vecs = [self.tables(x) for x in (methods, constants, blobs, states, metadata)]
        fbProgram.Start(b)
        fbProgram.AddOpsetVersion(b, p.opset_version)
        fbProgram.AddMethods(b, vecs[0])
        fbProgram.AddConstants(b, vecs[1])
        fbProgram.AddBlobs(b, vecs[2])
        fbProgram.AddStates(b, vecs[3])
        fbProgram.AddMetadata(b, vecs[4])
        b.Finish(fbProgram.End(b), file_identifier=b"KILN")
        return bytes(b.Output())


def encode_metadata(program: Program) -> bytes:
    """The FlatBuffers metadata table of `program` (the file's second section), without header or constants."""
    return _Encoder().program(program)


def layout_blobs(sizes: Sequence[int]) -> list[int]:
    """Offsets (relative to the constant segment) that put each blob on a 64-byte boundary."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos = _align(pos + n)
    return offsets


def write_program(program: Program, blob_data: Sequence[Any], path: str | os.PathLike, verify: bool = True) -> int:
    """Write `program` and the bytes of its blobs (buffer objects, in blob order) to `path`; returns the size.

    Writes to a temporary file beside `path` and renames it, so a failed export never leaves a half file. verify
    runs the loader's verifier first (tests that write broken programs on purpose turn it off).
    """
    if len(blob_data) != len(program.blobs):
        raise ValueError(f"{len(program.blobs)} blobs declared but {len(blob_data)} given")
    end = 0
    for i, (blob, data) in enumerate(zip(program.blobs, blob_data, strict=True)):
        if memoryview(data).nbytes != blob.nbytes or blob.offset % ALIGNMENT or blob.offset < end:
            raise ValueError(f"blob {i} [{blob.offset}, +{blob.nbytes}) does not match its data "
                             f"({memoryview(data).nbytes} bytes), is unaligned, or overlaps the blob before it")
        end = blob.offset + blob.nbytes
    for c in program.constants:
        if c.dtype not in DType.__members__.values():
            raise ValueError(f"constant {c.name} has no kiln dtype")
    try:  # the loader runs the same verifier: never write a file it would refuse
        if verify:
            verify_program(program)
    except ProgramFormatError as e:
        raise ProgramFormatError(f"kiln would write a program its loader refuses (a bug in the exporter or in the "
                                 f"op's rule; please report it): {e}") from None
    meta = encode_metadata(program)
    const_offset = _align(HEADER_SIZE + len(meta))
    const_size = _align(program.blobs[-1].offset + program.blobs[-1].nbytes) if program.blobs else 0
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)
            f.write(meta)
            f.write(b"\0" * (const_offset - HEADER_SIZE - len(meta)))
            crc, pos = 0, 0
            for blob, data in zip(program.blobs, blob_data, strict=True):
                pad = b"\0" * (blob.offset - pos)
                view = memoryview(data).cast("B")
                f.write(pad)
                f.write(view)
                crc = zlib.crc32(view, zlib.crc32(pad, crc))
                pos = blob.offset + blob.nbytes
            tail = b"\0" * (const_size - pos)
            f.write(tail)
            crc = zlib.crc32(tail, crc)
            header = Header(FORMAT_VERSION, program.opset_version, HEADER_SIZE, len(meta), const_offset,
                            const_size, const_offset + const_size, zlib.crc32(meta), crc)
            f.seek(0)
            f.write(header.pack())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return const_offset + const_size
