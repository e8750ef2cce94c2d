"""Weight-only quantized linear and embedding (the op set's int8 per channel or group, int4 in groups) composed
from the definition: W = (q - zero) * scale per group. A session on a program whose quantized weights are
constants runs them on MLX's own quantized formats instead (prepare.py); these kernels are the definition that is
tested against, and the path for weights that are not constants."""

from __future__ import annotations

import mlx.core as mx

from kiln.runtime.backends.mlx.registry import kernel, upcast


def unpack(q: mx.array, bits: int) -> mx.array:
    """The quantized values, one integer per weight element ([..., K]); int4 holds two per byte, low nibble
    first."""
    if bits == 8:
        return q
    return mx.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[:-1] + (q.shape[-1] * 2,))


def dequantize(q: mx.array, scale: mx.array, zero: mx.array | None, bits: int, group_size: int,
               offset: bool = False) -> mx.array:
    """W = (q - zero) * scale per group, as float32 ([..., K]); int4 without zeros is centred on 8. offset: W = q *
    scale + zero."""
    values = unpack(q, bits).astype(mx.float32)
    k = values.shape[-1]
    grouped = values.reshape(values.shape[:-1] + (k // group_size, group_size))
    s = scale.astype(mx.float32)[..., None]
    if offset:
        w = grouped * s if zero is None else grouped * s + zero.astype(mx.float32)[..., None]
        return w.reshape(values.shape)
    z = mx.array(8.0 if bits == 4 else 0.0) if zero is None else zero.astype(mx.float32)[..., None]
    return ((grouped - z) * s).reshape(values.shape)


@kernel("quantized_linear")
def quantized_linear(x: mx.array, q: mx.array, scale: mx.array, zero: mx.array | None = None,
                     bias: mx.array | None = None, *, bits: int, group_size: int, offset: bool = False) -> mx.array:
    dtype = scale.dtype
    (xf, bias) = upcast(x, bias)
    out = mx.matmul(xf.astype(mx.float32), dequantize(q, scale, zero, bits, group_size, offset).T)
    if bias is not None:
        out = out + bias
    return out.astype(dtype)


@kernel("quantized_embedding")
def quantized_embedding(q: mx.array, scale: mx.array, zero: mx.array | None, indices: mx.array, bits: int,
                        group_size: int, offset: bool = False) -> mx.array:
    """Only the looked-up rows are dequantized."""
    rows = dequantize(mx.take(q, indices, axis=0), mx.take(scale, indices, axis=0),
                      None if zero is None else mx.take(zero, indices, axis=0), bits, group_size, offset)
    return rows.astype(scale.dtype)
