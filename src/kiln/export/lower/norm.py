"""Lowering of normalization layers, kept whole so backends can run them fused."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, lowering

aten = torch.ops.aten


@lowering(aten.layer_norm.default, aten.native_layer_norm.default)
def layer_norm(ctx: LowerContext, node: torch.fx.Node):
    args = list(node.args) + [None] * (5 - len(node.args))
    x, shape, weight, bias, eps = args[:5]
    eps = node.kwargs.get("eps", 1e-5 if eps is None else eps)
    native = node.target == aten.native_layer_norm.default
    meta = ctx.metas(node)[0] if native else ctx.meta(node)
    out = ctx.emit("layer_norm", [ctx.value(x), ctx.optional(weight), ctx.optional(bias)], meta,
                   axes=len(shape), eps=float(eps))
    return [out, None, None] if native else out


@lowering(aten.rms_norm.default)
def rms_norm(ctx: LowerContext, node: torch.fx.Node) -> int:
    args = list(node.args) + [None] * (4 - len(node.args))
    x, shape, weight, eps = args[:4]
    eps = node.kwargs.get("eps", eps)
    weight = node.kwargs.get("weight", weight)
    return ctx.emit("rms_norm", [ctx.value(x), ctx.optional(weight)], ctx.meta(node), axes=len(shape),
                    eps=None if eps is None else float(eps))


@lowering(aten._native_batch_norm_legit_no_training.default)
def batch_norm(ctx: LowerContext, node: torch.fx.Node):
    x, weight, bias, mean, var, _momentum, eps = node.args
    out = ctx.emit("batch_norm", [ctx.value(x), ctx.optional(weight), ctx.optional(bias), ctx.value(mean),
                                  ctx.value(var)], ctx.metas(node)[0], eps=float(eps))
    return [out, None, None]


@lowering(aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit.default)
def batch_norm_training(ctx: LowerContext, node: torch.fx.Node):
    raise Unsupported("batch norm in training mode; call model.eval() before export")
