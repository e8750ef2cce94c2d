"""Read and validate a .kiln file. Trusts nothing: every offset, size, index, dtype and attribute is checked.

Any defect raises ProgramFormatError saying what is wrong and where; reading never goes outside the buffer
(FlatBuffers accessors go through struct.unpack_from, which raises rather than reads past the end) and every
vector length is bounded by the buffer size before it is iterated, so a hostile file cannot make the loader hang.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from kiln.errors import ProgramFormatError
from kiln.format import ALIGNMENT, FORMAT_VERSION
from kiln.format.generated.Program import Program as fbProgram
from kiln.format.header import HEADER_SIZE, MAGIC, Header
from kiln.ir import ops
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Blob, Constant, Method, Node, Program, StateBuffer, StateUpdate, Value, ValueKind
from kiln.ir.ops import REQUIRED, AttrType
from kiln.ir.symbolic import UNBOUNDED, ExprError, Symbol, parse
from kiln.ir.verify import verify_program

_IDENT_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def read_header(buf: Any) -> Header:
    """Check magic, versions and section bounds against the real size of `buf`."""
    size = len(buf)
    if size < HEADER_SIZE:
        raise ProgramFormatError(f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte kiln header: truncated "
                                 "or not a .kiln file")
    magic, h = Header.unpack(bytes(buf[:HEADER_SIZE]))
    if magic != MAGIC:
        raise ProgramFormatError(f"not a .kiln file: magic bytes {magic!r}, expected {MAGIC!r}")
    if h.format_version > FORMAT_VERSION or h.format_version < 1:
        raise ProgramFormatError(f"file format version {h.format_version} is not supported; this kiln reads up to "
                                 f"version {FORMAT_VERSION}. Upgrade kiln to load it.")
    if h.opset_version > ops.OPSET_VERSION or h.opset_version < 1:
        raise ProgramFormatError(f"file needs op set version {h.opset_version}; this kiln implements up to "
                                 f"{ops.OPSET_VERSION}. Upgrade kiln to run it.")
    if h.file_size != size:
        raise ProgramFormatError(f"header says the file is {h.file_size} bytes but it is {size}: "
                                 f"{'truncated' if size < h.file_size else 'trailing data'}")
    if h.meta_offset != HEADER_SIZE or h.meta_size < 8 or h.meta_offset + h.meta_size > size:
        raise ProgramFormatError(f"metadata section [{h.meta_offset}, +{h.meta_size}) lies outside the file "
                                 f"({size} bytes)")
    if h.const_offset != _align(h.meta_offset + h.meta_size) or h.const_offset + h.const_size != size:
        raise ProgramFormatError(f"constant segment [{h.const_offset}, +{h.const_size}) is misplaced: it must start "
                                 f"at the first {ALIGNMENT}-byte boundary after the metadata "
                                 f"({_align(h.meta_offset + h.meta_size)}) and end at the end of the file ({size})")
    return h


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def read_program(buf: Any, verify_checksums: bool = True) -> tuple[Program, Header]:
    """Validate `buf` (bytes or mmap) and return the program and its header."""
    h = read_header(buf)
    meta = bytes(buf[h.meta_offset:h.meta_offset + h.meta_size])
    if zlib.crc32(meta) != h.meta_crc32:
        raise ProgramFormatError("metadata checksum mismatch: the file is corrupted")
    if any(buf[h.meta_offset + h.meta_size:h.const_offset]):  # no checksum covers the padding: it must be zeros
        raise ProgramFormatError("padding between the metadata and the constant segment is not zero: the file is "
                                 "corrupted")
    if verify_checksums:
        crc, step = 0, 1 << 24
        view = memoryview(buf)
        for start in range(h.const_offset, h.const_offset + h.const_size, step):
            crc = zlib.crc32(view[start:min(start + step, h.const_offset + h.const_size)], crc)
        del view
        if crc != h.const_crc32:
            raise ProgramFormatError("constant segment checksum mismatch: the weights in the file are corrupted")
    try:
        program = _Decoder(meta, h).program()
    except ProgramFormatError:
        raise
    except (ExprError, ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError,
            RecursionError, Exception) as e:  # noqa: BLE001 - any decoder failure is a format error
        raise ProgramFormatError(f"corrupted metadata: {type(e).__name__}: {e}") from None
    if program.opset_version != h.opset_version:
        raise ProgramFormatError(f"op set version in the header ({h.opset_version}) and the metadata "
                                 f"({program.opset_version}) disagree")
    _check_program(program, h)
    verify_program(program)
    return program, h


class _Decoder:
    """Turns the FlatBuffers table into kiln.ir.graph objects, bounding every vector by the buffer size."""

    def __init__(self, meta: bytes, header: Header):
        self.meta, self.limit = meta, len(meta) // 4 + 1
        # FlatBuffers lets many tables point at one vector or string, so per-vector bounds alone still allow a small
        # hostile file to decode into quadratic work and memory. The writer never shares vectors (each element takes
        # at least 4 bytes of its own) and shares only short strings, so these totals bound any file it writes.
        self.entries_left = len(meta) // 4 + 1
        self.text_left = 64 * len(meta) + (16 << 20)
        if meta[4:8] != b"KILN":
            raise ProgramFormatError("metadata is not a kiln FlatBuffers table (identifier missing)")
        self.root = fbProgram.GetRootAs(meta, 0)

    def n(self, obj: Any, field: str, where: str) -> int:
        count = getattr(obj, field + "Length")()
        if count < 0 or count > self.limit:
            raise ProgramFormatError(f"{where}: vector '{field}' claims {count} entries, more than the file holds")
        self.entries_left -= count
        if self.entries_left < 0:
            raise ProgramFormatError(f"{where}: vector '{field}' brings the entries decoded past what a "
                                     f"{len(self.meta)}-byte metadata table can hold (vectors shared or overlapping)")
        return count

    def ints(self, obj: Any, field: str, where: str) -> list[int]:
        if self.n(obj, field, where) == 0:
            return []
        return [int(x) for x in getattr(obj, field + "AsNumpy")()]

    def floats(self, obj: Any, field: str, where: str) -> list[float]:
        if self.n(obj, field, where) == 0:
            return []
        return [float(x) for x in getattr(obj, field + "AsNumpy")()]

    def items(self, obj: Any, field: str, where: str) -> list[Any]:
        get = getattr(obj, field)
        return [get(i) for i in range(self.n(obj, field, where))]

    def text(self, raw: bytes | None) -> str:
        if raw is None:
            return ""
        self.text_left -= len(raw)
        if self.text_left < 0:
            raise ProgramFormatError(f"strings decoded exceed what a {len(self.meta)}-byte metadata table can hold "
                                     "(one long string referenced many times)")
        return raw.decode("utf-8")

    def dims(self, obj: Any, field: str, where: str) -> tuple[int | str, ...]:
        out: list[int | str] = []
        for d in self.items(obj, field, where):
            expr = self.text(d.Expr())
            out.append(expr if expr else int(d.Value()))
        return tuple(out)

    def dtype(self, code: int, where: str) -> DType:
        try:
            return DType(code)
        except ValueError:
            raise ProgramFormatError(f"{where}: unknown dtype code {code}") from None

    def program(self) -> Program:
        r = self.root
        methods: dict[str, Method] = {}
        for m in self.items(r, "Methods", "program"):
            method = self.method(m)
            if method.name in methods:
                raise ProgramFormatError(f"method {method.name!r} appears twice")
            methods[method.name] = method
        constants = []
        for i, c in enumerate(self.items(r, "Constants", "program")):
            where = f"constant {i}"
            constants.append(Constant(self.text(c.Name()), self.dtype(c.Dtype(), where),
                                      tuple(self.ints(c, "Shape", where)), int(c.Blob())))
        blobs = [Blob(int(b.Offset()), int(b.Nbytes())) for b in self.items(r, "Blobs", "program")]
        states = []
        for i, s in enumerate(self.items(r, "States", "program")):
            where = f"state buffer {i}"
            states.append(StateBuffer(self.text(s.Name()), self.dtype(s.Dtype(), where),
                                      tuple(self.ints(s, "Shape", where)), int(s.InitialValue())))
        metadata = {self.text(kv.Key()): self.text(kv.Value()) for kv in self.items(r, "Metadata", "program")}
        return Program(int(r.OpsetVersion()), methods, constants, blobs, states, metadata)

    def method(self, m: Any) -> Method:
        name = self.text(m.Name())
        where = f"method {name!r}"
        values = []
        for i, v in enumerate(self.items(m, "Values", where)):
            vw = f"{where} value {i}"
            kind = int(v.Kind())
            if kind not in ValueKind._value2member_map_:
                raise ProgramFormatError(f"{vw}: unknown value kind {kind}")
            values.append(Value(self.text(v.Name()), self.dtype(v.Dtype(), vw), self.dims(v, "Shape", vw),
                                ValueKind(kind), int(v.Ref())))
        nodes = []
        for i, n in enumerate(self.items(m, "Nodes", where)):
            nw = f"{where} node {i}"
            nodes.append(Node(self.text(n.Op()), self.ints(n, "Inputs", nw), self.ints(n, "Outputs", nw),
                              self.attrs(n, nw), self.ints(n, "FreeAfter", nw), self.text(n.Source())))
        symbols = [Symbol(self.text(s.Name()), int(s.Min()), int(s.Max())) for s in self.items(m, "Symbols", where)]
        updates = [StateUpdate(int(u.Value()), int(u.State())) for u in self.items(m, "StateUpdates", where)]
        return Method(name, values, self.ints(m, "Inputs", where), self.ints(m, "Outputs", where), nodes,
                      symbols, updates)

    def attrs(self, n: Any, where: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for a in self.items(n, "Attrs", where):
            name, kind = self.text(a.Name()), int(a.Kind())
            aw = f"{where} attribute {name!r}"
            if kind not in AttrType._value2member_map_:
                raise ProgramFormatError(f"{aw}: unknown attribute kind {kind}")
            kind = AttrType(kind)
            if kind == AttrType.INT:
                value: Any = int(a.I())
            elif kind == AttrType.BOOL:
                value = bool(a.I())
            elif kind == AttrType.DTYPE:
                value = self.dtype(int(a.I()), aw)
            elif kind == AttrType.FLOAT:
                value = float(a.F())
            elif kind == AttrType.STRING:
                value = self.text(a.S())
            elif kind == AttrType.INTS:
                value = tuple(self.ints(a, "Ints", aw))
            elif kind == AttrType.FLOATS:
                value = tuple(self.floats(a, "Floats", aw))
            elif kind == AttrType.SYMINTS:
                value = self.dims(a, "Dims", aw)
            else:
                dims = self.dims(a, "Dims", aw)
                if len(dims) != 1:
                    raise ProgramFormatError(f"{aw}: a symint holds exactly one dimension, found {len(dims)}")
                value = dims[0]
            if name in out:
                raise ProgramFormatError(f"{aw} appears twice")
            out[name] = (kind, value)
        return out


def _fail(where: str, what: str) -> None:
    raise ProgramFormatError(f"{where}: {what}")


def _check_program(p: Program, h: Header) -> None:
    for i, b in enumerate(p.blobs):
        if b.offset % ALIGNMENT or b.offset < 0 or b.nbytes < 0 or b.offset + b.nbytes > h.const_size:
            _fail(f"blob {i}", f"[{b.offset}, +{b.nbytes}) is unaligned or outside the {h.const_size}-byte "
                               "constant segment")
    for i, c in enumerate(p.constants):
        if not 0 <= c.blob < len(p.blobs):
            _fail(f"constant {i} ({c.name})", f"blob index {c.blob} out of range (0..{len(p.blobs) - 1})")
        if any(d < 0 for d in c.shape) or c.nbytes != p.blobs[c.blob].nbytes:
            _fail(f"constant {i} ({c.name})", f"{c.dtype.name}{list(c.shape)} needs {c.nbytes} bytes but its blob "
                                             f"holds {p.blobs[c.blob].nbytes}")
    for i, s in enumerate(p.states):
        if any(d < 0 for d in s.shape):
            _fail(f"state buffer {i} ({s.name})", f"negative dimension in {list(s.shape)}")
        if s.init != -1:
            if not 0 <= s.init < len(p.constants):
                _fail(f"state buffer {i} ({s.name})", f"initial value index {s.init} out of range")
            c = p.constants[s.init]
            if c.dtype != s.dtype or c.shape != s.shape:
                _fail(f"state buffer {i} ({s.name})", "initial value's dtype/shape differ from the buffer's")
    if not p.methods:
        _fail("program", "has no methods")
    for m in p.methods.values():
        _check_method(p, m)


def _check_dims(shape: tuple, symbols: set[str], where: str) -> None:
    for d in shape:
        if isinstance(d, int):
            if d < 0:
                _fail(where, f"negative dimension {d}")
        else:
            try:
                expr = parse(d)
            except ExprError as e:
                _fail(where, str(e))
            unknown = expr.symbols - symbols
            if unknown:
                _fail(where, f"dimension {d!r} uses undeclared symbol(s) {sorted(unknown)}")


def _check_method(p: Program, m: Method) -> None:
    where = f"method {m.name!r}"
    symbols = set()
    for s in m.symbols:
        if not s.name or not set(s.name) <= _IDENT_OK or s.name[0].isdigit() or s.name in symbols:
            _fail(where, f"bad or repeated symbol name {s.name!r}")
        if s.min < 0 or (s.max != UNBOUNDED and s.max < s.min):
            _fail(where, f"symbol {s.name} has bounds [{s.min}, {s.max}]")
        symbols.add(s.name)
    nvalues = len(m.values)
    for i, v in enumerate(m.values):
        vw = f"{where} value {i} ({v.name})"
        _check_dims(v.shape, symbols, vw)
        if v.kind == ValueKind.CONSTANT:
            if not 0 <= v.ref < len(p.constants):
                _fail(vw, f"constant index {v.ref} out of range")
            c = p.constants[v.ref]
            if c.dtype != v.dtype or c.shape != v.shape:
                _fail(vw, f"declared {v.dtype.name}{list(v.shape)} but constant {v.ref} is "
                          f"{c.dtype.name}{list(c.shape)}")
        elif v.kind == ValueKind.STATE:
            if not 0 <= v.ref < len(p.states):
                _fail(vw, f"state index {v.ref} out of range")
            s = p.states[v.ref]
            if s.dtype != v.dtype or s.shape != v.shape:
                _fail(vw, f"declared {v.dtype.name}{list(v.shape)} but state {v.ref} is "
                          f"{s.dtype.name}{list(s.shape)}")
    defined = [False] * nvalues
    for i, v in enumerate(m.values):
        defined[i] = v.kind != ValueKind.TEMP
    for k, i in enumerate(m.inputs):
        if not 0 <= i < nvalues or m.values[i].kind != ValueKind.INPUT:
            _fail(where, f"input {k} refers to value {i}, which is not an input value")
    if len(set(m.inputs)) != len(m.inputs):
        _fail(where, "an input value is listed twice")
    unlisted = [i for i, v in enumerate(m.values) if v.kind == ValueKind.INPUT and i not in set(m.inputs)]
    if unlisted:
        _fail(where, f"value {unlisted[0]} ({m.values[unlisted[0]].name}) is an input value but not a method input")
    last_read = _last_readers(m)
    kept = set(m.outputs) | {u.value for u in m.state_updates}
    for j, n in enumerate(m.nodes):
        nw = f"{where} node {j} ({n.op})"
        if n.op not in ops.OPS:
            _fail(nw, f"unknown op {n.op!r} (op set version {ops.OPSET_VERSION})")
        opdef = ops.OPS[n.op]
        if len(n.inputs) < opdef.min_inputs or (opdef.max_inputs is not None and len(n.inputs) > opdef.max_inputs):
            _fail(nw, f"has {len(n.inputs)} inputs; {opdef.signature()}")
        if opdef.max_inputs is not None:  # trailing optional inputs left out are absent: every kernel sees them all
            n.inputs = list(n.inputs) + [NO_VALUE] * (opdef.max_inputs - len(n.inputs))
        for k, i in enumerate(n.inputs):
            optional = k < len(opdef.inputs) and opdef.inputs[k].optional
            if i == NO_VALUE and optional:
                continue
            if not 0 <= i < nvalues:
                _fail(nw, f"input {k} refers to value {i}, out of range (0..{nvalues - 1})")
            if not defined[i]:
                _fail(nw, f"input {k} reads value {i} ({m.values[i].name}) before it is produced")
        if len(n.outputs) != opdef.num_outputs:
            _fail(nw, f"has {len(n.outputs)} outputs; {opdef.signature()}")
        for i in n.outputs:
            if not 0 <= i < nvalues or m.values[i].kind != ValueKind.TEMP or defined[i]:
                _fail(nw, f"output value {i} is out of range, not a temporary, or produced twice")
            defined[i] = True
        for i in n.free_after:
            if not 0 <= i < nvalues:
                _fail(nw, f"free_after names value {i}, out of range")
            # The memory plan may drop only a temporary or input that nothing reads later and the caller never sees.
            if (m.values[i].kind not in (ValueKind.TEMP, ValueKind.INPUT) or not defined[i] or i in kept
                    or last_read.get(i, -1) > j):
                _fail(nw, f"free_after drops value {i} ({m.values[i].name}), which is not a dead temporary here "
                          "(read later, a method output or state update, a constant/state, or not yet produced)")
        n.attrs = _check_attrs(opdef, n.attrs, symbols, nw)
    for k, i in enumerate(m.outputs):
        if not 0 <= i < nvalues or not defined[i]:
            _fail(where, f"output {k} refers to value {i}, which is out of range or never produced")
    for u in m.state_updates:
        if not 0 <= u.value < nvalues or not defined[u.value] or not 0 <= u.state < len(p.states):
            _fail(where, f"state update {u.value} -> {u.state} refers to a missing value or state buffer")
        v, s = m.values[u.value], p.states[u.state]
        if v.dtype != s.dtype or tuple(v.shape) != s.shape:
            _fail(where, f"state update writes {v.dtype.name}{list(v.shape)} into {s.name} "
                         f"{s.dtype.name}{list(s.shape)}")
    _check_symbols_bindable(m, where)


def _check_symbols_bindable(m: Method, where: str) -> None:
    """A runtime binds each symbol from an input dimension that is exactly that symbol; one used without such a
    dimension could never be given a size."""
    bindable = {d for v in m.input_specs() for d in v.shape if isinstance(d, str) and parse(d).is_symbol}
    dims = [d for v in m.values for d in v.shape]
    for n in m.nodes:
        for name, value in n.attrs.items():
            kind = ops.OPS[n.op].attr_map[name].type
            if kind in (AttrType.SYMINT, AttrType.SYMINTS):
                dims.extend(value if kind == AttrType.SYMINTS else (value,))
    for d in dims:
        if isinstance(d, str):
            unbound = parse(d).symbols - bindable
            if unbound:
                _fail(where, f"symbol(s) {sorted(unbound)} in {d!r} are not the size of any input dimension, so "
                             "no call could bind them")


def _last_readers(m: Method) -> dict[int, int]:
    """Value index -> index of the last node that reads it."""
    last: dict[int, int] = {}
    for j, n in enumerate(m.nodes):
        for i in n.inputs:
            last[i] = j
    return last


def _check_attrs(opdef: ops.OpDef, raw: dict[str, tuple[AttrType, Any]], symbols: set[str], where: str) -> dict:
    attrs = {}
    for name, (kind, value) in raw.items():
        adef = opdef.attr_map.get(name)
        if adef is None:
            _fail(where, f"unknown attribute {name!r}; {opdef.signature()}")
        if adef.type != kind:
            _fail(where, f"attribute {name!r} is {kind.name.lower()}, expected {adef.type.name.lower()}")
        if kind in (AttrType.SYMINT, AttrType.SYMINTS):
            _check_dims_allow_negative(value if kind == AttrType.SYMINTS else (value,), symbols, f"{where} {name}")
        if kind == AttrType.FLOAT and not np.isfinite(value) and name not in ("min", "max", "value"):
            _fail(where, f"attribute {name!r} is {value}")
        attrs[name] = value
    for adef in opdef.attrs:
        if adef.name not in attrs:
            if adef.default is REQUIRED:
                _fail(where, f"required attribute {adef.name!r} is missing")
    return attrs


def _check_dims_allow_negative(dims: tuple, symbols: set[str], where: str) -> None:
    """Attributes may hold negative ints (e.g. pads that crop); only expressions need checking."""
    for d in dims:
        if isinstance(d, str):
            try:
                expr = parse(d)
            except ExprError as e:
                _fail(where, str(e))
            if expr.symbols - symbols:
                _fail(where, f"expression {d!r} uses undeclared symbol(s) {sorted(expr.symbols - symbols)}")
