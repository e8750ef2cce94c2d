"""Lowering of reducing scatters, masked_scatter, embedding_bag and repeat_interleave with a tensor of counts."""

from __future__ import annotations

import torch

from kiln.export.lower.consteval import constant_data
from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering, ndim_of, norm_dim
from kiln.export.lower.sort import fold
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE

aten = torch.ops.aten

_LEGACY = {"add": "sum", "multiply": "prod"}
REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _scatter_reduce(ctx: LowerContext, node: torch.fx.Node, x_arg, dim: int, index: int, src_arg, reduce: str,
                    include_self: bool) -> int:
    dtype, shape = ctx.meta(node)
    if reduce not in REDUCTIONS:
        raise Unsupported(f"scatter reduction {reduce!r} (kiln has {', '.join(REDUCTIONS)})")
    if dtype == DType.bool:
        raise Unsupported("reducing scatter into a bool tensor")
    return ctx.emit("scatter_reduce", [ctx.value(x_arg), index, ctx.value(src_arg, dtype)], (dtype, shape), dim=dim,
                    reduce=reduce, include_self=bool(include_self))


@lowering(aten.scatter_reduce.two)
def scatter_reduce(ctx: LowerContext, node: torch.fx.Node) -> int:
    x_arg, dim, idx, src, reduce = node.args[:5]
    include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
    return _scatter_reduce(ctx, node, x_arg, norm_dim(dim, ndim_of(x_arg)) if ndim_of(x_arg) else 0,
                           ctx.value(idx), src, reduce, include_self)


@lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_legacy(ctx: LowerContext, node: torch.fx.Node) -> int:
    """scatter(..., reduce='add'|'multiply'): the older spelling of scatter_reduce with include_self."""
    x_arg, dim, idx, src = node.args[:4]
    reduce = node.args[4] if len(node.args) > 4 else node.kwargs["reduce"]
    return _scatter_reduce(ctx, node, x_arg, norm_dim(dim, ndim_of(x_arg)) if ndim_of(x_arg) else 0,
                           ctx.value(idx), src, _LEGACY.get(reduce, reduce), True)


@lowering(aten.index_reduce.default)
def index_reduce(ctx: LowerContext, node: torch.fx.Node) -> int:
    """index_reduce along dim is scatter_reduce with the 1-d index broadcast over source's other dims."""
    x_arg, dim, idx, src, reduce = node.args[:5]
    include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
    ndim = ndim_of(x_arg)
    dim = norm_dim(dim, ndim) if ndim else 0
    src_shape = ctx.shape(ctx.value(src))
    index = ctx.value(idx)
    if ndim:
        index = ctx.reshape(index, tuple(s if d == dim else 1 for d, s in enumerate(src_shape)))
        index = ctx.emit("expand", [index], (ctx.dtype(index), src_shape), shape=src_shape)
    return _scatter_reduce(ctx, node, x_arg, dim, index, src, reduce, include_self)


@lowering(aten.masked_scatter.default)
def masked_scatter(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    x = ctx.value(node.args[0], dtype)
    if tuple(ctx.shape(x)) != tuple(shape):
        x = ctx.emit("expand", [x], (dtype, shape), shape=shape)
    return ctx.emit("masked_scatter", [x, ctx.value(node.args[1], DType.bool), ctx.value(node.args[2], dtype)],
                    (dtype, shape))


_BAG_MODES = {0: "sum", 1: "mean", 2: "max"}


@lowering(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(ctx: LowerContext, node: torch.fx.Node) -> list:
    """Only the first result (the bags) is computed; the other three are bookkeeping for the backward pass."""
    names = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
             "include_last_offset", "padding_idx")
    defaults = (None, None, None, False, 0, False, None, False, -1)
    args = {n: (node.args[i] if i < len(node.args) else node.kwargs.get(n, d))
            for i, (n, d) in enumerate(zip(names, defaults))}
    if ndim_of(args["indices"]) != 1:
        raise Unsupported("embedding_bag with indices that are not 1-d (PyTorch flattens 2-d input before this op)")
    dtype, shape = ctx.metas(node)[0]
    psw = args["per_sample_weights"]
    padding_idx = -1 if args["padding_idx"] is None else int(args["padding_idx"])
    out = ctx.emit("embedding_bag", [ctx.value(args["weight"]), ctx.value(args["indices"]),
                                     ctx.value(args["offsets"]), NO_VALUE if psw is None else ctx.value(psw, dtype)],
                   (dtype, shape), mode=_BAG_MODES[int(args["mode"])],
                   include_last_offset=bool(args["include_last_offset"]), padding_idx=padding_idx)
    return [out, None, None, None]


@lowering(aten.repeat_interleave.Tensor)
def repeat_interleave(ctx: LowerContext, node: torch.fx.Node) -> int:
    """The index list [0]*r0 + [1]*r1 + ...; its length is sum(repeats), so the counts must be known at export."""
    data = constant_data(ctx, node.args[0])
    if data is None:
        raise Unsupported("repeat_interleave with repeat counts computed at run time has a data-dependent length; "
                          "use an int repeat count, or counts that are constants of the model")
    return fold(ctx, node, torch.repeat_interleave(data))


@lowering(aten.masked_select.default)
def masked_select(ctx: LowerContext, node: torch.fx.Node) -> int:
    """x[mask] after broadcasting both: only with a mask known at export (else the length depends on data)."""
    mask = constant_data(ctx, node.args[1])
    if mask is None:
        raise Unsupported("masked_select with a mask computed at run time has a data-dependent length; use "
                          "torch.where(mask, x, fill) or a mask that is a constant of the model")
    dtype, _ = ctx.meta(node)
    shape = torch.broadcast_shapes(fake(node.args[0]).shape, mask.shape)
    coords = torch.nonzero(mask.expand(shape)).unbind(1)
    x = ctx.value(node.args[0])
    kshape = ctx.symbols.shape(shape)
    if tuple(ctx.shape(x)) != tuple(kshape):
        x = ctx.emit("expand", [x], (dtype, kshape), shape=kshape)
    ctx.symbols.bind(node.meta["val"].shape[0], len(coords[0]) if coords else 1)
    index = [ctx.constant(c.contiguous(), f"{node.name}_coords{k}") for k, c in enumerate(coords)]
    return ctx.emit("index", [x] + index, ctx.meta(node), dims=tuple(range(len(index))))
