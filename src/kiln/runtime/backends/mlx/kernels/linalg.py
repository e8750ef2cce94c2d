"""Matrix products. MLX multiplies float types only; integer matmul (rare: index arithmetic) is an exact
broadcast multiply and sum."""

from __future__ import annotations

import mlx.core as mx

from kiln.runtime.backends.mlx.arrays import is_float
from kiln.runtime.backends.mlx.registry import kernel


@kernel("matmul")
def matmul(a: mx.array, b: mx.array) -> mx.array:
    if is_float(a):
        return mx.matmul(a, b)
    squeeze = []
    if a.ndim == 1:
        a, squeeze = a[None], squeeze + [-2]
    if b.ndim == 1:
        b, squeeze = b[:, None], squeeze + [-1]
    out = mx.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return mx.squeeze(out, axis=squeeze) if squeeze else out


@kernel("linear")
def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ weight.T (+ bias in the same kernel): the transpose is a view, never a copy."""
    if bias is None:
        return mx.matmul(x, weight.T)
    return mx.addmm(bias, x, weight.T)
