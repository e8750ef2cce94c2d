"""Lowering of pairwise distances (cdist, pdist) to existing kiln ops, following PyTorch's two algorithms."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering
from kiln.ir.dtypes import DType

aten = torch.ops.aten

EUCLID_MM_ROWS = 25
"""PyTorch computes p=2 distances through a matrix product when either side has more rows than this."""


def _pnorm(ctx: LowerContext, diff: int, p: float, out: tuple[DType, tuple]) -> int:
    """||diff||_p over the last dim, the way PyTorch's direct cdist/pdist kernels define it (p=0 counts)."""
    dtype, full = ctx.dtype(diff), (ctx.dtype(diff), ctx.shape(diff))
    last = (len(ctx.shape(diff)) - 1,)
    if p == 0:
        nonzero = ctx.emit("ne", [diff, ctx.scalar(0, dtype)], (DType.bool, ctx.shape(diff)))
        return ctx.emit("sum", [ctx.cast(nonzero, dtype)], out, dims=last)
    if p == 2:
        return ctx.emit("sqrt", [ctx.emit("sum", [ctx.emit("mul", [diff, diff], full)], out, dims=last)], out)
    mag = ctx.emit("abs", [diff], full)
    if p == float("inf"):
        return ctx.emit("amax", [mag], out, dims=last)
    if p == 1:
        return ctx.emit("sum", [mag], out, dims=last)
    total = ctx.emit("sum", [ctx.emit("pow", [mag, ctx.scalar(p, dtype)], full)], out, dims=last)
    return ctx.emit("pow", [total, ctx.scalar(1.0 / p, dtype)], out)


def _euclidean_mm(ctx: LowerContext, x1: int, x2: int, out: tuple[DType, tuple]) -> int:
    """sqrt(max(|a|^2 - 2 a.b + |b|^2, 0)) as one matmul of padded operands, exactly as PyTorch's _euclidean_dist."""
    dtype = ctx.dtype(x1)

    def padded(x: int, scale: float | None) -> tuple[int, int]:
        shape = ctx.shape(x)
        norm_shape = tuple(shape[:-1]) + (1,)
        norm = ctx.emit("sum", [ctx.emit("mul", [x, x], (dtype, shape))], (dtype, norm_shape), dims=(len(shape) - 1,),
                        keepdim=True)
        ones = ctx.emit("full", [], (dtype, norm_shape), shape=norm_shape, value=1.0, dtype=dtype)
        if scale is not None:
            x = ctx.emit("mul", [x, ctx.scalar(scale, dtype)], (dtype, shape))
        return x, norm, ones

    a, a_norm, a_ones = padded(x1, -2.0)
    b, b_norm, b_ones = padded(x2, None)
    s1, s2 = ctx.shape(x1), ctx.shape(x2)
    width = _width(s1[-1])
    a = ctx.emit("cat", [a, a_norm, a_ones], (dtype, tuple(s1[:-1]) + (width,)), dim=len(s1) - 1)
    b = ctx.emit("cat", [b, b_ones, b_norm], (dtype, tuple(s2[:-1]) + (width,)), dim=len(s2) - 1)
    perm = tuple(range(len(s2) - 2)) + (len(s2) - 1, len(s2) - 2)
    bt = ctx.emit("permute", [b], (dtype, tuple(s2[:-2]) + (width, s2[-2])), perm=perm)
    prod = ctx.emit("matmul", [a, bt], out)
    return ctx.emit("sqrt", [ctx.emit("clamp", [prod], out, min=0.0)], out)


def _width(m) -> int | str:
    return m + 2 if isinstance(m, int) else f"({m}) + 2"


@lowering(aten._cdist_forward.default)
def cdist(ctx: LowerContext, node: torch.fx.Node) -> int:
    x1_arg, x2_arg, p = node.args[:3]
    mode = node.args[3] if len(node.args) > 3 else node.kwargs.get("compute_mode")
    mode = 0 if mode is None else int(mode)
    dtype, shape = ctx.meta(node)
    if not dtype.is_float:
        raise Unsupported(f"cdist of {dtype.name} tensors")
    x1, x2 = ctx.value(x1_arg), ctx.value(x2_arg)
    r1, r2 = fake(x1_arg).shape[-2], fake(x2_arg).shape[-2]
    many = not isinstance(r1, int) or not isinstance(r2, int) or r1 > EUCLID_MM_ROWS or r2 > EUCLID_MM_ROWS
    if p == 2 and (mode == 1 or (mode == 0 and many)) and 0 not in fake(x1_arg).shape + fake(x2_arg).shape:
        return _euclidean_mm(ctx, x1, x2, (dtype, shape))
    s1, s2 = ctx.shape(x1), ctx.shape(x2)
    a = ctx.reshape(x1, tuple(s1[:-1]) + (1, s1[-1]))
    b = ctx.reshape(x2, tuple(s2[:-2]) + (1,) + tuple(s2[-2:]))
    diff = ctx.emit("sub", [a, b], (dtype, tuple(shape) + (s1[-1],)))
    return _pnorm(ctx, diff, float(p), (dtype, shape))


@lowering(aten._pdist_forward.default)
def pdist(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Distances between rows i < j in row-major pair order: two constant gathers, a difference, a p-norm."""
    x_arg = node.args[0]
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 2.0)
    dtype, shape = ctx.meta(node)
    n, m = fake(x_arg).shape
    if not isinstance(n, int):
        raise Unsupported("pdist over a symbolic number of rows (its pair list is built at export)")
    rows, cols = torch.triu_indices(n, n, 1)
    x = ctx.value(x_arg)
    pairs = rows.shape[0]
    sdim = ctx.shape(x)[1]
    a = ctx.emit("index_select", [x, ctx.constant(rows, "pdist_rows")], (dtype, (pairs, sdim)), dim=0)
    b = ctx.emit("index_select", [x, ctx.constant(cols, "pdist_cols")], (dtype, (pairs, sdim)), dim=0)
    diff = ctx.emit("sub", [a, b], (dtype, (pairs, sdim)))
    return _pnorm(ctx, diff, float(p), (dtype, shape))
