"""A program's large constants held in memory backed by huge pages, once per program, for the CPU backend.

Why: a decode step reads every weight once, so its speed is the bandwidth one core gets from DRAM. The constants
of a loaded program are views of the memory-mapped file, in the page cache's 4 KiB pages: the core's prefetchers
stop at every page boundary and each page costs a TLB miss. Measured on this project's 2-core AMD EPYC (Linux,
transparent huge pages in `madvise` mode): one core sums 540 MB at 23.5-24.2 GB/s in 4 KiB pages and 28.9-29.7
GB/s in 2 MiB pages; SmolLM2-135M's float32 decode step 24.0-24.4 -> 21.3 ms (docs/benchmarks.md).

How: one private anonymous mapping for every constant of at least MIN_BYTES, advised MADV_HUGEPAGE and aligned to
2 MiB, where the kernel offers transparent huge pages; each blob is copied into its place from the program's
(checksummed) mapping the first time a kernel asks for one of its constants. Untouched parts of the mapping cost
no memory. Elsewhere (no MADV_HUGEPAGE, THP off, KILN_HUGE_PAGES=0) constants stay views of the
file: a copy into small pages would buy nothing.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from kiln.ir.graph import Method, Node
from kiln.runtime.backends.base import absent, constant_ref
from kiln.runtime.program import Program

MIN_BYTES = 256 << 10
"""Smaller constants stay views of the file: they are read from cache, not streamed from DRAM."""
HUGE_PAGE = 2 << 20
ALIGN = 64
CACHE_KEY = "cpu-resident"


@functools.cache
def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages (Linux with THP in `always` or `madvise` mode),
    and KILN_HUGE_PAGES is not 0."""
    if os.environ.get("KILN_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


class ResidentConstants:
    """Blobs of one program copied into a huge-page mapping on first use (thread-safe)."""

    def __init__(self, program: Program):
        self.program = program
        blobs = program.ir.blobs
        self.slots: dict[int, int] = {}
        offset = 0
        for index in sorted({c.blob for c in program.ir.constants}):
            if blobs[index].nbytes >= MIN_BYTES:
                self.slots[index] = offset
                offset += -(-blobs[index].nbytes // ALIGN) * ALIGN
        self.arrays: dict[int, np.ndarray] = {}
        self.filled: set[int] = set()
        self.lock = threading.Lock()
        self.base: np.ndarray | None = None
        if self.slots:
            self.map = mmap.mmap(-1, offset + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.map.madvise(mmap.MADV_HUGEPAGE)
            whole = np.frombuffer(self.map, np.uint8)
            start = -whole.ctypes.data % HUGE_PAGE
            self.base = whole[start:start + offset]

    def constant(self, index: int) -> np.ndarray:
        array = self.arrays.get(index)
        if array is not None:
            return array
        c = self.program.ir.constants[index]
        slot = self.slots.get(c.blob)
        if slot is None or self.base is None:
            return self.program.constant(index)
        with self.lock:
            array = self.arrays.get(index)
            if array is None:
                blob = self.program.ir.blobs[c.blob]
                place = self.base[slot:slot + blob.nbytes]
                if c.blob not in self.filled:
                    place.view(c.dtype.numpy)[:blob.nbytes // c.dtype.itemsize].reshape(c.shape)[...] = \
                        self.program.constant(index)
                    self.program.release_constant_pages(index)
                    self.filled.add(c.blob)
                array = place.view(c.dtype.numpy)[:blob.nbytes // c.dtype.itemsize].reshape(c.shape)
                array.flags.writeable = False
                self.arrays[index] = array
        return array


def constant(program: Program, index: int) -> np.ndarray:
    """The constant for the CPU backend's kernels: in huge pages where available, else the file's view."""
    resident = program.backend_cache.get(CACHE_KEY)
    if resident is None:
        if not huge_pages_available():
            return program.constant(index)
        resident = program.backend_cache.setdefault(CACHE_KEY, ResidentConstants(program))
    return resident.constant(index)


LANES_KEY = "cpu-lanes"
ARENA_BYTES = 32 << 20
"""Packed forms are placed in arenas of this size (or one of their own, if larger): whole huge pages, not one
partial page per weight."""


class PackedForms:
    """A program's quantized weights in the lanes form (native.pack_lanes: qdot.c's layout of 4 rows a pass, one
    block a lane, each pass's scales and zero points beside its codes), made once per program from the file's own
    pages, which are then released: the stored layout is not also copied into memory (ResidentConstants), so the
    process holds the weights once."""

    def __init__(self) -> None:
        self.forms: dict[tuple, np.ndarray] = {}
        self.lock = threading.Lock()
        self.arenas: list[mmap.mmap] = []
        self.free: np.ndarray = np.empty(0, np.uint8)

    def place(self, nbytes: int) -> np.ndarray:
        """nbytes of arena memory, 64-byte aligned (the caller holds the lock)."""
        nbytes = -(-nbytes // ALIGN) * ALIGN
        if self.free.nbytes < nbytes:
            size = max(ARENA_BYTES, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
            arena = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge_pages_available():
                arena.madvise(mmap.MADV_HUGEPAGE)
            self.arenas.append(arena)
            whole = np.frombuffer(arena, np.uint8)
            start = -whole.ctypes.data % HUGE_PAGE
            self.free = whole[start:start + size]
        placed, self.free = self.free[:nbytes], self.free[nbytes:]
        return placed


def node_lanes(program: Program, method: Method, node: Node, first: int) -> tuple[np.ndarray, int, int, int] | None:
    """(the lanes form, n, k, group) of a quantized node's weight (q at input `first`, then scale and zero) where
    they are program constants the form takes (packed_lanes), else None: what the prepared kernels and the native
    executor both run."""
    refs = [constant_ref(method, node, first + i) for i in range(3)]
    if refs[0] is None or refs[1] is None or (refs[2] is None and not absent(node, first + 2)):
        return None
    bits = int(node.attrs["bits"])
    packed = packed_lanes(program, *refs, bits, bool(node.attrs.get("offset", False)))
    if packed is None:
        return None
    (n, width), groups = program.ir.constants[refs[0]].shape, program.ir.constants[refs[1]].shape[1]
    k = width * 8 // bits
    return packed, n, k, k // groups


def packed_lanes(program: Program, q_ref: int, scale_ref: int, zero_ref: int | None, bits: int,
                 offset: bool) -> np.ndarray | None:
    """The lanes form of program constants q (int4: uint8 [n, k / 2]; int8: int8 [n, k]), scale and zero (float32
    [n, k / group]; zero absent: None), made once per program; None where the helpers have no such form for them
    (native.lanes_bytes; int8 only symmetric)."""
    from kiln.runtime.backends.cpu import native, quant

    constants = program.ir.constants
    q, scale = constants[q_ref], constants[scale_ref]
    stored = {4: np.uint8, 8: np.int8}.get(bits)
    if len(q.shape) != 2 or q.dtype.numpy != stored or scale.dtype.numpy != np.float32 or \
            (zero_ref is not None and constants[zero_ref].dtype.numpy != np.float32):
        return None
    n, k = q.shape[0], q.shape[1] * 8 // bits
    if len(scale.shape) != 2 or scale.shape[0] != n or not scale.shape[1] or k % scale.shape[1] or \
            not quant.lanes_form(bits, k // scale.shape[1], n, k, zero_ref is not None, offset):
        return None
    nbytes = native.lanes_bytes(n, k, k // scale.shape[1], bits)
    forms = program.backend_cache.setdefault(LANES_KEY, PackedForms())
    key = (q_ref, scale_ref, zero_ref, bits, offset)
    with forms.lock:
        form = forms.forms.get(key)
        if form is None:
            form = forms.place(nbytes)
            refs = [r for r in (q_ref, scale_ref, zero_ref) if r is not None]
            native.pack_lanes(*(program.constant(r) for r in (q_ref, scale_ref)),
                              None if zero_ref is None else program.constant(zero_ref), bits, offset, form)
            form.flags.writeable = False
            for ref in refs:
                program.release_constant_pages(ref)
            forms.forms[key] = form
    return form
