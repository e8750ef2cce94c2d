"""The CUDA kernel table and what the kernel families share: the OnHost signal and launch helpers."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.base import KernelRegistry

CUDA_KERNELS = KernelRegistry("cuda")
"""The GPU's own kernels (fused NVRTC kernels, cuBLAS products, functions CuPy has and NumPy lacks);
kiln.runtime.backends.cuda.kernels adds the portable kernels, bound to CuPy, for every other op."""
kernel = CUDA_KERNELS.register


class OnHost(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a CUDA kernel for arguments it does not handle: the backend runs the op's CPU kernel on the host
    instead (and reports it in host_ops)."""


GATE_CODES = {"silu": 1, "gelu": 2, "gelu_tanh": 3}
"""The gated activations' codes in the kernels (common.cuh's gate_activation)."""

ROW_WARP_MAX, ROWS_PER_BLOCK = 2048, 8
"""Row kernels (LayerNorm, softmax) give each row up to ROW_WARP_MAX elements a warp of its own, ROWS_PER_BLOCK
rows per block: short rows then pay no block-wide barriers. Longer rows get a block each."""


def resident_blocks(function: Any, shared: int, threads: int) -> int:
    """How many blocks of `function` (a launch.Kernel: its registers), `threads` threads and `shared` bytes of
    shared memory each, the GPU holds at once (by threads, registers and shared memory an SM, the SM's 1 KB a block
    included): the norm-prologue GEMV's grid, the gathered GEMVs' cap, qgemv_dot's weight rows, gemm_rows's ring."""
    device = cp.cuda.Device()
    key = (device.id, function.raw.num_regs, shared, threads)
    if key not in _RESIDENT:
        attributes = device.attributes
        per_sm = min(attributes["MaxThreadsPerMultiProcessor"] // threads,
                     attributes["MaxRegistersPerMultiprocessor"] // (-(-key[1] * threads // 256) * 256),
                     attributes["MaxSharedMemoryPerMultiprocessor"] // (shared + 1024))
        _RESIDENT[key] = attributes["MultiProcessorCount"] * max(1, per_sm)
    return _RESIDENT[key]


_RESIDENT: dict[tuple[int, int, int, int], int] = {}


def contiguous(*arrays: Any) -> bool:
    return all(a.flags.c_contiguous for a in arrays)


def grid(n: int, block: int = 256) -> tuple[int]:
    """Blocks for n elements, one per thread, capped where kernels loop (grid-stride) over the rest."""
    return (max(1, min((n + block - 1) // block, 65535)),)


def elements(strides: tuple[int, ...], itemsize: int, ndim: int = 4) -> list[np.int64]:
    """Strides in elements, padded in front to `ndim` dims (a padded dim has size 1, so its stride is unused)."""
    return [np.int64(0)] * (ndim - len(strides)) + [np.int64(s // itemsize) for s in strides]


def rows(x: Any) -> Any | None:
    """x as [rows, last dim] with unit stride along a row (a view whenever the leading dims collapse, as they do
    for the slices of a fused projection), or None."""
    if x.ndim == 0 or x.shape[-1] == 0:
        return None
    r = x.reshape(-1, x.shape[-1])
    return r if r.strides[1] == x.itemsize else None
