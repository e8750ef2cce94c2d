"""Lowering of reductions, scans and softmax."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, lowering, ndim_of, norm_dim, norm_dims
from kiln.ir.dtypes import DType

aten = torch.ops.aten

REDUCE = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "amax", aten.amin.default: "amin",
          aten.any.dims: "any", aten.any.dim: "any", aten.prod.dim_int: "prod", aten.sum.default: "sum",
          aten.mean.default: "mean", aten.any.default: "any", aten.all.default: "all", aten.all.dim: "all",
          aten.all.dims: "all", aten.prod.default: "prod"}


@lowering(*REDUCE)
def reduce(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    op = REDUCE[node.target]
    ndim = ndim_of(node.args[0])
    dims = norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), ndim)
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    x = ctx.value(node.args[0])
    if op in ("any", "all"):
        x = ctx.cast(x, DType.bool)
    elif op in ("sum", "prod") and ctx.dtype(x) in (DType.bool, DType.int8, DType.int16, DType.int32, DType.uint8):
        x = ctx.cast(x, dtype)  # PyTorch accumulates small integers in the result dtype (int64)
    elif op in ("mean", "sum", "prod") and ctx.dtype(x) != dtype:
        x = ctx.cast(x, dtype)  # an explicit dtype= argument
    if ndim == 0:
        dims = ()
    return ctx.emit(op, [x], (dtype, shape), dims=dims, keepdim=keepdim)


@lowering(aten.var.correction, aten.var.dim)
def var(ctx: LowerContext, node: torch.fx.Node) -> int:
    ndim = ndim_of(node.args[0])
    dims = norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), ndim)
    if node.target == aten.var.dim:
        unbiased = node.args[2] if len(node.args) > 2 else node.kwargs.get("unbiased", True)
        correction = 1.0 if unbiased else 0.0
        keepdim = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
    else:
        c = node.kwargs.get("correction", 1)
        correction = 1.0 if c is None else float(c)
        keepdim = node.kwargs.get("keepdim", False)
    return ctx.emit("var", [ctx.value(node.args[0])], ctx.meta(node), dims=dims, keepdim=bool(keepdim),
                    correction=correction)


@lowering(aten.argmax.default, aten.argmin.default)
def arg_reduce(ctx: LowerContext, node: torch.fx.Node) -> int:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    ndim = ndim_of(node.args[0])
    op = "argmax" if node.target == aten.argmax.default else "argmin"
    return ctx.emit(op, [ctx.value(node.args[0])], ctx.meta(node),
                    dim=None if dim is None or ndim == 0 else norm_dim(dim, ndim), keepdim=bool(keepdim))


@lowering(aten.cumsum.default)
def cumsum(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    x = ctx.value(node.args[0])
    if ctx.dtype(x).is_float and ctx.dtype(x) != dtype:
        x = ctx.cast(x, dtype)
    return ctx.emit("cumsum", [x], (dtype, shape), dim=norm_dim(node.args[1], ndim_of(node.args[0])))


@lowering(aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int)
def softmax(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    op = "softmax" if node.target in (aten._softmax.default, aten.softmax.int) else "log_softmax"
    x = ctx.value(node.args[0], dtype)
    ndim = ndim_of(node.args[0])
    if ndim == 0:
        raise Unsupported("softmax of a 0-d tensor")
    return ctx.emit(op, [x], (dtype, shape), dim=norm_dim(node.args[1], ndim))


@lowering(aten.linalg_vector_norm.default)
def vector_norm(ctx: LowerContext, node: torch.fx.Node) -> int:
    """||x||_ord over dims (all dims when none), composed of kiln ops: F.normalize and clip_grad_norm use it.

    Half-precision inputs are reduced in float32 and rounded back, as PyTorch's CPU kernel accumulates.
    """
    args = list(node.args) + [None] * (4 - len(node.args))
    ord_ = node.kwargs.get("ord", 2 if args[1] is None else args[1])
    dim = node.kwargs.get("dim", args[2])
    keepdim = bool(node.kwargs.get("keepdim", args[3] or False))
    dtype, shape = ctx.meta(node)
    ndim = ndim_of(node.args[0])
    dims = () if ndim == 0 else norm_dims(dim, ndim)
    if not dtype.is_float:
        raise Unsupported(f"vector norm with result dtype {dtype.name} (kiln supports floating point)")
    work = DType.float32 if dtype in (DType.float16, DType.bfloat16) else dtype
    x = ctx.value(node.args[0], work)
    full = (work, ctx.shape(x))
    out = (work, shape)
    ord_ = float(ord_)
    if ord_ == 0:
        nonzero = ctx.emit("ne", [x, ctx.scalar(0, work)], (DType.bool, ctx.shape(x)))
        result = ctx.emit("sum", [ctx.cast(nonzero, work)], out, dims=dims, keepdim=keepdim)
    elif ord_ == 2:
        sq = ctx.emit("mul", [x, x], full)
        result = ctx.emit("sqrt", [ctx.emit("sum", [sq], out, dims=dims, keepdim=keepdim)], out)
    else:
        mag = ctx.emit("abs", [x], full)
        if ord_ in (float("inf"), float("-inf")):
            result = ctx.emit("amax" if ord_ > 0 else "amin", [mag], out, dims=dims, keepdim=keepdim)
        elif ord_ == 1:
            result = ctx.emit("sum", [mag], out, dims=dims, keepdim=keepdim)
        else:
            powered = ctx.emit("pow", [mag, ctx.scalar(ord_, work)], full)
            total = ctx.emit("sum", [powered], out, dims=dims, keepdim=keepdim)
            result = ctx.emit("pow", [total, ctx.scalar(1.0 / ord_, work)], out)
    return ctx.cast(result, dtype)


@lowering(aten.max.dim, aten.min.dim)
def max_min_dim(ctx: LowerContext, node: torch.fx.Node) -> list[int]:
    """(values, indices) along a dim: one reduction and one arg-reduction."""
    ndim = ndim_of(node.args[0])
    dim = norm_dim(node.args[1], ndim)
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    (vdt, vshape), (idt, ishape) = ctx.metas(node)
    x = ctx.value(node.args[0])
    is_max = node.target == aten.max.dim
    dims = () if ndim == 0 else (dim,)
    values = ctx.emit("amax" if is_max else "amin", [x], (vdt, vshape), dims=dims, keepdim=keepdim)
    indices = ctx.emit("argmax" if is_max else "argmin", [x], (idt, ishape), dim=None if ndim == 0 else dim,
                       keepdim=keepdim)
    return [values, indices]


@lowering(aten.max.default, aten.min.default)
def max_min_all(ctx: LowerContext, node: torch.fx.Node) -> int:
    op = "amax" if node.target == aten.max.default else "amin"
    return ctx.emit(op, [ctx.value(node.args[0])], ctx.meta(node), dims=(), keepdim=False)


@lowering(aten.var_mean.correction)
def var_mean(ctx: LowerContext, node: torch.fx.Node) -> list[int]:
    """(var, mean) over dims: the two existing reductions (std_mean adds a sqrt after capture)."""
    ndim = ndim_of(node.args[0])
    dims = () if ndim == 0 else norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), ndim)
    c = node.kwargs.get("correction", 1)
    keepdim = bool(node.kwargs.get("keepdim", False))
    (vdt, vshape), (mdt, mshape) = ctx.metas(node)
    x = ctx.value(node.args[0])
    var_v = ctx.emit("var", [x], (vdt, vshape), dims=dims, keepdim=keepdim, correction=1.0 if c is None else float(c))
    return [var_v, ctx.emit("mean", [x], (mdt, mshape), dims=dims, keepdim=keepdim)]
