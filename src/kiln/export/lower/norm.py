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


@lowering(aten._native_batch_norm_legit.default)
def batch_norm_training(ctx: LowerContext, node: torch.fx.Node):
    raise Unsupported("batch norm in training mode; call model.eval() before export")


@lowering(aten.native_group_norm.default)
def group_norm(ctx: LowerContext, node: torch.fx.Node):
    x, weight, bias, _n, _c, _hw, groups, eps = node.args
    out = ctx.emit("group_norm", [ctx.value(x), ctx.optional(weight), ctx.optional(bias)], ctx.metas(node)[0],
                   groups=int(groups), eps=float(eps))
    return [out, None, None]


@lowering(aten._native_batch_norm_legit.no_stats)
def batch_norm_batch_stats(ctx: LowerContext, node: torch.fx.Node):
    """Batch norm over the batch's own statistics without running stats (instance_norm lowers to this over a
    [1, N*C, ...] view): per channel over dims 0 and 2..., which is group_norm with one group per channel of the
    input with dims 0 and 1 swapped, then weight and bias per channel."""
    x, weight, bias, _training, _momentum, eps = node.args
    dtype, shape = ctx.metas(node)[0]
    v = ctx.value(x)
    if shape[0] == 1:
        out = ctx.emit("group_norm", [v, ctx.optional(weight), ctx.optional(bias)], (dtype, shape),
                       groups=_static(shape[1]), eps=float(eps))
        return [out, None, None]
    perm = (1, 0) + tuple(range(2, len(shape)))
    swapped = (shape[1], shape[0]) + tuple(shape[2:])
    t = ctx.emit("permute", [v], (dtype, swapped), perm=perm)
    t = ctx.emit("group_norm", [t], (dtype, swapped), groups=1, eps=float(eps))
    out = ctx.emit("permute", [t], (dtype, shape), perm=perm)
    channel = (1, shape[1]) + (1,) * (len(shape) - 2)
    if weight is not None:
        out = ctx.emit("mul", [out, ctx.reshape(ctx.value(weight, dtype), channel)], (dtype, shape))
    if bias is not None:
        out = ctx.emit("add", [out, ctx.reshape(ctx.value(bias, dtype), channel)], (dtype, shape))
    return [out, None, None]


def _static(dim: int | str) -> int:
    if isinstance(dim, int):
        return dim
    raise Unsupported(f"batch norm over a symbolic number of channels ({dim})")
