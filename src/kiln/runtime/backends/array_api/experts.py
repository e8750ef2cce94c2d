"""A mixture-of-experts layer's experts (the op set's gathered_linear and gathered_quantized_linear): each row of x
through the linear layer its router picked from a stack of E.

On the host the rows are grouped by expert (a stable sort of the index), so that each picked expert's weight is
read once, as one matrix product over all of its rows: a decode step's k rows touch k experts, a prompt's rows
share the experts they pick, and the experts no row picks are never read (not a loop over all E). On a GPU
grouping would need the index on the host (a synchronization, and no graph capture), so there the picked
weights are gathered, one per row, and multiplied as a batch: the same sums, each weight read once per row that
picks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import LOW_PRECISION, on_host, portable
from kiln.runtime.backends.array_api.quant import dequantize


def expert_groups(index: np.ndarray, experts: int) -> Iterator[tuple[int, np.ndarray]]:
    """(expert, the rows that picked it) for each expert some row picked, in expert order."""
    flat = np.asarray(index).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= experts):
        raise IndexError(f"an expert index is out of range for {experts} experts: {flat.min()}..{flat.max()}")
    order = np.argsort(flat, kind="stable")
    picked = flat[order]
    starts = np.flatnonzero(np.diff(picked)) + 1
    for rows in np.split(order, starts):
        if rows.size:
            yield int(flat[rows[0]]), rows


def combine_rows(xp: Any, rows: Any, combine: Any) -> Any:
    """out[t] = sum over j of combine[t, j] * rows[t * k + j] for combine [T, k]: each product rounded to the rows'
    dtype, the sum in float32 (float64 for float64) rounded once, as the multiply and the sum it stands for."""
    tokens, k = combine.shape
    products = rows.reshape(tokens, k, rows.shape[-1]) * combine[:, :, None]
    wide = np.float32 if rows.dtype in LOW_PRECISION else rows.dtype
    return products.astype(wide).sum(axis=1).astype(rows.dtype)


def _gathered(xp: Any, x: Any, index: Any, bias: Any, experts: int, n: int, out_dtype: Any,
              expert_weight: Callable[[int], Any], row_weights: Callable[[Any], Any]) -> Any:
    """x [S, K] through each row's expert, in float32 for low-precision inputs and rounded once to out_dtype.
    expert_weight(e): expert e's [N, K] weight (host); row_weights(index): the rows' [S, N, K] weights (device)."""
    wide = np.float32 if x.dtype in LOW_PRECISION or out_dtype in LOW_PRECISION else x.dtype
    xw = x.astype(wide, copy=False)
    if on_host(xp):
        out = np.empty((x.shape[0], n), dtype=wide)
        for e, rows in expert_groups(index, experts):
            out[rows] = xw[rows] @ expert_weight(e).astype(wide, copy=False).T
    else:
        out = xp.matmul(row_weights(index).astype(wide, copy=False), xw[:, :, None])[:, :, 0]
    if bias is not None:
        out += xp.take(bias, index, axis=0).astype(wide, copy=False)
    return out.astype(out_dtype, copy=False)


@portable("gathered_linear")
def gathered_linear(xp: Any, x: Any, weight: Any, index: Any, bias: Any = None, combine: Any = None) -> Any:
    experts, n, _ = weight.shape
    rows = _gathered(xp, x, index, bias, experts, n, x.dtype, lambda e: weight[e],
                     lambda rows: xp.take(weight, rows, axis=0))
    return rows if combine is None else combine_rows(xp, rows, combine)


@portable("gathered_quantized_linear")
def gathered_quantized_linear(xp: Any, x: Any, q: Any, scale: Any, zero: Any, index: Any, bias: Any = None,
                              combine: Any = None, *, bits: int, group_size: int, offset: bool = False) -> Any:
    """Each picked expert dequantized (once, on the host) as quantized_linear defines its weight."""
    experts, n = q.shape[:2]

    def expert_weight(e: int) -> Any:
        return dequantize(xp, q[e], scale[e], None if zero is None else zero[e], bits, group_size, offset)

    def row_weights(rows: Any) -> Any:
        s = rows.shape[0]
        parts = [xp.take(a, rows, axis=0).reshape(s * n, a.shape[-1]) if a is not None else None
                 for a in (q, scale, zero)]
        return dequantize(xp, *parts, bits, group_size, offset).reshape(s, n, -1)

    rows = _gathered(xp, x, index, bias, experts, n, scale.dtype, expert_weight, row_weights)
    return rows if combine is None else combine_rows(xp, rows, combine)
