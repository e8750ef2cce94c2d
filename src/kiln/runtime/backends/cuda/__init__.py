"""The CUDA backend: a program's ops on an NVIDIA GPU through CuPy (cuBLAS for the matrix products).

Constants are uploaded once per program, on first use, and shared by every CUDA session of that program
(constants.py). Inputs may be NumPy or CuPy arrays; outputs are CuPy arrays (`backend.to_numpy` or `.get()`
copies them back). Every op runs on the GPU (kiln.runtime.backends.cuda.kernels: the GPU's own kernels, and the
portable kernels bound to CuPy); an op whose CUDA kernel declines its arguments (OnHost: a dtype with no atomic
form, say) runs its CPU kernel on a host copy of its inputs and uploads the result, so any program runs,
correctly.
`backend.host_ops` lists the ops of this session that ran on the host, and a warning names them once per
session: a GPU program that copies to the host is slow, and cannot be captured as a graph.

Importing this module needs CuPy; kiln.runtime.backends imports it only when a session asks for "cuda".
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.errors import BackendUnavailableError
from kiln.ir.graph import StateBuffer
from kiln.runtime.backends.base import Backend, Kernel
from kiln.runtime.backends.cuda import constants, zeroed
from kiln.runtime.graphs import CaptureError
from kiln.runtime.program import Program

log = logging.getLogger("kiln.runtime.cuda")

ARGMAX_THREADS = 1024  # threads of kernels/argmax.cu's block per row (its ARGMAX_THREADS)
_STAGING: deque = deque()  # (event after an upload's copy, its pinned staging array): kept until the copy ran


def _cupy() -> Any:
    """CuPy, once a GPU is known to be there; otherwise a BackendUnavailableError that says what is missing."""
    try:
        import cupy
    except ImportError:
        raise BackendUnavailableError("the cuda backend needs CuPy: `pip install cupy-cuda12x` (or cupy-cuda13x "
                                      "to match the CUDA driver); the cpu backend needs nothing") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CuPy raises its own error types for a missing driver
        raise BackendUnavailableError(f"the cuda backend found no usable NVIDIA GPU ({type(e).__name__}: {e}); "
                                      "use backend='cpu'") from None
    if count == 0:
        raise BackendUnavailableError("the cuda backend found no NVIDIA GPU; use backend='cpu'")
    return cupy


class CUDABackend(Backend):
    name = "cuda"
    can_capture = True
    samples_on_device = True  # kernels/argmax.cu's sample_rows (Gumbel-max), measured: docs/benchmarks.md
    attends_rows_in_place = True  # decode.cu reads each row's slot in place (kernels/attention.py)
    graphs_by_default = os.environ.get("KILN_CUDA_GRAPHS", "1") != "0"

    def __init__(self, program: Program):
        self.cp = _cupy()
        from kiln.runtime.backends.cpu.registry import CPU_KERNELS
        from kiln.runtime.backends.cuda.kernels import CUDA_KERNELS

        self.program = program
        self.host_ops: set[str] = set()
        self.kernels = {op: self._on_host(op, fn) for op, fn in CPU_KERNELS.kernels.items()}
        for op, fn in CUDA_KERNELS.kernels.items():
            self.kernels[op] = self._first_on_gpu(fn, self.kernels[op]) if op in self.kernels else fn
        self._capture_stream: Any = None

    def constant(self, index: int) -> Any:
        return constants.constant(self.program, index, self.cp)

    def initial_state(self, index: int, buffer: StateBuffer) -> Any:
        if buffer.init >= 0:
            return self.cp.array(self.constant(buffer.init), copy=True)
        return self.cp.zeros(buffer.shape, dtype=buffer.dtype.numpy)

    def asarray(self, x: Any) -> Any:
        return x if isinstance(x, self.cp.ndarray) else self.cp.asarray(np.asarray(x))

    def to_numpy(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(x)

    def argmax_rows(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(self.argmax_rows_here(x))

    def argmax_rows_here(self, x: Any) -> Any:
        """kernels/argmax.cu over contiguous float rows (one pass in their own type, a block per row); CuPy's
        argmax (which takes float32 and wider) otherwise."""
        from kiln.runtime.backends.cuda import nvrtc

        cp = self.cp
        rows = x.reshape(x.shape[0], -1)
        if rows.size and rows.flags.c_contiguous and nvrtc.supports(rows):
            out = cp.empty(rows.shape[0], dtype=cp.int64)
            nvrtc.function("argmax", "argmax_rows", rows.dtype)((rows.shape[0],), (ARGMAX_THREADS,),
                                                                (rows, out, np.int64(rows.shape[1])))
            return out
        if rows.dtype.kind != "f" or rows.dtype.itemsize < 4:  # CuPy's reductions take float32 and wider
            rows = rows.astype(cp.float32)
        return cp.argmax(rows, axis=1).astype(cp.int64, copy=False)

    def sample_rows_here(self, x: Any, inv_temperature: np.ndarray, seeds: np.ndarray, counters: np.ndarray) -> Any:
        """kernels/argmax.cu's sample_rows, a block per row (contiguous rows of a kernel type)."""
        from kiln.runtime.backends.cuda import nvrtc

        cp = self.cp
        rows = cp.ascontiguousarray(x.reshape(x.shape[0], -1))
        if not nvrtc.supports(rows):
            rows = rows.astype(cp.float32)
        out = cp.empty(rows.shape[0], dtype=cp.int64)
        if rows.size:
            nvrtc.function("argmax", "sample_rows", rows.dtype)(
                (rows.shape[0],), (ARGMAX_THREADS,),
                (rows, out, np.int64(rows.shape[1]), self.upload(np.asarray(inv_temperature, np.float32)),
                 self.upload(np.asarray(seeds, np.uint64)), self.upload(np.asarray(counters, np.int64))))
        return out

    def upload(self, x: np.ndarray) -> Any:
        """Through a pinned staging array, an asynchronous copy on the current stream: a copy from pageable
        memory waits for the stream's queued work first. The staging array stays referenced (_STAGING) until an
        event after the copy has passed."""
        cp = self.cp
        import cupyx

        staging = cupyx.empty_pinned(x.shape, dtype=x.dtype)
        staging[...] = x
        out = cp.empty(x.shape, dtype=x.dtype)
        out.set(staging, stream=cp.cuda.get_current_stream())
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record()
        _STAGING.append((event, staging))  # freed once the copy has run
        while _STAGING and _STAGING[0][0].done:
            _STAGING.popleft()
        return out

    def fetch(self, x: Any) -> Callable[[], np.ndarray]:
        """An asynchronous copy into pinned memory and an event after it: waiting for the event waits for x's
        kernels and the copy, not for the work queued after them (the next step)."""
        cp = self.cp
        import cupyx

        pinned = cupyx.empty_pinned(x.shape, dtype=x.dtype)
        x.get(stream=cp.cuda.get_current_stream(), out=pinned, blocking=False)
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record()

        def wait() -> np.ndarray:
            event.synchronize()
            return np.array(pinned)

        return wait

    def put_rows(self, target: Any, rows: np.ndarray, source: Any, picks: np.ndarray) -> Any:
        target[self.upload(rows.astype(np.int64))] = source[self.upload(picks.astype(np.int64))]
        return target

    def empty_like(self, x: Any) -> Any:
        return self.cp.empty(x.shape, dtype=x.dtype)

    def copy_into(self, target: Any, source: Any) -> None:
        if isinstance(source, self.cp.ndarray):
            self.cp.copyto(target, source)
        else:
            target.set(np.ascontiguousarray(source, dtype=target.dtype))

    def capture(self, body: Callable[[], list[Any]]) -> tuple[Any, list[Any]]:
        """body's kernels recorded as a CUDA graph on a side stream (capture needs a stream other than the default).

        The side stream is non-blocking: a blocking one is implicitly ordered with the legacy default stream, so
        another thread's session launching there while this one captures would invalidate the capture (CUDA error
        906, found by the sessions-on-threads tests).

        Everything body allocates comes from a memory pool of the graph's own, which the returned graph keeps: the
        replays write those addresses, so no other array may be given that memory while the graph lives. Scratch
        that must read zero at the first replay (cuda/zeroed.py) is zeroed once, after the capture, and kept.
        """
        cp = self.cp
        if self._capture_stream is None:
            self._capture_stream = cp.cuda.Stream(non_blocking=True)
        stream, pool = self._capture_stream, cp.cuda.MemoryPool()
        cp.cuda.get_current_stream().synchronize()
        zeroed.take_pending()
        with cp.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                outputs = body()
            except Exception as e:
                zeroed.take_pending()
                try:
                    stream.end_capture()
                except Exception:  # noqa: BLE001 - the capture is already invalid; the first error says why
                    pass
                raise CaptureError(f"{type(e).__name__}: {e}") from e
            graph = stream.end_capture()
            scratch = zeroed.take_pending()
            for array in scratch:  # (zero before the first replay: cuda/zeroed.py)
                array.fill(0)
            stream.synchronize()
        return _Graph(graph, pool, scratch), outputs

    @staticmethod
    def _first_on_gpu(fn: Kernel, on_host: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, or the host path when it raises OnHost for these arguments."""
        from kiln.runtime.backends.cuda.kernels import OnHost

        def run(*args: Any, **attrs: Any) -> Any:
            try:
                return fn(*args, **attrs)
            except OnHost:
                return on_host(*args, **attrs)

        run.__name__ = fn.__name__
        return run

    def _on_host(self, op: str, fn: Kernel) -> Callable[..., Any]:
        """`fn` (the CPU kernel) on host copies of the arguments, its results uploaded."""
        cp = self.cp

        def run(*args: Any, **attrs: Any) -> Any:
            if op not in self.host_ops:
                self.host_ops.add(op)
                log.warning("cuda backend: op %r runs on the host for these arguments (copies both ways)", op)
            out = fn(*[cp.asnumpy(a) if isinstance(a, cp.ndarray) else a for a in args], **attrs)
            if isinstance(out, (tuple, list)):
                return type(out)(cp.asarray(np.asarray(o)) for o in out)
            return cp.asarray(np.asarray(out))

        run.__name__ = f"{op}_on_host"
        return run


class _Graph:
    """A captured CUDA graph and the memory its kernels address: its pool and its zeroed scratch (cuda/zeroed.py)."""

    def __init__(self, graph: Any, pool: Any, scratch: list[Any]):
        self.graph, self.pool, self.scratch = graph, pool, scratch

    def launch(self) -> None:
        self.graph.launch()
