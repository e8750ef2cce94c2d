"""What every portable kernel shares: the low-precision float types, upcasting, and the table of portable kernels.

A portable kernel takes the array module `xp` (NumPy or CuPy) first and then the op's arguments. A backend binds
the table to its module for every op it has no kernel of its own for (`KernelRegistry.adopt`), so one definition
serves the CPU and the GPU, and the CPU op tests check the code the GPU runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from kiln.runtime.backends.base import KernelRegistry

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
LOW_PRECISION = (np.dtype(np.float16), BFLOAT16)
"""Float types whose math runs in float32 and is rounded back, as PyTorch computes them."""

PortableKernel = Callable[..., Any]


def upcast(*arrays: Any) -> tuple[Any, ...]:
    """float16/bfloat16 arrays as float32 (for accumulation); others (and None) unchanged."""
    return tuple(a.astype(np.float32) if a is not None and a.dtype in LOW_PRECISION else a for a in arrays)


def on_host(xp: Any) -> bool:
    """Whether xp computes on the host, where a check that reads values (index ranges, counts) costs nothing. On a
    GPU such a read synchronizes and would stop the method being captured as a graph, so those checks run here."""
    return xp is np


def in_float32(fn: PortableKernel) -> PortableKernel:
    """fn run in float32 for a float16/bfloat16 first argument, its result rounded back, as PyTorch computes."""
    @functools.wraps(fn)
    def run(xp: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        if x.dtype in LOW_PRECISION:
            return xp.asarray(fn(xp, x.astype(np.float32), *args, **kwargs)).astype(x.dtype)
        return fn(xp, x, *args, **kwargs)
    return run


PORTABLE = KernelRegistry("portable")
"""Portable kernels by kiln op name: functions of (xp, *arguments), which each backend binds (adopt)."""
portable = PORTABLE.register


def bind(fn: PortableKernel, xp: Any) -> Callable[..., Any]:
    """fn with its array module given: a backend kernel."""
    bound = functools.partial(fn, xp)
    functools.update_wrapper(bound, fn)
    return bound
