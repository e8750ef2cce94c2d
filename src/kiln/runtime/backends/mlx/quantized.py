"""kiln's weight-only quantized formats as MLX's affine quantized format, for mx.quantized_matmul,
mx.gather_qmm (a mixture-of-experts layer's stacked experts) and mx.dequantize.

kiln stores W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = k // group_size: int4 as unsigned nibbles
(two per byte, low nibble first; no zero means 8), int8 as signed bytes (no zero means 0). MLX stores
w = q_u * scale + bias with unsigned q_u packed into uint32 words, low bits first, in groups of 32, 64 or 128. So:
- int4 nibbles are already MLX's 4-bit values, and on a little-endian machine (x86, Apple silicon) kiln's bytes
  are MLX's words: the weight is used as it is, viewed as uint32;
- int8 becomes unsigned by flipping the sign bit (q + 128), and the zero point moves by 128 with it;
- bias = -zero * scale, computed in float64 and rounded once to the scale's type, so MLX's q_u * scale + bias
  differs from kiln's (q - zero) * scale only by the rounding of that product (tested); a weight stored with
  offsets (the op's offset: W = q * scale + zero, GGUF's form) is already MLX's: bias = zero (int4: exactly);
- a group of kiln's that MLX has no size for (int8 per channel is one group per row) is split into MLX groups of
  128, 64 or 32 that repeat its scale and bias. Weights whose rows fit none of those keep kiln's own kernels.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kiln.runtime.backends.mlx.arrays import to_mlx
from kiln.runtime.program import Program

MLX_GROUP_SIZES = (128, 64, 32)


@dataclass(frozen=True)
class MLXQuantized:
    weight: mx.array  # uint32 [N, K * bits / 32]
    scales: mx.array  # [N, K / group_size], the kiln scale's type
    biases: mx.array
    group_size: int
    bits: int


def mlx_group_size(k: int, group_size: int) -> int | None:
    """The MLX group size that holds groups of `group_size` over rows of k: the largest that divides both."""
    for size in MLX_GROUP_SIZES:
        if group_size % size == 0 and k % size == 0:
            return size
    return None


def convert(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int, group_size: int,
            offset: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(packed uint32 weight, scales, biases, MLX group size) in NumPy, or None where MLX has no group size for
    these rows or the machine is big-endian."""
    k = q.shape[-1] * (2 if bits == 4 else 1)
    size = mlx_group_size(k, group_size)
    if size is None or sys.byteorder != "little" or bits not in (4, 8):
        return None
    if bits == 8:
        unsigned, shift = q.view(np.uint8) ^ np.uint8(0x80), 128.0
    else:
        unsigned, shift = q, 0.0
    s = scale.astype(np.float64)
    if offset:  # W = q * s + o = (q + shift) * s + (o - shift * s)
        o = 0.0 if zero is None else zero.astype(np.float64)
        bias = (o - shift * s) * np.ones_like(s)
    else:
        z = (8.0 if bits == 4 else 0.0) if zero is None else zero.astype(np.float64)
        bias = -(z + shift) * s
    bias = bias.astype(scale.dtype)
    repeat = group_size // size
    packed = np.ascontiguousarray(unsigned).view(np.uint32)
    return packed, np.repeat(scale, repeat, axis=-1), np.repeat(bias, repeat, axis=-1), size


def to_mlx_format(program: Program, q: int, scale: int, zero: int | None, bits: int, group_size: int,
                  offset: bool = False) -> MLXQuantized | None:
    """The program's quantized weight (constants q, scale, zero) in MLX's format, or None (see convert)."""
    converted = convert(program.constant(q), program.constant(scale),
                        None if zero is None else program.constant(zero), bits, group_size, offset)
    if converted is None:
        return None
    packed, scales, biases, size = converted
    return MLXQuantized(mx.array(packed), to_mlx(scales), to_mlx(biases), size, bits)


def linear_kernel(w: MLXQuantized) -> Callable[..., mx.array]:
    def quantized_linear(x: mx.array, q: mx.array, scale: mx.array, zero: mx.array | None = None,
                         bias: mx.array | None = None, *, bits: int, group_size: int,
                         offset: bool = False) -> mx.array:
        out = mx.quantized_matmul(x.astype(w.scales.dtype), w.weight, w.scales, w.biases, transpose=True,
                                  group_size=w.group_size, bits=w.bits)
        return (out if bias is None else out + bias).astype(scale.dtype)
    return quantized_linear


def embedding_kernel(w: MLXQuantized) -> Callable[..., mx.array]:
    def quantized_embedding(q: mx.array, scale: mx.array, zero: mx.array | None, indices: mx.array, *, bits: int,
                            group_size: int, offset: bool = False) -> mx.array:
        rows = (mx.take(a, indices, axis=0) for a in (w.weight, w.scales, w.biases))
        return mx.dequantize(*rows, group_size=w.group_size, bits=w.bits).astype(scale.dtype)
    return quantized_embedding


def gathered_kernel(w: MLXQuantized) -> Callable[..., mx.array]:
    """gathered_quantized_linear on mx.gather_qmm: each row through its picked expert of the converted [E, N, K]
    stack, read quantized inside one kernel (the composed kernel dequantizes every picked expert first)."""
    from kiln.runtime.backends.mlx.kernels.experts import combined

    def gathered_quantized_linear(x: mx.array, q: mx.array, scale: mx.array, zero: mx.array | None,
                                  index: mx.array, bias: mx.array | None = None, combine: mx.array | None = None, *,
                                  bits: int, group_size: int, offset: bool = False) -> mx.array:
        out = mx.gather_qmm(x.astype(w.scales.dtype)[:, None, :], w.weight, w.scales, w.biases,
                            rhs_indices=index.astype(mx.uint32), transpose=True, group_size=w.group_size,
                            bits=w.bits)[:, 0, :]
        if bias is not None:
            out = out + mx.take(bias, index, axis=0)
        return combined(out.astype(scale.dtype), combine)
    return gathered_quantized_linear
