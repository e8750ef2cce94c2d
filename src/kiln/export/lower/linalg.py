"""Lowering of matrix products: mm, bmm, addmm, linear, matmul."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, lowering

aten = torch.ops.aten


@lowering(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    return ctx.emit("matmul", [ctx.value(node.args[0], dtype), ctx.value(node.args[1], dtype)], (dtype, shape))


@lowering(aten.linear.default)
def linear(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return ctx.emit("linear", [ctx.value(node.args[0]), ctx.value(node.args[1]), ctx.optional(bias)], (dtype, shape))


@lowering(aten.addmm.default)
def addmm(ctx: LowerContext, node: torch.fx.Node) -> int:
    """beta * input + alpha * (m1 @ m2)."""
    dtype, shape = ctx.meta(node)
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    prod = ctx.emit("matmul", [ctx.value(node.args[1], dtype), ctx.value(node.args[2], dtype)], (dtype, shape))
    if alpha != 1:
        prod = ctx.emit("mul", [prod, ctx.scalar(alpha, dtype)], (dtype, shape))
    bias = ctx.value(node.args[0], dtype)
    if beta == 0:
        return prod
    if beta != 1:
        bias = ctx.emit("mul", [bias, ctx.scalar(beta, dtype)], (dtype, ctx.shape(bias)))
    return ctx.emit("add", [prod, bias], (dtype, shape))
