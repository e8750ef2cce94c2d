"""CUDA C++ kernels from the `.cu` sources beside the CuPy kernels, compiled at run time by NVRTC.

CuPy's RawModule compiles with NVRTC for the current GPU's architecture and caches the binary on disk, keyed by the
source, the options and the architecture (CuPy's kernel cache, ~/.cupy/kernel_cache), so a process pays for the
compilation once per machine; this module keeps the loaded modules and kernel lookups per process.

Which kernel instances a source declares (templates over the storage type, some with an int size) is read by
sources.py; every declared instance is compiled into the source's module.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.cuda import sources, timeline
from kiln.runtime.backends.cuda.launch import Kernel

OPTIONS = sources.OPTIONS

STORAGE = dict(zip((np.dtype(np.float32), np.dtype(np.float16), BFLOAT16), sources.STORAGE_TYPES, strict=True))
"""The storage struct (common.cuh's F32, F16, BF16) of each dtype."""


@functools.cache
def module(name: str) -> Any:
    """The compiled module of kernels/<name>.cu, every template kernel instantiated for every storage type."""
    source = sources.read(name)
    options = OPTIONS + ((timeline.DEFINE,) if timeline.ENABLED else ())
    compiled = cp.RawModule(code=source, options=options, name_expressions=sources.instances(source, name))
    if timeline.ENABLED:
        timeline.attach(compiled)
    return compiled


@functools.cache
def function(source: str, kernel: str, dtype: np.dtype, size: int | None = None) -> Kernel:
    """kernels/<source>.cu's `kernel` for arrays of `dtype` (and its int parameter `size`, if it takes one), looked
    up once (a lookup costs as much as a launch), launched early where the GPU takes it (launch.py)."""
    storage = STORAGE[np.dtype(dtype)]
    name = f"{kernel}<{storage}>" if size is None else f"{kernel}<{storage}, {size}>"
    return Kernel(module(source).get_function(name), name)


def supports(*arrays: Any) -> bool:
    """Whether the templates take these arrays: one storage type among them."""
    dtype = arrays[0].dtype
    return dtype in STORAGE and all(a.dtype == dtype for a in arrays)
