"""What a quantized linear computes when it multiplies in integers (the CPU's native/qdot.c, as llama.cpp does):
each input row rounded to int8 in blocks of 32, each piece's products with the int4/int8 weight codes summed
exactly, the scales applied after. Shared by the CPU's tests and the GPU's (the same rounding on every backend)."""

from __future__ import annotations

import numpy as np


def integer_dot(x: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bias: np.ndarray | None,
                bits: int, group: int, offset: bool) -> np.ndarray:
    """out [rows, n] in float64 for x [rows, k] (float32): x's blocks of 32 scaled by 127 / max |x| and rounded to
    the nearest integer (ties to even; float32 arithmetic, as the kernels do it), their scale max |x| / 127; per
    piece of 32 (int4) or 16 (int8) weights of one group, scale * d * sum(q xq), plus the group's additive term (the
    zero point's -z * scale, or the offset) times d * sum(xq); int4 without zero points is centred at 8."""
    rows, k = x.shape
    blocks = x.astype(np.float32).reshape(rows, k // 32, 32)
    top = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inverse).astype(np.int64).reshape(rows, k)
    d = np.repeat((top / np.float32(127)).astype(np.float64).reshape(rows, k // 32), 32, axis=1)
    if bits == 4:
        w = np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], k).astype(np.int64)
    else:
        w = q.view(np.int8).astype(np.int64)
    per = 32 if bits == 4 else 16
    pieces = k // per
    s = np.repeat(scale.astype(np.float64), group, axis=1)[:, ::per]  # [n, pieces]
    z = None if zero is None else np.repeat(zero.astype(np.float64), group, axis=1)[:, ::per]
    dot = np.einsum("npj,rpj->rnp", w.reshape(-1, pieces, per), codes.reshape(rows, pieces, per))
    sums = codes.reshape(rows, pieces, per).sum(-1)[:, None, :]  # [rows, 1, pieces]
    dp = d[:, ::per][:, None, :]
    if bits == 4 and zero is None:
        dot = dot - 8 * sums
    term = 0.0 if zero is None else (z[None] if offset else -s[None] * z[None]) * dp * sums
    out = (s[None] * dp * dot + term).sum(-1)
    return out + (0.0 if bias is None else bias.astype(np.float64))
