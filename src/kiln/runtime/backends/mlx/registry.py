"""The MLX kernel table, and the helpers its kernel families share.

A kernel takes MLX arrays (the node's inputs) and the node's attributes, and returns MLX arrays; it builds MLX's
lazy graph and never reads values back to the host, so that a method can be compiled (mx.compile) as a whole.
Float16/bfloat16 math that kiln defines in float32 (as PyTorch computes it) is widened and rounded back: inside a
compiled method MLX fuses those casts into the elementwise kernel around them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kiln.runtime.backends.base import KernelRegistry
from kiln.runtime.backends.mlx.arrays import LOW_PRECISION

MLX_KERNELS = KernelRegistry("mlx")
kernel = MLX_KERNELS.register


def upcast(*arrays: Any) -> tuple[Any, ...]:
    """float16/bfloat16 arrays as float32; others (and None) unchanged."""
    return tuple(a.astype(mx.float32) if a is not None and a.dtype in LOW_PRECISION else a for a in arrays)


def in_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn run in float32 for a float16/bfloat16 first argument, its result rounded back."""
    @functools.wraps(fn)
    def run(x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if x.dtype in LOW_PRECISION:
            return fn(x.astype(mx.float32), *args, **kwargs).astype(x.dtype)
        return fn(x, *args, **kwargs)
    return run


def scalar(value: float | int | bool, like: mx.array) -> mx.array:
    """A 0-d array of `like`'s dtype (a Python number would promote integer arrays to float, or float16 up)."""
    return mx.array(value, dtype=like.dtype)


def axes_of(dims: Any, ndim: int) -> list[int]:
    """A reduction's axes: the given dims, or all of them where the op says an empty list means all."""
    return list(dims) if dims else list(range(ndim))


def on_cpu() -> bool:
    """Whether MLX computes on the CPU (always on Linux), where some of its fused operations fall back to a
    composition that rounds intermediates to half precision: those kernels widen half inputs there."""
    return mx.default_device() == mx.cpu
