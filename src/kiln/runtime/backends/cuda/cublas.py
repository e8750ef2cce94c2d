"""Matrix products on cuBLAS, called through ctypes on the cuBLAS library that CuPy loaded.

Why not CuPy's own cuBLAS wrappers: CuPy refuses every cuBLAS call while a stream is being captured ("calling
cuBLAS API during stream capture is currently unsupported"), and a decode step that cannot be captured as a CUDA
graph pays Python's overhead on every one of its hundreds of kernels. cuBLAS itself supports capture once its
handle has a workspace of its own (no allocation inside the graph). This module also gives bfloat16 products,
which CuPy's matmul lacks: cublasGemmEx takes bf16 operands and accumulates in float32, as PyTorch does.

One handle per thread (a cuBLAS handle must not be used by two threads at once), bound to the current CuPy stream
on every call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import BFLOAT16

_OP_N, _OP_T = 0, 1
_CUDA_R = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2, BFLOAT16: 14}
_COMPUTE_32F, _COMPUTE_64F = 68, 70  # cublasComputeType_t; 32F keeps float32 products exact-float32 (no TF32)
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # what cuBLAS asks for on Hopper


@functools.cache
def _library() -> ctypes.CDLL:
    """The libcublas that CuPy's own bindings loaded (so both agree on the version)."""
    import cupy_backends.cuda.libs.cublas  # noqa: F401 - loads libcublas into the process

    return _declare(loaded_library("cublas"))


def loaded_library(name: str) -> ctypes.CDLL:
    """lib<name>.so as this process has it loaded (found in /proc/self/maps), else as the system finds it by name
    (cublaslt.py's libcublasLt, which libcublas links, too)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if path.rsplit("/", 1)[-1].startswith(f"lib{name}.so"):
                    return ctypes.CDLL(path)
    except OSError:  # no /proc: look the library up by name
        pass
    found = ctypes.util.find_library(name)
    if found is None:
        raise OSError(f"cannot find the lib{name} library that CuPy uses")
    return ctypes.CDLL(found)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
    lib.cublasGemmStridedBatchedEx.argtypes = [
        p, i32, i32, i32, i32, i32, p, p, i32, i32, i64, p, i32, i32, i64, p, p, i32, i32, i64, i32, i32, i32]
    for fn in (lib.cublasCreate_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
               lib.cublasGemmStridedBatchedEx):
        fn.restype = ctypes.c_int
    return lib


class CublasError(RuntimeError):
    pass


def check(status: int, what: str) -> None:
    """Raise CublasError for a cuBLAS or cuBLASLt status other than success."""
    if status != 0:
        raise CublasError(f"{what} failed with cuBLAS status {status}")


class DeviceHandles(threading.local):
    """This thread's library handle and workspace on each device it used (a cuBLAS handle must not be used by two
    threads at once); `create()` makes the pair for the current device."""

    def __init__(self, create: Callable[[], tuple[ctypes.c_void_p, Any]]) -> None:
        self.create = create
        self.by_device: dict[int, tuple[ctypes.c_void_p, Any]] = {}

    def get(self) -> tuple[ctypes.c_void_p, Any]:
        device = cp.cuda.runtime.getDevice()
        entry = self.by_device.get(device)
        if entry is None:
            entry = self.by_device[device] = self.create()
        return entry


def _create_handle() -> tuple[ctypes.c_void_p, Any]:
    lib = _library()
    handle = ctypes.c_void_p()
    check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
    workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
    check(lib.cublasSetWorkspace_v2(handle, workspace.data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
    return handle, workspace


_HANDLES = DeviceHandles(_create_handle)


def supports(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in _CUDA_R


def _operand(x: Any) -> tuple[Any, int, int, int]:
    """x [batch, r, c] as cuBLAS sees x^T (column-major): (array, op, ld, batch stride in elements), copying only
    when neither of the last two dims has unit stride."""
    item = x.itemsize
    sb, sr, sc = (s // item for s in x.strides)
    rows, cols = x.shape[1], x.shape[2]
    if rows == 1:  # the row stride is never used to address anything, only checked against cols
        sr = max(sr, cols)
    if cols == 1:
        sc = 1
    if sc == 1 and sr >= cols:
        return x, _OP_N, max(1, sr), sb
    if sr == 1 and sc >= rows:
        return x, _OP_T, max(1, sc), sb
    x = cp.ascontiguousarray(x)
    return x, _OP_N, max(1, cols), rows * cols


def _batched(x: Any, batch: tuple[int, ...]) -> Any:
    """x broadcast to batch + its last two dims, viewed as [prod(batch), r, c]: without a copy when the batch dims
    collapse into one stride (a broadcast batch has stride 0), else materialized."""
    x = cp.broadcast_to(x, batch + x.shape[-2:])
    n = int(np.prod(batch)) if batch else 1
    used = [(s, d) for s, d in zip(x.strides[:-2], batch, strict=True) if d != 1]
    step = used[-1][0] if used else 0
    expected = step
    for s, d in reversed(used):
        if s != expected:
            x = cp.ascontiguousarray(x)
            return x.reshape((n,) + x.shape[-2:])
        expected = s * d
    return cp.lib.stride_tricks.as_strided(x, (n,) + x.shape[-2:], (step,) + x.strides[-2:])


def matmul(a: Any, b: Any, out: Any = None, accumulate: bool = False, tuned: bool = False) -> Any:
    """a @ b for a, b of >= 2 dims (batch dims broadcast), in their one dtype (float32/64, float16, bfloat16);
    with `accumulate`, out += a @ b (out given, contiguous), the sum rounded once. A float32 `out` takes a
    float16/bfloat16 product unrounded (attention's scores).

    One cublasGemmStridedBatchedEx call. Row-major C = A B is computed as column-major C^T = B^T A^T, so no
    operand is copied when its last or second-to-last dim has unit stride (a weight's transposed view included).
    With `tuned`, a 2-d float16/bfloat16 product runs the algorithm measured fastest for its shape (cublaslt.py)
    where that is not GemmEx's own.
    """
    dtype = a.dtype
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if out is None:
        out = cp.empty(batch + (m, n), dtype=dtype)
    elif out.dtype != dtype and not (out.dtype == np.float32 and dtype in (np.float16, BFLOAT16)):
        raise TypeError(f"cuBLAS products of {dtype} write {dtype} or (for half types) float32, not {out.dtype}")
    if out.size == 0:
        return out
    if k == 0:
        if not accumulate:
            out.fill(0)
        return out
    a3, b3 = _batched(a, batch), _batched(b, batch)
    # cuBLAS operand A is b^T [n, k], operand B is a^T [k, m], C is out^T [n, m] with ld n.
    b3, op_b, ld_b, stride_b = _operand(b3)
    a3, op_a, ld_a, stride_a = _operand(a3)
    count = a3.shape[0]
    if dtype == np.float64:
        compute, one, beta = _COMPUTE_64F, ctypes.c_double(1.0), ctypes.c_double(float(accumulate))
    else:
        compute, one, beta = _COMPUTE_32F, ctypes.c_float(1.0), ctypes.c_float(float(accumulate))
    kind = _CUDA_R[np.dtype(dtype)]
    lib = _library()
    handle, _ = _HANDLES.get()

    def gemmex(c: int) -> None:
        check(lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
        check(lib.cublasGemmStridedBatchedEx(
            handle, op_b, op_a, n, m, k, ctypes.byref(one),
            b3.data.ptr, kind, ld_b, stride_b, a3.data.ptr, kind, ld_a, stride_a,
            ctypes.byref(beta), c, _CUDA_R[out.dtype], n, m * n, count, compute, _GEMM_DEFAULT),
            "cublasGemmStridedBatchedEx")

    if tuned and count == 1 and dtype != np.float32 and dtype != np.float64:
        from kiln.runtime.backends.cuda import cublaslt

        product = cublaslt.Product(op_b, op_a, n, m, k, b3.data.ptr, ld_b, a3.data.ptr, ld_a, out.data.ptr, kind,
                                   _CUDA_R[out.dtype], float(accumulate))
        if cublaslt.run(product, gemmex):
            return out
    gemmex(out.data.ptr)
    return out
