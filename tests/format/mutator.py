"""A structure-aware mutator of .kiln programs, and the judge of what loading and running a mutant may do.

Why structure-aware: flipping bytes of a file mostly breaks its checksums or its FlatBuffers table, which the
loader rejects long before the interesting checks. Here a mutant is a valid program with a few fields edited in
its decoded form (dims, dtypes, value ids, op names, attribute values and types, node order, symbols' bounds,
blob offsets and lengths, signatures, state updates) and then encoded again with fresh checksums, so every check
behind the checksums is reached; byte flips under recomputed checksums and truncations cover the decoder.

The judge: a mutant must either be refused at load with ProgramFormatError, or load and then run every method on
inputs within the symbols' bounds with no exception other than InputError. Anything else is an escape. Used by
tests/format/test_fuzz.py (a fixed-seed sample) and by `python -m tests.format.fuzz_campaign` (the long run).
"""

from __future__ import annotations

import copy
import os
import random
import signal
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import kiln
from kiln.errors import InputError, ProgramFormatError
from kiln.format import ALIGNMENT
from kiln.format.header import HEADER_SIZE, Header
from kiln.format.writer import _Encoder
from kiln.ir import ops
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Blob, Method, Node, Program, StateUpdate
from kiln.ir.ops import AttrType
from kiln.ir.symbolic import UNBOUNDED, Symbol

HANG_S = 20
"""A mutant that takes longer than this to load and run is a hang (a valid one takes milliseconds)."""

HUGE = (1 << 31) - 1


class Escape(AssertionError):
    """A mutant did something other than load-and-run or ProgramFormatError."""


@dataclass
class Seed:
    name: str
    program: Program
    data: list[Any]


class MutantEncoder(_Encoder):
    """The writer's encoder, with attribute types a mutation chose (and ops unknown to the table) allowed."""

    def __init__(self, kinds: dict[tuple[int, str], AttrType]):
        super().__init__()
        self.kinds = kinds

    def attr_kind(self, node: Node, name: str) -> AttrType:
        known = ops.OPS.get(node.op)
        return self.kinds.get((id(node), name)) or (known.attr_map[name].type if known and name in known.attr_map
                                                    else AttrType.INT)


def encode(program: Program, data: list[Any], kinds: dict | None = None) -> bytes:
    """The file for `program` (blob table as it says, even if it lies; bytes laid out from `data`), checksums
    recomputed, without the writer's checks."""
    meta = MutantEncoder(kinds or {}).program(program)
    const = bytearray()
    for d in data:  # laid out as the writer lays them (each blob on the next boundary)
        raw = bytes(memoryview(d).cast("B"))
        const += raw + b"\0" * (-len(raw) % ALIGNMENT)
    const_offset = -(-(HEADER_SIZE + len(meta)) // ALIGNMENT) * ALIGNMENT
    h = Header(1, program.opset_version, HEADER_SIZE, len(meta), const_offset, len(const), const_offset + len(const),
               zlib.crc32(meta), zlib.crc32(bytes(const)))
    return h.pack() + meta + b"\0" * (const_offset - HEADER_SIZE - len(meta)) + bytes(const)


# ---- mutations of the decoded program ----

def _dim_choice(rng: random.Random, symbols: list[str]) -> int | str:
    choices: list[int | str] = [0, 1, 2, 3, 7, 64, HUGE, 1 << 40, -1]
    if symbols:
        s = rng.choice(symbols)
        choices += [s, f"{s} + 1", f"{s} * 2", f"{s} - 1", f"{s} // 2", f"max({s}, 3)"]
    return rng.choice(choices)


def _method(p: Program, rng: random.Random) -> Method:
    return p.methods[rng.choice(sorted(p.methods))]


def m_value_dim(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    v = rng.choice(m.values)
    if v.shape:
        shape = list(v.shape)
        shape[rng.randrange(len(shape))] = _dim_choice(rng, [s.name for s in m.symbols])
        v.shape = tuple(shape)
    else:
        v.shape = (_dim_choice(rng, [s.name for s in m.symbols]),)


def m_value_rank(p: Program, rng: random.Random, kinds: dict) -> None:
    v = rng.choice(_method(p, rng).values)
    v.shape = v.shape[:-1] if v.shape and rng.random() < 0.5 else v.shape + (rng.choice([1, 2, 5]),)


def m_value_dtype(p: Program, rng: random.Random, kinds: dict) -> None:
    rng.choice(_method(p, rng).values).dtype = rng.choice(list(DType))


def m_node_input(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    n = rng.choice(m.nodes)
    if n.inputs:
        n.inputs[rng.randrange(len(n.inputs))] = rng.choice([NO_VALUE, -5, len(m.values), HUGE,
                                                             rng.randrange(len(m.values))])


def m_node_output(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    n = rng.choice(m.nodes)
    n.outputs[rng.randrange(len(n.outputs))] = rng.randrange(len(m.values))


def m_node_inputs_count(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    n = rng.choice(m.nodes)
    if n.inputs and rng.random() < 0.5:
        n.inputs.pop()
    else:
        n.inputs.append(rng.randrange(len(m.values)))


def m_op(p: Program, rng: random.Random, kinds: dict) -> None:
    n = rng.choice(_method(p, rng).nodes)
    n.op = rng.choice(sorted(ops.OPS) + ["frobnicate"])
    opdef = ops.OPS.get(n.op)
    if opdef is not None:  # keep attributes the new op knows, so the mutant reaches its rule
        n.attrs = {k: v for k, v in n.attrs.items() if k in opdef.attr_map and
                   isinstance(v, _PYTHON.get(opdef.attr_map[k].type, object))}


_PYTHON = {AttrType.INT: int, AttrType.FLOAT: float, AttrType.STRING: str, AttrType.BOOL: bool,
           AttrType.DTYPE: DType, AttrType.INTS: tuple, AttrType.FLOATS: tuple, AttrType.SYMINT: (int, str),
           AttrType.SYMINTS: tuple}


def _attr_value(kind: AttrType, rng: random.Random, symbols: list[str]) -> Any:
    ints = [0, 1, -1, 2, 3, 5, 64, HUGE, -HUGE]
    if kind in (AttrType.INT,):
        return rng.choice(ints)
    if kind == AttrType.BOOL:
        return rng.random() < 0.5
    if kind == AttrType.FLOAT:
        return rng.choice([0.0, -1.0, 1e-5, 3.5, float("inf"), float("nan"), 1e30])
    if kind == AttrType.STRING:
        return rng.choice(["", "none", "tanh", "sum", "mean", "max", "avg", "constant", "reflect", "replicate",
                           "nearest", "linear", "bilinear", "zeros", "border", "floor", "trunc", "silu", "gelu",
                           "clamp", "hardswish", "bogus", "x" * 300])
    if kind == AttrType.DTYPE:
        return rng.choice(list(DType))
    if kind == AttrType.INTS:
        return tuple(rng.choice(ints) for _ in range(rng.randrange(5)))
    if kind == AttrType.FLOATS:
        return tuple(rng.choice([0.0, 2.0, -1.0]) for _ in range(rng.randrange(4)))
    if kind == AttrType.SYMINT:
        return _dim_choice(rng, symbols)
    return tuple(_dim_choice(rng, symbols) for _ in range(rng.randrange(5)))


def m_attr_value(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    n = rng.choice(m.nodes)
    opdef = ops.OPS.get(n.op)
    if opdef is None or not opdef.attrs:
        return
    adef = rng.choice(opdef.attrs)
    n.attrs[adef.name] = _attr_value(adef.type, rng, [s.name for s in m.symbols])


def m_attr_type(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    n = rng.choice(m.nodes)
    if not n.attrs:
        return
    name = rng.choice(sorted(n.attrs))
    kind = rng.choice(list(AttrType))
    n.attrs[name] = _attr_value(kind, rng, [s.name for s in m.symbols])
    kinds[(id(n), name)] = kind


def m_attr_drop_or_add(p: Program, rng: random.Random, kinds: dict) -> None:
    n = rng.choice(_method(p, rng).nodes)
    if n.attrs and rng.random() < 0.5:
        del n.attrs[rng.choice(sorted(n.attrs))]
    else:
        n.attrs["temperature"] = 3
        kinds[(id(n), "temperature")] = AttrType.INT


def m_node_order(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    if len(m.nodes) >= 2:
        i, j = rng.sample(range(len(m.nodes)), 2)
        m.nodes[i], m.nodes[j] = m.nodes[j], m.nodes[i]


def m_node_drop_or_repeat(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    i = rng.randrange(len(m.nodes))
    if rng.random() < 0.5:
        del m.nodes[i]
    else:
        m.nodes.insert(rng.randrange(len(m.nodes) + 1), copy.deepcopy(m.nodes[i]))


def m_free_after(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    rng.choice(m.nodes).free_after.append(rng.randrange(len(m.values)))


def m_symbol(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    if m.symbols:
        i = rng.randrange(len(m.symbols))
        s = m.symbols[i]
        m.symbols[i] = Symbol(s.name, rng.choice([0, 1, s.min, s.max if s.max != UNBOUNDED else 5, HUGE]),
                              rng.choice([UNBOUNDED, s.min, 0, 3, HUGE, s.max]))


def m_signature(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    target = rng.choice([m.inputs, m.outputs])
    if target and rng.random() < 0.4:
        target.pop(rng.randrange(len(target)))
    else:
        target.append(rng.randrange(len(m.values)))


def m_state_update(p: Program, rng: random.Random, kinds: dict) -> None:
    m = _method(p, rng)
    m.state_updates.append(StateUpdate(rng.randrange(len(m.values)), rng.randrange(len(p.states) + 2)))


def m_constant(p: Program, rng: random.Random, kinds: dict) -> None:
    if not p.constants:
        return
    i = rng.randrange(len(p.constants))
    c = p.constants[i]
    if rng.random() < 0.5 and c.shape:
        shape = list(c.shape)
        shape[rng.randrange(len(shape))] = rng.choice([0, 1, 2, HUGE])
        p.constants[i] = replace(c, shape=tuple(shape))
    else:
        p.constants[i] = replace(c, blob=rng.choice([0, len(p.blobs), -1, rng.randrange(max(len(p.blobs), 1))]))


def m_blob(p: Program, rng: random.Random, kinds: dict) -> None:
    if not p.blobs:
        return
    i = rng.randrange(len(p.blobs))
    b = p.blobs[i]
    p.blobs[i] = rng.choice([Blob(b.offset + ALIGNMENT, b.nbytes), Blob(b.offset, b.nbytes + 4),
                             Blob(b.offset + 4, b.nbytes), Blob(1 << 40, b.nbytes), Blob(b.offset, 0)])


def m_state(p: Program, rng: random.Random, kinds: dict) -> None:
    if p.states:
        i = rng.randrange(len(p.states))
        s = p.states[i]
        p.states[i] = replace(s, shape=tuple(rng.choice([0, 1, 3, HUGE]) for _ in s.shape),
                              dtype=rng.choice(list(DType)))


MUTATIONS: list[Callable[[Program, random.Random, dict], None]] = [
    m_value_dim, m_value_dim, m_value_rank, m_value_dtype, m_node_input, m_node_output, m_node_inputs_count, m_op,
    m_attr_value, m_attr_value, m_attr_type, m_attr_drop_or_add, m_node_order, m_node_drop_or_repeat, m_free_after,
    m_symbol, m_signature, m_state_update, m_constant, m_blob, m_state,
]


def mutant(seed: Seed, rng: random.Random) -> bytes | None:
    """One mutant of seed: one to three field edits (re-encoded), or a byte-level edit under fresh checksums.
    None when the edit made something the encoder cannot write at all (not a file anyone could hold)."""
    raw = encode(seed.program, seed.data)
    if rng.random() < 0.15:
        return byte_mutant(raw, rng)
    program = copy.deepcopy(seed.program)
    kinds: dict = {}
    for _ in range(rng.choice([1, 1, 2, 3])):
        rng.choice(MUTATIONS)(program, rng, kinds)
    try:
        return encode(program, seed.data, kinds)
    except (TypeError, ValueError, OverflowError, KeyError, AttributeError, Exception):  # noqa: BLE001
        return None


def byte_mutant(raw: bytes, rng: random.Random) -> bytes:
    """Flip, insert or delete bytes of the metadata and recompute both checksums; or truncate anywhere."""
    h = Header.unpack(raw)[1]
    if rng.random() < 0.25:
        return raw[:rng.randrange(len(raw))]
    meta = bytearray(raw[h.meta_offset:h.meta_offset + h.meta_size])
    for _ in range(rng.choice([1, 2, 4])):
        at = rng.randrange(len(meta))
        choice = rng.random()
        if choice < 0.6:
            meta[at] ^= 1 << rng.randrange(8)
        elif choice < 0.8:
            meta[at:at + 4] = rng.choice([b"\xff\xff\xff\x7f", b"\0\0\0\0", b"\xff\xff\xff\xff"])
        else:
            meta[at] = rng.randrange(256)
    const = raw[h.const_offset:]
    const_offset = -(-(HEADER_SIZE + len(meta)) // ALIGNMENT) * ALIGNMENT
    head = Header(h.format_version, h.opset_version, HEADER_SIZE, len(meta), const_offset, len(const),
                  const_offset + len(const), zlib.crc32(bytes(meta)), zlib.crc32(const))
    return head.pack() + bytes(meta) + b"\0" * (const_offset - HEADER_SIZE - len(meta)) + const


# ---- the judge ----

@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise Escape(f"hang: more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def inputs_for(program: kiln.Program, method: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Inputs within the method's symbols' bounds: each symbol at its minimum (at least 1 where allowed);
    floats random, integers zero (a valid index and position), bools true."""
    info = program.info(method)
    env = {s.name: max(s.min, min(1, s.max) if s.max != UNBOUNDED else 1) for s in info.symbols}
    out = []
    for v in info.inputs:
        shape = tuple(d if isinstance(d, int) else env.get(d, 1) for d in v.shape)
        dtype = v.dtype.numpy
        if v.dtype.is_float:
            out.append(rng.standard_normal(shape).astype(dtype))
        elif v.dtype == DType.bool:
            out.append(np.ones(shape, dtype))
        else:
            out.append(np.zeros(shape, dtype))
    return out


CAP_BYTES = 1 << 30
"""The verifier's byte cap while judging (KILN_MAX_BUFFER_BYTES): a value it lets through that then cannot be
allocated is an escape, not the machine's limit."""


@contextmanager
def buffer_cap(cap: int) -> Iterator[None]:
    previous = os.environ.get("KILN_MAX_BUFFER_BYTES")
    os.environ["KILN_MAX_BUFFER_BYTES"] = str(cap)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["KILN_MAX_BUFFER_BYTES"]
        else:
            os.environ["KILN_MAX_BUFFER_BYTES"] = previous


def judge(raw: bytes, backend: str = "cpu") -> str:
    """'rejected', 'ran' or 'input-error'; raises Escape for anything else."""
    try:
        with time_limit(HANG_S), buffer_cap(CAP_BYTES):
            try:
                program = kiln.load(raw)
            except ProgramFormatError:
                return "rejected"
            rng = np.random.default_rng(0)
            outcome = "ran"
            for method in program.methods:
                try:
                    program.session(backend).run(method, *inputs_for(program, method, rng))
                except InputError:
                    outcome = "input-error"
            return outcome
    except Escape:
        raise
    except MemoryError as e:
        raise Escape(f"allocation failed: {e}") from e
    except Exception as e:  # noqa: BLE001 - any other exception is what the fuzzer hunts
        raise Escape(f"{type(e).__name__}: {e}") from e
