"""Lowering of gathers and functional scatters."""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from kiln.export.lower.consteval import constant_data
from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering, ndim_of, norm_dim
from kiln.export.lower.shape import _bound
from kiln.ir.dtypes import DType

aten = torch.ops.aten


def _index_value(ctx: LowerContext, arg) -> int:
    v = ctx.value(arg)
    if ctx.dtype(v) == DType.bool:
        raise Unsupported("boolean mask indexing (its result shape depends on the data)")
    return v


_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def _leading_count(index) -> object | None:
    """n where the index is arange(n) or arange(0, n, 1) (int): the leading n positions of a dim, else None."""
    if not isinstance(index, torch.fx.Node) or index.target not in _ARANGES:
        return None
    args = ([0] if index.target == aten.arange.default else []) + list(index.args)
    step = args[2] if len(args) > 2 else 1
    dtype = index.kwargs.get("dtype")
    if args[0] != 0 or step != 1 or (dtype is not None and dtype.is_floating_point):
        return None
    return args[1]


@lowering(aten.index_select.default)
def index_select(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Rows by index; by a leading arange, a slice (a view, no gather): how a model takes the first min(n, rows)
    rows of a dim without a slice bound torch.export would guard on (kiln.models.llm's slotted LM head)."""
    dim = norm_dim(node.args[1], ndim_of(node.args[0]))
    count = _leading_count(node.args[2])
    if count is not None:
        x = ctx.value(node.args[0])
        return ctx.emit("slice", [x], ctx.meta(node), dim=dim, start=0, end=_bound(ctx, count, ctx.shape(x)[dim]),
                        step=1)
    return ctx.emit("index_select", [ctx.value(node.args[0]), _index_value(ctx, node.args[2])], ctx.meta(node),
                    dim=dim)


@lowering(aten.gather.default)
def gather(ctx: LowerContext, node: torch.fx.Node) -> int:
    dim = norm_dim(node.args[1], ndim_of(node.args[0]))
    return ctx.emit("gather", [ctx.value(node.args[0]), _index_value(ctx, node.args[2])], ctx.meta(node), dim=dim)


@lowering(aten.embedding.default)
def embedding(ctx: LowerContext, node: torch.fx.Node) -> int:
    return ctx.emit("embedding", [ctx.value(node.args[0]), _index_value(ctx, node.args[1])], ctx.meta(node))


def _indices(ctx: LowerContext, indices, runtime_masks: bool = False) -> tuple[list[int], tuple[int, ...]]:
    """Index values and the dims they start at. A bool mask covers mask.ndim dims: a constant one becomes int
    indices (its nonzero coordinates); one computed at run time is kept as a mask where `runtime_masks` allows
    (index_put, whose result shape does not depend on the mask)."""
    values, dims = [], []
    d = 0
    for idx in indices:
        if idx is None:
            d += 1
        elif isinstance(idx, torch.fx.Node) and fake(idx).dtype in (torch.bool, torch.uint8):
            mask = constant_data(ctx, idx)
            if mask is not None:
                for k, coords in enumerate(torch.nonzero(mask.bool()).unbind(1)):
                    values.append(ctx.constant(coords.contiguous(), f"mask_{idx.name}_{k}"))
                    dims.append(d + k)
            elif runtime_masks:
                values.append(ctx.value(idx, DType.bool))
                dims.append(d)
            else:
                raise Unsupported("x[mask] with a mask computed at run time has a data-dependent shape, and kiln "
                                  "programs have shapes fixed by their inputs; use torch.where(mask, x, fill) or "
                                  "masked_fill, or a mask that is a constant of the model")
            d += fake(idx).dim()
        else:
            values.append(_index_value(ctx, idx))
            dims.append(d)
            d += 1
    return values, tuple(dims)


@lowering(aten.index.Tensor)
def index(ctx: LowerContext, node: torch.fx.Node) -> int:
    values, dims = _indices(ctx, node.args[1])
    masks = [m for m in node.args[1] if isinstance(m, torch.fx.Node) and fake(m).dtype in (torch.bool, torch.uint8)]
    if masks:  # bind the data-dependent length of the result to the (constant) masks' count
        count = int(constant_data(ctx, masks[0]).bool().sum())
        for size in node.meta["val"].shape:
            if free_unbacked_symbols(size):
                ctx.symbols.bind(size, count)
    return ctx.emit("index", [ctx.value(node.args[0])] + values, ctx.meta(node), dims=dims)


@lowering(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    values, dims = _indices(ctx, node.args[1], runtime_masks=True)
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
