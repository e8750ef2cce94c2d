"""Lowering of ops that create tensors from numbers and shapes."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering

aten = torch.ops.aten


def _number(value) -> float:
    if isinstance(value, torch.fx.Node) or isinstance(value, (torch.SymInt, torch.SymFloat)):
        raise Unsupported("a fill value computed from shapes (symbolic scalar)")
    return float(value)


@lowering(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    args = list(node.args)
    if node.target == aten.arange.default:
        args = [0] + args
    start, end = args[0], args[1]
    step = args[2] if len(args) > 2 else 1
    numbers = [fake(a) for a in (start, end, step)]
    if dtype.is_float or any(isinstance(n, float) for n in numbers):
        if any(isinstance(n, (torch.fx.Node, torch.SymInt, torch.SymFloat)) for n in (start, step)):
            raise Unsupported("floating-point arange with a symbolic start or step")
        return ctx.emit("arange_float", [], (dtype, shape), start=float(start), end=float(fake(end))
                        if not isinstance(fake(end), torch.SymInt) else 0.0, step=float(step), dtype=dtype,
                        length=shape[0])
    return ctx.emit("arange", [], (dtype, shape), start=ctx.symint(start), end=ctx.symint(end),
                    step=ctx.symint(step), dtype=dtype)


@lowering(aten.full.default, aten.full_like.default, aten.new_full.default)
def full(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    value = node.args[2] if node.target == aten.new_full.default else node.args[1]
    return ctx.emit("full", [], (dtype, shape), shape=shape, value=_number(value), dtype=dtype)


FILLS = {aten.zeros.default: 0.0, aten.ones.default: 1.0, aten.zeros_like.default: 0.0,
         aten.ones_like.default: 1.0, aten.empty.memory_format: 0.0, aten.empty_like.default: 0.0,
         aten.new_zeros.default: 0.0, aten.new_ones.default: 1.0, aten.new_empty.default: 0.0,
         aten.empty_strided.default: 0.0}


@lowering(*FILLS)
def fill(ctx: LowerContext, node: torch.fx.Node) -> int:
    """zeros/ones/empty and their _like forms (empty is filled with zeros: kiln never exposes garbage)."""
    dtype, shape = ctx.meta(node)
    return ctx.emit("full", [], (dtype, shape), shape=shape, value=FILLS[node.target], dtype=dtype)


@lowering(aten.scalar_tensor.default)
def scalar_tensor(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    return ctx.emit("full", [], (dtype, shape), shape=shape, value=_number(node.args[0]), dtype=dtype)


@lowering(aten.fill.Scalar)
def fill_scalar(ctx: LowerContext, node: torch.fx.Node) -> int:
    """fill(x, value): a tensor like x holding value (capture usually decomposes it to full_like first)."""
    dtype, shape = ctx.meta(node)
    return ctx.emit("full", [], (dtype, shape), shape=shape, value=_number(node.args[1]), dtype=dtype)
