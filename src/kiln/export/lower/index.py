"""Lowering of gathers and functional scatters."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, lowering, ndim_of, norm_dim
from kiln.export.lower.shape import _bound
from kiln.ir.dtypes import DType

aten = torch.ops.aten


def _index_value(ctx: LowerContext, arg) -> int:
    v = ctx.value(arg)
    if ctx.dtype(v) == DType.bool:
        raise Unsupported("boolean mask indexing (its result shape depends on the data)")
    return v


@lowering(aten.index_select.default)
def index_select(ctx: LowerContext, node: torch.fx.Node) -> int:
    dim = norm_dim(node.args[1], ndim_of(node.args[0]))
    return ctx.emit("index_select", [ctx.value(node.args[0]), _index_value(ctx, node.args[2])], ctx.meta(node),
                    dim=dim)


@lowering(aten.gather.default)
def gather(ctx: LowerContext, node: torch.fx.Node) -> int:
    dim = norm_dim(node.args[1], ndim_of(node.args[0]))
    return ctx.emit("gather", [ctx.value(node.args[0]), _index_value(ctx, node.args[2])], ctx.meta(node), dim=dim)


@lowering(aten.embedding.default)
def embedding(ctx: LowerContext, node: torch.fx.Node) -> int:
    return ctx.emit("embedding", [ctx.value(node.args[0]), _index_value(ctx, node.args[1])], ctx.meta(node))


def _indices(ctx: LowerContext, indices) -> tuple[list[int], tuple[int, ...]]:
    values, dims = [], []
    for d, idx in enumerate(indices):
        if idx is not None:
            values.append(_index_value(ctx, idx))
            dims.append(d)
    return values, tuple(dims)


@lowering(aten.index.Tensor)
def index(ctx: LowerContext, node: torch.fx.Node) -> int:
    values, dims = _indices(ctx, node.args[1])
    return ctx.emit("index", [ctx.value(node.args[0])] + values, ctx.meta(node), dims=dims)


@lowering(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    values, dims = _indices(ctx, node.args[1])
    accumulate = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))
    return ctx.emit("index_put", [ctx.value(node.args[0]), ctx.value(node.args[2], dtype)] + values,
                    (dtype, shape), dims=dims, accumulate=accumulate)


@lowering(aten.index_copy.default)
def index_copy(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    dim = norm_dim(node.args[1], ndim_of(node.args[0]))
    return ctx.emit("index_copy", [ctx.value(node.args[0]), _index_value(ctx, node.args[2]),
                                   ctx.value(node.args[3], dtype)], (dtype, shape), dim=dim)


@lowering(aten.slice_scatter.default)
def slice_scatter(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    args = list(node.args) + [None] * (6 - len(node.args))
    x_arg, src, dim, start, end, step = args[:6]
    dim = norm_dim(node.kwargs.get("dim", dim) or 0, ndim_of(x_arg))
    start, end = node.kwargs.get("start", start), node.kwargs.get("end", end)
    step = node.kwargs.get("step", step) or 1
    size = shape[dim]
    return ctx.emit("slice_scatter", [ctx.value(x_arg), ctx.value(src, dtype)], (dtype, shape), dim=dim,
                    start=_bound(ctx, start, size), end=size if end is None else _bound(ctx, end, size),
                    step=int(step))


@lowering(aten.select_scatter.default)
def select_scatter(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    x_arg, src, dim, index = node.args
    dim = norm_dim(dim, ndim_of(x_arg))
    size = shape[dim]
    index = ctx.symint(index)
    if isinstance(index, int) and index < 0:
        index = size + index if isinstance(size, int) else f"{size} - {-index}"
    end = index + 1 if isinstance(index, int) else f"{index} + 1"
    src_v = ctx.value(src, dtype)
    src_shape = tuple(1 if d == dim else s for d, s in enumerate(shape))
    src_v = ctx.reshape(src_v, src_shape)
    return ctx.emit("slice_scatter", [ctx.value(x_arg), src_v], (dtype, shape), dim=dim, start=index, end=end,
                    step=1)


@lowering(aten.scatter.src, aten.scatter.value, aten.scatter_add.default)
def scatter(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    x_arg, dim, idx, src = node.args[:4]
    dim = norm_dim(dim, ndim_of(x_arg))
    reduce = "add" if node.target == aten.scatter_add.default else "none"
    return ctx.emit("scatter", [ctx.value(x_arg), _index_value(ctx, idx), ctx.value(src, dtype)], (dtype, shape),
                    dim=dim, reduce=reduce)
