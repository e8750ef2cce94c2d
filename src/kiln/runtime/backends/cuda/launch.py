"""Kernel launches with programmatic dependent launch (PDL, compute capability 9.0 on): a kernel may start while
the kernel before it in the stream is still running.

Between two dependent kernels the GPU otherwise drains the first (its last blocks, the flush of its writes) before
it launches the second, which then ramps up from nothing: at batch 1 a decode step is ~125 kernels of a few
microseconds, and those gaps are a large share of the step. Launched early, the second kernel's blocks take the
SMs the first one frees, and every kernel of kiln's sources begins with common.cuh's grid_dependency_sync, which
waits until the kernel before has completed and its writes are visible, then lets the kernel after launch. Only
what needs no result of an earlier kernel may come before that call: the GEMV issues its loads of a program
constant's weight rows there, so the weight stream of a projection starts while the previous kernel finishes.

Every kernel launched this way must make that call in every block before it reads or writes anything an earlier
kernel may touch (tests/runtime/test_cuda_sources.py checks the sources). Kernels launched otherwise (CuPy's,
cuBLAS's) wait for the kernel before them to finish, as always, and a kernel after them finds them complete.

CuPy launches with cuLaunchKernel, which takes no launch attributes, so these launches call the driver's
cuLaunchKernelEx through ctypes with the kernel's CUfunction. Stream capture keeps the programmatic edges in a
CUDA graph (driver 12.3 on). KILN_CUDA_EARLY_LAUNCH=0 turns it off, for debugging and for measuring what it
gives; without the driver support or on an older GPU every launch is CuPy's.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.cuda import timeline

EARLY_LAUNCH = os.environ.get("KILN_CUDA_EARLY_LAUNCH", "1") != "0"

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MIN_DRIVER, _MIN_CAPABILITY = 12030, 90  # graphs keep programmatic edges from CUDA 12.3; griddepcontrol: sm_90


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding, and a 64-byte value union whose first member this launch sets."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
"""The C type of each NumPy scalar type a kernel argument may have (kiln passes every scalar as a NumPy scalar,
so its width is explicit)."""


@functools.cache
def _driver() -> Any:
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    driver.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return driver


@functools.cache
def early_launch_supported(device: int) -> bool:
    """Whether this device and driver take early launches (and the switch has not turned them off)."""
    if not EARLY_LAUNCH or cp.cuda.runtime.driverGetVersion() < _MIN_DRIVER:
        return False
    major, minor = cp.cuda.Device(device).compute_capability
    return int(major) * 10 + int(minor) >= _MIN_CAPABILITY


def _param(value: Any) -> Any:
    if isinstance(value, cp.ndarray):
        return ctypes.c_void_p(value.data.ptr)
    if isinstance(value, np.generic) and value.dtype in _SCALARS:
        return _SCALARS[value.dtype](value.item())
    raise TypeError(f"a kernel argument must be a CuPy array or a NumPy scalar of {sorted(map(str, _SCALARS))}, "
                    f"not {type(value).__name__}")


SHARED_WITHOUT_ASKING = 48 * 1024
"""Dynamic shared memory a kernel may take without raising its limit first."""


class Kernel:
    """A compiled kernel of kiln's sources, called as CuPy's are: kernel(grid, block, args, shared_mem=0); launched
    early where the device takes it. `raw` is CuPy's kernel (its attributes: num_regs, the shared memory limit). A
    call that asks for more dynamic shared memory than SHARED_WITHOUT_ASKING raises the kernel's limit first, once
    for each larger size, so its callers pass only the bytes."""

    def __init__(self, raw: Any, name: str = ""):
        self.raw, self.name = raw, name
        self._function: int | None = None
        self._shared_allowed = SHARED_WITHOUT_ASKING

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 shared_mem: int = 0) -> None:
        if shared_mem > self._shared_allowed:
            self.raw.max_dynamic_shared_size_bytes = self._shared_allowed = shared_mem
        grid3, block3 = _dims(grid), _dims(block)
        if timeline.ENABLED:
            timeline.launched(self.name, grid3, block3)
        if not early_launch_supported(cp.cuda.Device().id):
            self.raw(grid, block, args, shared_mem=shared_mem)
            return
        if self._function is None:
            self._function = self.raw.kernel.ptr
        params = [_param(a) for a in args]
        pointers = (ctypes.c_void_p * max(1, len(params)))(*[ctypes.addressof(p) for p in params])
        attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _Config((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), shared_mem,
                         cp.cuda.get_current_stream().ptr, ctypes.pointer(attribute), 1)
        status = _driver().cuLaunchKernelEx(ctypes.byref(config), self._function, pointers, None)
        if status:
            message = ctypes.c_char_p()
            _driver().cuGetErrorString(status, ctypes.byref(message))
            raise RuntimeError(f"cuLaunchKernelEx failed ({status}: "
                               f"{(message.value or b'unknown error').decode()})")


def _dims(dims: tuple[int, ...]) -> tuple[int, int, int]:
    padded = tuple(int(d) for d in dims) + (1, 1, 1)
    return padded[0], padded[1], padded[2]
