"""CUDA C++ kernels from the `.cu` sources beside the CuPy kernels, compiled at run time by NVRTC.

CuPy's RawModule compiles with NVRTC for the current GPU's architecture and caches the binary on disk, keyed by the
source, the options and the architecture (CuPy's kernel cache, ~/.cupy/kernel_cache), so a process pays for the
compilation once per machine; this module keeps the loaded modules per process.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import cupy as cp

OPTIONS = ("--std=c++17",)
"""No fast math: expf, sqrtf and division stay IEEE-accurate, as the CPU kernels' results are."""


@functools.cache
def module(name: str) -> Any:
    """The compiled module of kernels/<name>.cu."""
    source = resources.files("kiln.runtime.backends.cuda.kernels").joinpath(f"{name}.cu").read_text()
    return cp.RawModule(code=source, options=OPTIONS)


@functools.cache
def function(source: str, kernel: str) -> Any:
    """One kernel of kernels/<source>.cu (looked up once: the lookup costs as much as a launch)."""
    return module(source).get_function(kernel)
