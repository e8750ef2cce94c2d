"""A mixture-of-experts layer's experts on the CPU: the rows grouped by the expert they picked (array_api.experts),
each group through that expert's weight by the CPU's own linear kernels, so a decode step's few rows per expert
take the compiled few-row helpers (the float GEMV reading the weight rows sequentially, the quantized row stream
with its byte dot products) instead of a NumPy product per expert."""

from __future__ import annotations

import numpy as np

from kiln.runtime.backends.array_api.experts import combine_rows, expert_groups
from kiln.runtime.backends.cpu.linalg import linear
from kiln.runtime.backends.cpu.quant import FEW_ROWS, quantized_linear
from kiln.runtime.backends.cpu.registry import kernel


@kernel("gathered_linear")
def gathered_linear(x: np.ndarray, weight: np.ndarray, index: np.ndarray, bias: np.ndarray | None = None,
                    combine: np.ndarray | None = None) -> np.ndarray:
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
    out = np.empty((x.shape[0], q.shape[1]), dtype=scale.dtype)
    for e, rows in expert_groups(index, q.shape[0]):
        out[rows] = quantized_linear(x[rows], q[e], scale[e], None if zero is None else zero[e],
                                     None if bias is None else bias[e], bits, group_size, offset)
    return out if combine is None else combine_rows(np, out, combine)
