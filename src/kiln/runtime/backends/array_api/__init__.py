"""Kernels written once against the NumPy API, for every backend whose arrays follow it (NumPy, CuPy).

Each takes the array module `xp` first. The op kernels among them are collected in PORTABLE, which each backend
binds to its module for the ops it has no kernel of its own for (KernelRegistry.adopt); helpers (attention,
convolution, dequantization) are called by the backends' own kernels with their module and, where it matters,
their own matrix product.
"""

from kiln.runtime.backends.array_api import (  # noqa: F401 - importing the families registers their kernels
    conv,
    elementwise,
    experts,
    index,
    norm,
    quant,
    reduce,
    resize,
    shape,
    sort,
)
from kiln.runtime.backends.array_api.attention import rotate, sdpa, slot_attention, slot_visibility
from kiln.runtime.backends.array_api.core import (
    BFLOAT16,
    LOW_PRECISION,
    PORTABLE,
    PortableKernel,
    bind,
    in_float32,
    portable,
    upcast,
)

__all__ = ["BFLOAT16", "LOW_PRECISION", "PORTABLE", "PortableKernel", "bind", "in_float32", "portable", "rotate",
           "sdpa", "slot_attention", "slot_visibility", "upcast"]
