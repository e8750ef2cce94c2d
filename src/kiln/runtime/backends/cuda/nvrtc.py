"""CUDA C++ kernels from the `.cu` sources beside the CuPy kernels, compiled at run time by NVRTC.

CuPy's RawModule compiles with NVRTC for the current GPU's architecture and caches the binary on disk, keyed by the
source, the options and the architecture (CuPy's kernel cache, ~/.cupy/kernel_cache), so a process pays for the
compilation once per machine; this module keeps the loaded modules and kernel lookups per process.

A source's kernels are templates over their storage type (`template <class S> __global__ void name(...)`), each
instantiated for float32, float16 and bfloat16 (the F32, F16 and BF16 structs of common.cuh, which is put in front
of every source).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import BFLOAT16

OPTIONS = ("--std=c++17",)
"""No fast math: expf, sqrtf and division stay IEEE-accurate, as the CPU kernels' results are."""

STORAGE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", BFLOAT16: "BF16"}

_TEMPLATE = re.compile(r"template <class S>\s*__global__\s+void\s+(\w+)")


@functools.cache
def module(name: str) -> Any:
    """The compiled module of kernels/<name>.cu, every template kernel instantiated for every storage type."""
    files = resources.files("kiln.runtime.backends.cuda.kernels")
    source = files.joinpath("common.cuh").read_text() + "\n" + files.joinpath(f"{name}.cu").read_text()
    expressions = [f"{kernel}<{s}>" for kernel in _TEMPLATE.findall(source) for s in STORAGE.values()]
    return cp.RawModule(code=source, options=OPTIONS, name_expressions=expressions)


@functools.cache
def function(source: str, kernel: str, dtype: np.dtype) -> Any:
    """kernels/<source>.cu's `kernel` for arrays of `dtype` (looked up once: a lookup costs as much as a launch)."""
    return module(source).get_function(f"{kernel}<{STORAGE[np.dtype(dtype)]}>")


def supports(*arrays: Any) -> bool:
    """Whether the templates take these arrays: one storage type among them."""
    dtype = arrays[0].dtype
    return dtype in STORAGE and all(a.dtype == dtype for a in arrays)
