"""CUDA C++ kernels from the `.cu` sources beside the CuPy kernels, compiled at run time by NVRTC.

Which kernel instances a source declares (templates over the storage type, some with an int size) is read by
sources.py; every declared instance is compiled into the source's module, for the current GPU's architecture. The
binary and the instances' C++ names are kept on disk (module_cache.py: CuPy's own kernel cache compiles a module of
named template instances again in every process), so a machine pays for a source's compile once; this module keeps
the loaded modules and kernel lookups per process. Where the cache cannot be used (a read-only cache folder, a
CuPy without the compiler call it needs), CuPy's RawModule compiles the source in this process, as before.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.cuda import module_cache, sources, timeline
from kiln.runtime.backends.cuda.launch import Kernel
from kiln.runtime.cache_dir import cache_dir

log = logging.getLogger("kiln.runtime.cuda")

OPTIONS = sources.OPTIONS

RAW_MODULE_OPTIONS = ("-ftz=true",)
"""What CuPy's RawModule adds to every NVRTC compile, added where kiln calls NVRTC through CuPy's compiler itself:
the cached binaries are the ones RawModule built."""

STORAGE = dict(zip((np.dtype(np.float32), np.dtype(np.float16), BFLOAT16), sources.STORAGE_TYPES, strict=True))
"""The storage struct (common.cuh's F32, F16, BF16) of each dtype."""


class SourceModule:
    """A kernel source's loaded module: its kernels (CuPy RawKernels) by name expression (`qgemv_dot<BF16, 141>`),
    through the instances' C++ names where it was loaded from a file."""

    def __init__(self, raw: Any, names: dict[str, str] | None = None) -> None:
        self.raw, self.names = raw, names

    def get_function(self, expression: str) -> Any:
        return self.raw.get_function(self.names[expression] if self.names is not None else expression)

    def get_global(self, symbol: str) -> Any:
        return self.raw.get_global(symbol)


@functools.cache
def module(name: str) -> SourceModule:
    """The compiled module of kernels/<name>.cu, every template kernel instantiated for every storage type."""
    source = sources.read(name)
    options = OPTIONS + ((timeline.DEFINE,) if timeline.ENABLED else ())
    expressions = sources.instances(source, name)
    compiled = _cached_module(name, source, options, expressions)
    if compiled is None:
        compiled = SourceModule(cp.RawModule(code=source, options=options, name_expressions=expressions))
    if timeline.ENABLED:
        timeline.attach(compiled)
    return compiled


def _cached_module(name: str, source: str, options: tuple[str, ...], expressions: list[str]) -> SourceModule | None:
    """The module from kiln's cache, compiled into it first where it is not there; None where the cache cannot be
    used (the caller then compiles as CuPy's RawModule does, in this process only)."""
    try:
        folder = cache_dir("cuda")
        folder.mkdir(parents=True, exist_ok=True)
        device = cp.cuda.Device()
        target = f"sm{device.compute_capability} nvrtc{cp.cuda.nvrtc.getVersion()} cupy{cp.__version__}"
        key = module_cache.key(source, options, expressions, target)
        found = module_cache.stored(folder, name, key)
        if found is None:
            log.info("compiling %s.cu's %d CUDA kernel instances with NVRTC (once on this machine; kept in %s)",
                     name, len(expressions), folder)
            from cupy.cuda import compiler

            binary, names = compiler.compile_using_nvrtc(source, options + RAW_MODULE_OPTIONS,
                                                         name_expressions=expressions)
            data = binary.encode() if isinstance(binary, str) else binary
            path = module_cache.store(folder, name, key, data, dict(names))
            if path is None:  # (a cache that cannot be written: this process loads what it compiled, once)
                with tempfile.TemporaryDirectory() as scratch:
                    path = Path(scratch) / f"{name}.cubin"
                    path.write_bytes(data)
                    return _loaded(path, dict(names), expressions)
            found = path, dict(names)
        return _loaded(*found, expressions)
    except Exception as exc:  # (any failure here leaves the compile to RawModule, as before the cache)
        log.warning("kiln's CUDA module cache is not used for %s.cu (%s: %s)", name, type(exc).__name__, exc)
        return None


def _loaded(path: Path, names: dict[str, str], expressions: list[str]) -> SourceModule:
    """The module in the binary at `path`, loaded now (CuPy loads a file's module on first use, and keeps it)."""
    compiled = SourceModule(cp.RawModule(path=str(path)), names)
    compiled.raw.compile()
    if expressions and not isinstance(compiled.get_function(expressions[0]), cp.RawKernel):  # (launch.Kernel's)
        raise TypeError("a RawModule loaded from a file did not give RawKernels")
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
