"""CUDA C++ kernels from the `.cu` sources beside the CuPy kernels, compiled at run time by NVRTC.

CuPy's RawModule compiles with NVRTC for the current GPU's architecture and caches the binary on disk, keyed by the
source, the options and the architecture (CuPy's kernel cache, ~/.cupy/kernel_cache), so a process pays for the
compilation once per machine; this module keeps the loaded modules and kernel lookups per process.

A source's kernels are templates over their storage type (`template <class S> __global__ void name(...)`), each
instantiated for float32, float16 and bfloat16 (the F32, F16 and BF16 structs of common.cuh, which is put in front
of every source). A kernel may take one int parameter more (`template <class S, int N>`, a size its registers are
laid out for), instantiated for the values a `// name<N>: 1 2 4 8` line of the source lists. A
`// name<S>: F16 BF16` line narrows a kernel to the storage types listed (the tensor-core kernels have no float32
product).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.cuda import timeline
from kiln.runtime.backends.cuda.launch import Kernel

OPTIONS = ("--std=c++17",)
"""No fast math: expf, sqrtf and division stay IEEE-accurate, as the CPU kernels' results are."""

STORAGE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", BFLOAT16: "BF16"}

_TEMPLATE = re.compile(r"template <class S(, int \w+)?>\s*__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)")
_INSTANCES = re.compile(r"^// (\w+)<N>: ([\d ]+)$", re.MULTILINE)
_TYPES = re.compile(r"^// (\w+)<S>: ([A-Z\d ]+)$", re.MULTILINE)


@functools.cache
def module(name: str) -> Any:
    """The compiled module of kernels/<name>.cu, every template kernel instantiated for every storage type."""
    files = resources.files("kiln.runtime.backends.cuda.kernels")
    source = files.joinpath("common.cuh").read_text() + "\n" + files.joinpath(f"{name}.cu").read_text()
    values = {kernel: numbers.split() for kernel, numbers in _INSTANCES.findall(source)}
    types = {kernel: names.split() for kernel, names in _TYPES.findall(source)}
    expressions = []
    for sized, kernel in _TEMPLATE.findall(source):
        if sized and kernel not in values:
            raise ValueError(f"{name}.cu: kernel {kernel} takes an int parameter but no '// {kernel}<N>:' line")
        for s in types.get(kernel, STORAGE.values()):
            expressions += [f"{kernel}<{s}, {n}>" for n in values[kernel]] if sized else [f"{kernel}<{s}>"]
    options = OPTIONS + ((timeline.DEFINE,) if timeline.ENABLED else ())
    compiled = cp.RawModule(code=source, options=options, name_expressions=expressions)
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
