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
