"""Lowering of scans other than cumsum: cumprod, cummax/cummin (with indices), logcumsumexp."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, lowering, ndim_of, norm_dim

aten = torch.ops.aten


def _dim(node: torch.fx.Node) -> int:
    ndim = ndim_of(node.args[0])
    return norm_dim(node.args[1], ndim) if ndim else 0


@lowering(aten.cumprod.default)
def cumprod(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Integers and bool accumulate in the result dtype (int64), as PyTorch does; dtype= casts first."""
    dtype, shape = ctx.meta(node)
    return ctx.emit("cumprod", [ctx.value(node.args[0], dtype)], (dtype, shape), dim=_dim(node))


@lowering(aten.cummax.default, aten.cummin.default)
def cummax(ctx: LowerContext, node: torch.fx.Node) -> list[int]:
    op = "cummax" if node.target == aten.cummax.default else "cummin"
    return ctx.emit(op, [ctx.value(node.args[0])], ctx.metas(node), dim=_dim(node))


@lowering(aten.logcumsumexp.default)
def logcumsumexp(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    return ctx.emit("logcumsumexp", [ctx.value(node.args[0], dtype)], (dtype, shape), dim=_dim(node))
