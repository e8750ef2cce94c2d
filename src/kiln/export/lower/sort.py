"""Lowering of sorting and searching: sort/argsort, topk, searchsorted/bucketize, nonzero."""

from __future__ import annotations

import torch

from kiln.export.lower.consteval import constant_data
from kiln.export.lower.registry import LowerContext, Unsupported, fake, kiln_dtype, lowering, ndim_of, norm_dim

aten = torch.ops.aten


def _arg(node: torch.fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


@lowering(aten.sort.default, aten.sort.stable)
def sort(ctx: LowerContext, node: torch.fx.Node) -> list[int]:
    """Always stable: a stable order is one of the orders an unstable sort may give, and the one eager gives on CPU."""
    if node.target == aten.sort.stable:
        dim, descending = node.kwargs.get("dim", -1), node.kwargs.get("descending", False)
    else:
        dim, descending = _arg(node, 1, "dim", -1), _arg(node, 2, "descending", False)
    ndim = ndim_of(node.args[0])
    return ctx.emit("sort", [ctx.value(node.args[0])], ctx.metas(node), dim=norm_dim(dim, ndim) if ndim else 0,
                    descending=bool(descending))


@lowering(aten.topk.default)
def topk(ctx: LowerContext, node: torch.fx.Node) -> list[int]:
    """sorted=False gives the sorted result too: PyTorch leaves the order unspecified then."""
    ndim = ndim_of(node.args[0])
    dim, largest = _arg(node, 2, "dim", -1), _arg(node, 3, "largest", True)
    return ctx.emit("topk", [ctx.value(node.args[0])], ctx.metas(node), k=ctx.symint(node.args[1]),
                    dim=norm_dim(dim, ndim) if ndim else 0, largest=bool(largest))


def _search(ctx: LowerContext, node: torch.fx.Node, sorted_arg, values_arg, right: bool, sorter) -> int:
    dtype, shape = ctx.meta(node)
    common = kiln_dtype(torch.promote_types(fake(sorted_arg).dtype, fake(values_arg).dtype)
                        if isinstance(fake(values_arg), torch.Tensor) else fake(sorted_arg).dtype)
    sorted_v = ctx.value(sorted_arg, common)
    if sorter is not None:
        sorted_v = ctx.emit("gather", [sorted_v, ctx.value(sorter)], (common, ctx.shape(sorted_v)),
                            dim=max(len(ctx.shape(sorted_v)) - 1, 0))
    return ctx.emit("searchsorted", [sorted_v, ctx.value(values_arg, common)], (dtype, shape), right=bool(right),
                    dtype=dtype)


@lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(ctx: LowerContext, node: torch.fx.Node) -> int:
    side = node.kwargs.get("side")
    right = bool(node.kwargs.get("right", False)) or side == "right"
    return _search(ctx, node, node.args[0], node.args[1], right, node.kwargs.get("sorter"))


@lowering(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(ctx: LowerContext, node: torch.fx.Node) -> int:
    """bucketize(x, boundaries, right) is searchsorted(boundaries, x, right) over 1-d boundaries."""
    return _search(ctx, node, node.args[1], node.args[0], bool(node.kwargs.get("right", False)), None)


@lowering(aten.nonzero_static.default)
def nonzero_static(ctx: LowerContext, node: torch.fx.Node) -> int:
    size = _arg(node, 1, "size", None)
    fill_value = _arg(node, 2, "fill_value", -1)
    return ctx.emit("nonzero_static", [ctx.value(node.args[0])], ctx.meta(node), size=int(size),
                    fill_value=int(fill_value))


def fold(ctx: LowerContext, node: torch.fx.Node, result: torch.Tensor) -> int:
    """A data-dependent result computed at export from constant data: bind its sizes, store it as a constant."""
    val = node.meta.get("val")
    for size, actual in zip(val.shape, result.shape):
        ctx.symbols.bind(size, actual)
    return ctx.constant(result, f"{node.name}_folded")


@lowering(aten.nonzero.default)
def nonzero(ctx: LowerContext, node: torch.fx.Node) -> int:
    data = constant_data(ctx, node.args[0])
    if data is None:
        raise Unsupported("nonzero of a tensor computed at run time has a data-dependent number of rows, and kiln "
                          "programs have shapes fixed by their inputs; use torch.nonzero_static(x, size=N) (padded "
                          "with -1), or express the computation with a mask (torch.where, masked_fill)")
    return fold(ctx, node, torch.nonzero(data))
