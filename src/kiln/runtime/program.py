"""A loaded program: the validated graph, the memory-mapped file, and constants wrapped without copying."""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.errors import ProgramFormatError
from kiln.format.reader import read_program
from kiln.ir.graph import Method, Value
from kiln.ir.symbolic import Symbol

if TYPE_CHECKING:
    from kiln.runtime.session import Session


@dataclass(frozen=True)
class MethodInfo:
    """What a caller needs to know about a method: its input and output specs and its symbols."""

    name: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    symbols: tuple[Symbol, ...]
    num_nodes: int

    def describe(self) -> str:
        ins = ", ".join(v.spec() for v in self.inputs)
        outs = ", ".join(v.spec() for v in self.outputs)
        syms = "; ".join(s.describe() for s in self.symbols)
        return f"{self.name}({ins}) -> ({outs})" + (f"  where {syms}" if syms else "")


class Program:
    """A validated .kiln program. Immutable and shared: every session of it reads the same constants."""

    def __init__(self, buffer: Any, path: str | None = None, verify_checksums: bool = True):
        self.path = path
        self._buffer = buffer
        self.ir, self.header = read_program(buffer, verify_checksums=verify_checksums)
        self._constants: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.backend_cache: dict[str, Any] = {}
        """Per-backend data shared by all sessions (e.g. constants uploaded to a GPU once)."""

    @property
    def methods(self) -> list[str]:
        return list(self.ir.methods)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.ir.metadata)

    def method(self, name: str) -> Method:
        try:
            return self.ir.methods[name]
        except KeyError:
            from kiln.errors import InputError
            raise InputError(f"program has no method {name!r}; its methods are {self.methods}") from None

    def info(self, name: str) -> MethodInfo:
        m = self.method(name)
        return MethodInfo(name, tuple(m.input_specs()), tuple(m.output_specs()), tuple(m.symbols), len(m.nodes))

    def constant(self, index: int) -> np.ndarray:
        """The constant as a read-only NumPy array over the mapped file (no copy)."""
        arr = self._constants.get(index)
        if arr is None:
            c = self.ir.constants[index]
            blob = self.ir.blobs[c.blob]
            count = blob.nbytes // c.dtype.itemsize
            arr = np.frombuffer(self._buffer, dtype=c.dtype.numpy, count=count,
                                offset=self.header.const_offset + blob.offset).reshape(c.shape)
            with self._lock:
                arr = self._constants.setdefault(index, arr)
        return arr

    def release_constant_pages(self, index: int) -> None:
        """Unmap the file pages under constant `index` from this process (they stay in the OS's page cache, and a
        later read maps them again): for a backend that holds its own copy, so the process is not charged twice."""
        if not isinstance(self._buffer, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        blob = self.ir.blobs[self.ir.constants[index].blob]
        start = self.header.const_offset + blob.offset
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (start + blob.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._buffer.madvise(mmap.MADV_DONTNEED, first, last - first)

    @property
    def constant_bytes(self) -> int:
        return sum(b.nbytes for b in self.ir.blobs)

    def session(self, backend: str = "cpu", **options: Any) -> Session:
        """A new independent session (its own state buffers and plans) on `backend`."""
        from kiln.runtime.session import Session

        return Session(self, backend, **options)


def load(source: str | os.PathLike | bytes | bytearray | memoryview, verify_checksums: bool = True) -> Program:
    """Load a .kiln program from a path (memory-mapped) or from bytes.

    verify_checksums: check the CRC-32 of the constant segment (one pass over the weights). The metadata is always
    checked; turn this off only for trusted files where load time matters.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return Program(bytes(source), None, verify_checksums)
    path = os.fspath(source)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ProgramFormatError(f"{path}: empty file, not a .kiln program")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except IsADirectoryError:
        raise ProgramFormatError(f"{path} is a directory, not a .kiln file") from None
    try:
        return Program(buffer, path, verify_checksums)
    except ProgramFormatError as e:
        raise ProgramFormatError(f"{path}: {e}") from None
