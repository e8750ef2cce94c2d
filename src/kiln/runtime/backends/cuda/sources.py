"""The CUDA kernel sources read as text: which kernel instances a source declares (no CuPy, no GPU needed).

A source's kernels are templates over their storage type (`template <class S> __global__ void name(...)`), each
instantiated for float32, float16 and bfloat16 (the F32, F16 and BF16 structs of common.cuh, which is put in front
of every source). A kernel may take one int parameter more (`template <class S, int N>`, a size its registers are
laid out for), instantiated for the values the `// name<N>: 1 2 4 8` lines of the source list (a long list may take
several lines). A `// name<S>: F16 BF16` line narrows a kernel to the storage types listed (the tensor-core kernels
have no float32 product). nvrtc.py compiles these instances; the CPU tests and scripts/cuda_check.py read them here
too, so a kernel the pattern misses (never instantiated, so never launchable) or a sized kernel without its list is
found without a GPU.
"""

from __future__ import annotations

import re
from importlib import resources

OPTIONS = ("--std=c++17",)
"""The compiler's options (NVRTC's at run time, nvcc's in scripts/cuda_check.py). No fast math: expf, sqrtf and
division stay IEEE-accurate, as the CPU kernels' results are."""

STORAGE_TYPES = ("F32", "F16", "BF16")
"""common.cuh's storage structs, in nvrtc.STORAGE's order."""

TEMPLATE = re.compile(r"template <class S(, int \w+)?>\s*__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)")
INSTANCES = re.compile(r"^// (\w+)<N>: ([\d ]+)$", re.MULTILINE)
TYPES = re.compile(r"^// (\w+)<S>: ([A-Z\d ]+)$", re.MULTILINE)
GLOBAL = re.compile(r"__global__\s+void\b")


FOLDER = resources.files("kiln.runtime.backends.cuda").joinpath("kernels")
"""kernels/ (through its parent package: importing the kernels package itself needs CuPy)."""


def names() -> list[str]:
    """The kernel sources (kernels/<name>.cu), sorted."""
    return sorted(f.name.removesuffix(".cu") for f in FOLDER.iterdir() if f.name.endswith(".cu"))


def read(name: str) -> str:
    """kernels/<name>.cu with common.cuh in front of it, as it is compiled."""
    return FOLDER.joinpath("common.cuh").read_text() + "\n" + FOLDER.joinpath(f"{name}.cu").read_text()


def instances(source: str, name: str = "source") -> list[str]:
    """The name expressions (`kernel<BF16, 141>`) of every instance `source` declares. A sized kernel without a
    `// kernel<N>:` line is an error (it could not be instantiated)."""
    values: dict[str, list[str]] = {}
    for kernel, numbers in INSTANCES.findall(source):
        values.setdefault(kernel, []).extend(numbers.split())
    types = {kernel: found.split() for kernel, found in TYPES.findall(source)}
    expressions = []
    for sized, kernel in TEMPLATE.findall(source):
        if sized and kernel not in values:
            raise ValueError(f"{name}.cu: kernel {kernel} takes an int parameter but no '// {kernel}<N>:' line")
        for storage in types.get(kernel, STORAGE_TYPES):
            expressions += ([f"{kernel}<{storage}, {n}>" for n in values[kernel]] if sized
                            else [f"{kernel}<{storage}>"])
    return expressions


def kernel_count(source: str) -> tuple[int, int]:
    """(__global__ functions in `source`, those TEMPLATE recognizes): equal when every kernel is instantiated."""
    return len(GLOBAL.findall(source)), len(TEMPLATE.findall(source))
