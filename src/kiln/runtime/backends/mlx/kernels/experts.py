"""A mixture-of-experts layer's experts (gathered_linear, gathered_quantized_linear): each row of x through the
expert its router picked, by MLX's gathered matrix product (mx.gather_mm), which reads the picked experts' weights
by index inside one kernel instead of copying them out first."""

from __future__ import annotations

import mlx.core as mx

from kiln.runtime.backends.mlx.kernels.quant import dequantize
from kiln.runtime.backends.mlx.registry import kernel, upcast


def _rows_through(x: mx.array, weights_t: mx.array, index: mx.array) -> mx.array:
    """x [S, K] times weights_t[index[s]] ([E, K, N], a transposed view) row by row. MLX's CPU gather_mm takes
    float32 only: there narrower floats are multiplied in float32 and rounded once (what the op asks)."""
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        if x.shape[0] < weights_t.shape[0]:  # (the picked experts widened, not the whole stack)
            picked = mx.take(weights_t, index, axis=0).astype(mx.float32)
            return mx.matmul(x.astype(mx.float32)[:, None, :], picked)[:, 0, :].astype(x.dtype)
        out = mx.gather_mm(x.astype(mx.float32)[:, None, :], weights_t.astype(mx.float32),
                           rhs_indices=index.astype(mx.uint32))
        return out[:, 0, :].astype(x.dtype)
    return mx.gather_mm(x[:, None, :], weights_t, rhs_indices=index.astype(mx.uint32))[:, 0, :]


def combined(rows: mx.array, combine: mx.array | None) -> mx.array:
    """The op's combine: each token's k rows times its weights (rounded to the dtype), summed in float32."""
    if combine is None:
        return rows
    tokens, k = combine.shape
    products = rows.reshape(tokens, k, rows.shape[-1]) * combine[:, :, None]
    return mx.sum(products.astype(mx.float32), axis=1).astype(rows.dtype)


@kernel("gathered_linear")
def gathered_linear(x: mx.array, weight: mx.array, index: mx.array, bias: mx.array | None = None,
                    combine: mx.array | None = None) -> mx.array:
    out = _rows_through(x, mx.swapaxes(weight, -1, -2), index)
    return combined(out if bias is None else out + mx.take(bias, index, axis=0), combine)


@kernel("gathered_quantized_linear")
def gathered_quantized_linear(x: mx.array, q: mx.array, scale: mx.array, zero: mx.array | None, index: mx.array,
                              bias: mx.array | None = None, combine: mx.array | None = None, *, bits: int,
                              group_size: int, offset: bool = False) -> mx.array:
    """The definition: the picked experts dequantized as quantized_linear's weight (one [N, K] a row, gathered
    already), then multiplied in float32 as a batch."""
    weights = dequantize(mx.take(q, index, axis=0), mx.take(scale, index, axis=0),
                         None if zero is None else mx.take(zero, index, axis=0), bits, group_size, offset)
    (xf, bias) = upcast(x, bias)
    out = mx.matmul(xf.astype(mx.float32)[:, None, :], mx.swapaxes(weights, -1, -2))[:, 0, :]
    return combined((out if bias is None else out + mx.take(bias, index, axis=0)).astype(scale.dtype), combine)
