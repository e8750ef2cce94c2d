"""A mixture-of-experts layer's experts (gathered_linear, gathered_quantized_linear): each row of x through the
expert its router picked, by MLX's gathered matrix product (mx.gather_mm), which reads the picked experts' weights
by index inside one kernel instead of copying them out first."""

from __future__ import annotations

import mlx.core as mx

from kiln.runtime.backends.mlx.kernels.quant import dequantize
from kiln.runtime.backends.mlx.registry import kernel, upcast


def _rows_through(x: mx.array, weights_t: mx.array, index: mx.array) -> mx.array:
    """x [S, K] times weights_t[index[s]] ([E, K, N], a transposed view) row by row."""
    return mx.gather_mm(x[:, None, :], weights_t, rhs_indices=index.astype(mx.uint32))[:, 0, :]


@kernel("gathered_linear")
def gathered_linear(x: mx.array, weight: mx.array, index: mx.array, bias: mx.array | None = None) -> mx.array:
    out = _rows_through(x, mx.swapaxes(weight, -1, -2), index)
    return out if bias is None else out + mx.take(bias, index, axis=0)


@kernel("gathered_quantized_linear")
def gathered_quantized_linear(x: mx.array, q: mx.array, scale: mx.array, zero: mx.array | None, index: mx.array,
                              bias: mx.array | None = None, *, bits: int, group_size: int,
                              offset: bool = False) -> mx.array:
    """The definition: the picked experts dequantized as quantized_linear's weight (one [N, K] a row, gathered
    already), then multiplied in float32 as a batch."""
    weights = dequantize(mx.take(q, index, axis=0), mx.take(scale, index, axis=0),
                         None if zero is None else mx.take(zero, index, axis=0), bits, group_size, offset)
    (xf, bias) = upcast(x, bias)
    out = mx.matmul(xf.astype(mx.float32)[:, None, :], mx.swapaxes(weights, -1, -2))[:, 0, :]
    return (out if bias is None else out + mx.take(bias, index, axis=0)).astype(scale.dtype)
