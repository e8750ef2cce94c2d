"""A timeline of kiln's kernels as a CUDA graph replays them: where a decode step's time goes, kernel by kernel.

A profiler (ncu) runs each kernel alone and cold: it cannot see what a graph replay with early launches (launch.py)
is, kernels overlapping their neighbours, weights warm in L2. With KILN_CUDA_TIMELINE=1 every kernel of kiln's
sources is compiled to record, in block (0, 0, 0), two %globaltimer readings (nanoseconds, one clock for the whole
GPU): when the block started, and when its grid_dependency_sync let it go on (the kernel before it had finished).
The records go to one buffer, in the order the kernels were let go, which in a stream is the order they were
launched; the host keeps the names of the launches in the same order, so record i is launch i of a window.

A kernel's span, from its release to the next kernel's release, is what it adds to the step: its work, its slowest
block, the flush of its writes and the hand-over. Kernels of CuPy and cuBLAS record nothing; their time falls in
the span of the kiln kernel before them. Recording costs thread 0 of block 0 one atomic round trip per kernel,
so compare a timeline's step with the same step timed without the switch.

Use: `window = timeline.Window()` before the launches to time (or the capture of a graph), `window.close()` after;
`timeline.reset()` before a replay, and after it (synchronized) `window.spans()`.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np

ENABLED = os.environ.get("KILN_CUDA_TIMELINE", "0") == "1"
DEFINE = "-DKILN_TIMELINE"
"""The NVRTC option that compiles the recording in (common.cuh); part of the kernel cache's key."""

CAPACITY = 1 << 14
"""Records the buffer holds; a kernel past it records nothing (the count still goes up, so reading says so)."""

_FIELDS = 4  # u64s per record: started, released, grid (x | y << 21 | z << 42), block (x | y << 21 | z << 42)

_launches: list[tuple[str, tuple[int, int, int], tuple[int, int, int]]] = []
_open: set[int] = set()  # ids of the windows not yet closed
_buffer: Any = None


def _packed(dims: tuple[int, int, int]) -> int:
    return dims[0] | dims[1] << 21 | dims[2] << 42


def buffer() -> Any:
    """The device buffer every module's `kiln_timeline` points to: [count, capacity, records...]."""
    global _buffer
    if _buffer is None:
        _buffer = cp.zeros(2 + _FIELDS * CAPACITY, dtype=np.uint64)
        _buffer[1] = CAPACITY
    return _buffer


def attach(module: Any) -> None:
    """Points a freshly compiled module's `kiln_timeline` at the shared buffer."""
    address = ctypes.c_uint64(buffer().data.ptr)
    module.get_global("kiln_timeline").copy_from_host(ctypes.addressof(address), 8)


def launched(name: str, grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    """launch.Kernel tells of each launch (captured ones too), in order; kept while a window is open."""
    if _open:
        _launches.append((name, grid, block))


def reset() -> None:
    """Empties the buffer (a stream-ordered write: call it before the launches or the replay to time)."""
    buffer()[0] = 0


@dataclass(frozen=True)
class Span:
    """One kernel of a window: when its block 0 started and was let go (ns, relative to the first release), and
    its span: from its release to the next kernel's (None for the last)."""
    name: str
    grid: tuple[int, int, int]
    started_ns: int
    released_ns: int
    span_ns: int | None


class Window:
    """The kiln kernels launched (or captured) between its creation and close(): what the records are paired with."""

    def __init__(self) -> None:
        if not ENABLED:
            raise RuntimeError("the kernel timeline needs KILN_CUDA_TIMELINE=1 before kiln's kernels are compiled")
        self.first, self.last = len(_launches), None
        _open.add(id(self))

    def close(self) -> Window:
        self.last = len(_launches)
        _open.discard(id(self))
        return self

    def spans(self) -> list[Span]:
        """The window's kernels as the last run since reset() ran them; the GPU must be synchronized."""
        if self.last is None:
            raise RuntimeError("close() the window before reading its spans")
        launches = _launches[self.first:self.last]
        data = cp.asnumpy(buffer()[:2 + _FIELDS * len(launches)])  # the count and the window's records
        count = int(data[0])
        if count != len(launches):
            raise RuntimeError(f"{count} kernels recorded, {len(launches)} launched in the window: time one run of "
                               f"exactly the window's launches after reset()")
        if count > CAPACITY:
            raise RuntimeError(f"{count} kernels, the buffer holds {CAPACITY}")
        records = data[2:2 + _FIELDS * count].reshape(count, _FIELDS).astype(np.int64)
        origin = int(records[0, 1])
        out = []
        for i, ((name, grid, block), (started, released, g, b)) in enumerate(zip(launches, records, strict=True)):
            if (int(g), int(b)) != (_packed(grid), _packed(block)):
                raise RuntimeError(f"record {i} is of a kernel with another grid or block than launch {i} ({name}): "
                                   "the kernels did not record in launch order")
            following = int(records[i + 1, 1]) - int(released) if i + 1 < count else None
            out.append(Span(name, grid, int(started) - origin, int(released) - origin, following))
        return out
