"""ProgramBuilder: collects methods, constants (deduplicated by content) and state buffers; writes the file."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kiln.export.lower.registry import kiln_dtype
from kiln.format import ALIGNMENT
from kiln.format.writer import layout_blobs, write_program
from kiln.ir import ops
from kiln.ir.graph import Blob, Constant, Method, Program, StateBuffer, ValueKind
from kiln.ir.verify import TRACED_MIN, tighten_traced_bounds

if TYPE_CHECKING:
    from kiln.runtime.program import Program as LoadedProgram


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor as a uint8 NumPy array sharing its memory (works for bfloat16 and bool too)."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)


log = logging.getLogger("kiln.export")


def _memory_key(t: torch.Tensor) -> tuple | None:
    """Where a contiguous CPU tensor's bytes are and which write they are at (its version counter), or None for
    any other tensor. The builder keeps the key only for a tensor whose memory became a blob (tensor_bytes shares
    it) and holds the tensor with it, so no other tensor can be allocated there while the key lives."""
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or not t.is_contiguous()
            or t.numel() == 0 or t.is_inference()):
        return None  # (a subclass's storage may not be its bytes; an inference tensor has no version counter)
    return (t.data_ptr(), tuple(t.shape), t.dtype, t._version)


HASH_CHUNK_BYTES = 1 << 24
"""A constant of more than twice this many bytes is hashed in chunks of this size on every core (content_digest)."""


def content_digest(data: np.ndarray) -> bytes:
    """A key for a constant's bytes (equal bytes, equal key): their BLAKE2b and length, or for a large constant the
    BLAKE2b of its chunks' digests, computed on threads (hashlib lets go of the interpreter lock for large buffers).
    One thread hashed an 8B model's 16 GB at ~1 GB/s, a quarter of an int4 export's time once its weights were
    quantized once."""
    view = memoryview(data).cast("B")
    if len(view) <= 2 * HASH_CHUNK_BYTES:
        return hashlib.blake2b(view, digest_size=20).digest() + len(view).to_bytes(8, "little")
    starts = range(0, len(view), HASH_CHUNK_BYTES)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        parts = pool.map(lambda s: hashlib.blake2b(view[s:s + HASH_CHUNK_BYTES], digest_size=20).digest(), starts)
        tree = hashlib.blake2b(b"".join(parts), digest_size=20, person=b"kiln-chunks").digest()
    return tree + len(view).to_bytes(8, "little")


class ProgramBuilder:
    """A program being exported. `kiln.export(...)` returns one; `.save(path)` writes the .kiln file."""

    def __init__(self) -> None:
        self.methods: dict[str, Method] = {}
        self.constants: list[Constant] = []
        self.states: list[StateBuffer] = []
        self.metadata: dict[str, str] = {}
        self._blob_data: list[np.ndarray] = []
        self._blob_index: dict[bytes, int] = {}
        self._blob_of_memory: dict[tuple, tuple[int, torch.Tensor]] = {}  # _memory_key -> (blob, tensor held)
        self._constant_index: dict[tuple, int] = {}
        self._state_index: dict[str, int] = {}
        self.derived: dict[tuple, Any] = {}
        """What graph passes computed from constants, by what it was computed from (the pass's key: its name and
        the source constants' indices): a program's methods read the same weights (an LLM's prefill and decode),
        and the second method's passes take the first's stacked and quantized constants from here instead of
        computing them again (an 8B int4 export quantized every weight twice)."""
        self.source_ops: Counter[str] = Counter()
        """How many nodes of each ATen op the methods lowered (coverage statistics, `kiln export` summaries)."""

    # ---- contents ----
    def constant(self, tensor: torch.Tensor, name: str) -> int:
        """Index of a constant with this tensor's contents; equal bytes are stored once (a tied LM head).

        A tensor whose memory was hashed before (every method of an LLM reads the same weights; a model may share
        a layer's weights between layers) is not hashed again: a Qwen3-30B-A3B-shaped export of 6 layers sharing one
        layer's weights spent 25.3 s here on a 2-core Xeon (of 48 s), and spends 5.4 s."""
        memo = _memory_key(tensor)
        known = self._blob_of_memory.get(memo) if memo is not None else None
        if known is not None:
            blob = known[0]
        else:
            data = tensor_bytes(tensor)
            digest = content_digest(data)
            blob = self._blob_index.get(digest)
            if blob is None:
                blob = self._blob_index[digest] = len(self._blob_data)
                self._blob_data.append(data)
                if memo is not None:  # (held, at no cost: its memory is the blob's, and no other can take it)
                    self._blob_of_memory[memo] = (blob, tensor)
        key = (blob, kiln_dtype(tensor.dtype), tuple(tensor.shape))
        index = self._constant_index.get(key)
        if index is None:
            index = self._constant_index[key] = len(self.constants)
            self.constants.append(Constant(name, key[1], key[2], blob))
        return index

    def constant_array(self, index: int) -> np.ndarray:
        """A constant's contents as a read-only NumPy array (for passes that compute new constants from old)."""
        c = self.constants[index]
        return np.frombuffer(self._blob_data[c.blob], dtype=c.dtype.numpy).reshape(c.shape)

    def state(self, name: str, tensor: torch.Tensor) -> int:
        """Index of the state buffer called `name`, created on first use with `tensor` as its initial value."""
        index = self._state_index.get(name)
        if index is None:
            t = tensor.detach()
            init = -1 if not bool(torch.any(t != 0)) else self.constant(t, f"{name}.init")
            index = self._state_index[name] = len(self.states)
            self.states.append(StateBuffer(name, kiln_dtype(t.dtype), tuple(int(d) for d in t.shape), init))
        return index

    def add_method(self, method: Method) -> None:
        if method.name in self.methods:
            raise ValueError(f"method {method.name!r} added twice")
        self.methods[method.name] = method

    # ---- output ----
    def build(self) -> tuple[Program, list[np.ndarray]]:
        """The program with only the constants its methods use, and the bytes of its blobs."""
        used = sorted({v.ref for m in self.methods.values() for v in m.values if v.kind == ValueKind.CONSTANT}
                      | {s.init for s in self.states if s.init >= 0})
        const_map = {old: new for new, old in enumerate(used)}
        blobs_used = sorted({self.constants[i].blob for i in used})
        blob_map = {old: new for new, old in enumerate(blobs_used)}
        data = [self._blob_data[b] for b in blobs_used]
        offsets = layout_blobs([d.nbytes for d in data])
        constants = [Constant(c.name, c.dtype, c.shape, blob_map[c.blob]) for c in (self.constants[i] for i in used)]
        states = [StateBuffer(s.name, s.dtype, s.shape, const_map[s.init] if s.init >= 0 else -1)
                  for s in self.states]
        methods = {}
        for name, m in self.methods.items():
            values = [type(v)(v.name, v.dtype, v.shape, v.kind, const_map[v.ref] if v.kind == ValueKind.CONSTANT
                              else v.ref) for v in m.values]
            methods[name] = Method(m.name, values, m.inputs, m.outputs, m.nodes, m.symbols, m.state_updates)
        blobs = [Blob(off, d.nbytes) for off, d in zip(offsets, data)]
        assert all(b.offset % ALIGNMENT == 0 for b in blobs)
        program = Program(ops.OPSET_VERSION, methods, constants, blobs, states, dict(self.metadata))
        raised = tighten_traced_bounds(program)
        if raised:
            log.warning("torch.export traced %s for sizes of at least %d (the graph is wrong below that, though "
                        "torch's range starts lower); the program accepts sizes from %d", ", ".join(raised),
                        TRACED_MIN, TRACED_MIN)
        return program, data

    def save(self, path: str | os.PathLike) -> Path:
        """Write the .kiln file (atomically) and return its path."""
        program, data = self.build()
        write_program(program, data, path)
        return Path(path)

    def to_bytes(self) -> bytes:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "program.kiln"
            self.save(path)
            return path.read_bytes()

    def load(self, **options: Any) -> LoadedProgram:
        """Serialize and load back with the runtime: what a user of the file gets."""
        from kiln.runtime import load

        return load(self.to_bytes(), **options)

    def summary(self) -> str:
        nodes = sum(len(m.nodes) for m in self.methods.values())
        size = sum(d.nbytes for d in self._blob_data)
        return (f"{len(self.methods)} method(s), {nodes} nodes, {len(self.constants)} constants "
                f"({size / 1e6:.1f} MB), {len(self.states)} state buffer(s)")
