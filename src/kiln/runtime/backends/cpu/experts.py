"""A mixture-of-experts layer on the CPU. The experts: the rows grouped by the expert they picked
(array_api.experts), each group through that expert's weight by the CPU's own linear kernels, so a decode step's
few rows per expert take the compiled few-row helpers (the float GEMV reading the weight rows sequentially, the
quantized row stream with its byte dot products) instead of a NumPy product per expert; a float32 decode step's
rows (and their combine) in one call of native/experts.c, which the native executor calls too. The router's pick
(route_experts) for float32 logits by native/experts.c as well, so a MoE decode step lowers whole into the
executor with the same results as here."""

from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.runtime.backends import composite
from kiln.runtime.backends.array_api.experts import combine_rows, expert_groups
from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.linalg import linear
from kiln.runtime.backends.cpu.quant import FEW_ROWS, quantized_linear
from kiln.runtime.backends.cpu.registry import CPU_KERNELS, kernel

GATHERED_ROWS_MAX, GROUP_ROWS_MAX = 64, 8
"""Rows up to which native/experts.c runs a float32 gathered linear (a decode step's top-k rows, of several
sequences in a serving program's step), and the rows of one expert it multiplies at a time (the few-row linears')."""


@kernel("route_experts")
def route_experts(logits: np.ndarray, k: int, normalize: bool, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    lib = native.library()
    if not (lib is not None and logits.dtype == np.float32 and dtype == DType.float32 and logits.ndim
            and 0 < k <= logits.shape[-1]):
        return composite.route_experts(CPU_KERNELS.kernels, logits, k, normalize, dtype)
    n = logits.shape[-1]
    x = np.ascontiguousarray(logits)
    weights = np.empty(logits.shape[:-1] + (k,), dtype=np.float32)
    ids = np.empty(logits.shape[:-1] + (k,), dtype=np.int64)
    work = np.empty(n, dtype=np.float32)
    lib.kiln_route_experts_f32(x.ctypes.data, weights.ctypes.data, ids.ctypes.data, x.size // n, n, k,
                               int(normalize), work.ctypes.data)
    return weights, ids


def gathered_work(n: int, k: int, group: int | None = None) -> int:
    """Floats of scratch native/experts.c's gathered linear takes (with a quantized weight's group: its own too)."""
    return (GROUP_ROWS_MAX * (k + n) + GATHERED_ROWS_MAX * n
            + (0 if group is None else 2 * GROUP_ROWS_MAX * (k + k // group)))


def _native_gathered(x: np.ndarray, index: np.ndarray, parts: tuple, bias: np.ndarray | None,
                     combine: np.ndarray | None, n: int, experts: int,
                     quant: tuple[int, int] | None = None) -> np.ndarray | None:
    """native/experts.c's gathered linear (and combine) for a decode step's float32 rows, or None where it does
    not apply. parts: (weight,) float32, or (q, scale, zero) with quant = (format, group)."""
    lib = native.library()
    s, k = x.shape
    floats = parts if quant is None else parts[1:]
    if not (lib is not None and s <= GATHERED_ROWS_MAX and x.dtype == np.float32 and index.dtype == np.int64
            and native.float32_contiguous(*floats, bias, *(() if combine is None else (combine,)))
            and parts[0].flags.c_contiguous):
        return None
    topk = 0 if combine is None else combine.shape[1]
    x, index = np.ascontiguousarray(x), np.ascontiguousarray(index)
    out = np.empty((s // topk if topk else s, n), dtype=np.float32)
    work = np.empty(gathered_work(n, k, None if quant is None else quant[1]), dtype=np.float32)
    pointers = [native.address(a) for a in parts]
    tail = (out.ctypes.data, work.ctypes.data, s, n, k, experts, topk)
    if quant is None:
        done = lib.kiln_gathered_linear_f32(x.ctypes.data, index.ctypes.data, *pointers, native.address(bias),
                                            native.address(combine), *tail, native.threads())
    else:
        done = lib.kiln_gathered_qlinear_f32(x.ctypes.data, index.ctypes.data, *pointers, native.address(bias),
                                             native.address(combine), *tail, *quant, int(native.integer_dot()),
                                             native.threads())
    return out if done else None  # (0: an index out of range; the Python path raises the op's error)


@kernel("gathered_linear")
def gathered_linear(x: np.ndarray, weight: np.ndarray, index: np.ndarray, bias: np.ndarray | None = None,
                    combine: np.ndarray | None = None) -> np.ndarray:
    done = _native_gathered(x, index, (weight,), bias, combine, weight.shape[1], weight.shape[0])
    if done is not None:
        return done
    out = np.empty((x.shape[0], weight.shape[1]), dtype=x.dtype)
    for e, rows in expert_groups(index, weight.shape[0]):
        b = None if bias is None else bias[e]
        if len(rows) <= FEW_ROWS:
            out[rows] = linear(x[rows], weight[e], b)
        else:  # (an expert's view is a new array each call: linear's packed-weight cache would pack it every time)
            product = x[rows] @ weight[e].T
            out[rows] = product if b is None else product + b
    return out if combine is None else combine_rows(np, out, combine)


@kernel("gathered_quantized_linear")
def gathered_quantized_linear(x: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None,
                              index: np.ndarray, bias: np.ndarray | None = None, combine: np.ndarray | None = None,
                              *, bits: int, group_size: int, offset: bool = False) -> np.ndarray:
    if scale.dtype == np.float32:
        done = _native_gathered(x, index, (q, scale, zero), bias, combine, q.shape[1], q.shape[0],
                                (native.quant_format(bits, offset), group_size))
        if done is not None:
            return done
    out = np.empty((x.shape[0], q.shape[1]), dtype=scale.dtype)
    for e, rows in expert_groups(index, q.shape[0]):
        out[rows] = quantized_linear(x[rows], q[e], scale[e], None if zero is None else zero[e],
                                     None if bias is None else bias[e], bits, group_size, offset)
    return out if combine is None else combine_rows(np, out, combine)
