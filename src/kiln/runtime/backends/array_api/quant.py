"""Weight-only quantization for both backends (int8 per channel or group, int4 in groups; the op set's
quantized_linear / quantized_embedding): the dequantization that defines them, and the embedding lookup.

Each backend registers its own quantized_linear (the CPU's compiled row-streaming kernel, the GPU's kernels);
`dequantize` is the reference both are tested against.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import portable


def integer_products_asked() -> bool:
    """Whether KILN_QUANT_DOT asks for integer products in the few-row quantized linears (inputs rounded to int8 per
    32, as llama.cpp does; the default) rather than float ones (`float`): the one switch the CPU's qdot.c and the
    GPU's qgemv_dot follow, read at every call so that a change of the environment takes effect."""
    return os.environ.get("KILN_QUANT_DOT", "int8").strip().lower() != "float"


def unpack(xp: Any, q: Any, bits: int) -> Any:
    """The quantized values as one integer per weight element ([N, K]); int4 holds two per byte, low nibble
    first."""
    if bits == 8:
        return q
    out = xp.empty(q.shape[:-1] + (q.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = q & 15
    out[..., 1::2] = q >> 4
    return out


def dequantize(xp: Any, q: Any, scale: Any, zero: Any, bits: int, group_size: int, offset: bool = False) -> Any:
    """W = (q - zero) * scale per group, as float32 ([N, K]); int4 without zeros is centred on 8. offset: W = q *
    scale + zero, each element rounded once, as GGUF's own dequantization does (so its weights come back bit for
    bit)."""
    values = unpack(xp, q, bits).astype(np.float32)
    rows, k = values.shape
    grouped = values.reshape(rows, k // group_size, group_size)
    s = scale.astype(np.float32)[..., None]
    if offset:
        return (grouped * s if zero is None else grouped * s + zero.astype(np.float32)[..., None]).reshape(rows, k)
    z = np.float32(8.0 if bits == 4 else 0.0) if zero is None else zero.astype(np.float32)[..., None]
    return ((grouped - z) * s).reshape(rows, k)


@portable("quantized_embedding")
def quantized_embedding(xp: Any, q: Any, scale: Any, zero: Any, indices: Any, bits: int, group_size: int,
                        offset: bool = False) -> Any:
    """Only the looked-up rows are dequantized."""
    flat = indices.reshape(-1)
    rows = dequantize(xp, q[flat], scale[flat], None if zero is None else zero[flat], bits, group_size, offset)
    return rows.reshape(indices.shape + rows.shape[-1:]).astype(scale.dtype, copy=False)
