"""Lowering of scaled_dot_product_attention, kept whole for fused backend kernels."""

from __future__ import annotations

import torch

from kiln.export import torch_ops  # noqa: F401 - defines torch.ops.kiln.*
from kiln.export.lower.registry import LowerContext, Unsupported, lowering
from kiln.ir.dtypes import DType

aten = torch.ops.aten


@lowering(aten.scaled_dot_product_attention.default)
def sdpa(ctx: LowerContext, node: torch.fx.Node) -> int:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    if args.get("dropout_p", 0.0) not in (0, 0.0, None):
        raise Unsupported("attention dropout at inference (dropout_p must be 0)")
    dtype, shape = ctx.meta(node)
    mask_v = _mask(ctx, args.get("attn_mask"), dtype)
    scale = args.get("scale")
    return ctx.emit("sdpa", [ctx.value(args["query"]), ctx.value(args["key"]), ctx.value(args["value"]), mask_v],
                    (dtype, shape), causal=bool(args.get("is_causal", False)),
                    scale=None if scale is None else float(scale))


def _mask(ctx: LowerContext, mask: torch.fx.Node | None, dtype: DType) -> int:
    """An attention mask's value: absent, bool as it is, or a float mask in the attention's dtype."""
    mask_v = ctx.optional(mask)
    if mask is not None and ctx.dtype(mask_v).is_float and ctx.dtype(mask_v) != dtype:
        mask_v = ctx.cast(mask_v, dtype)
    return mask_v


@lowering(torch.ops.kiln.slot_attention.default)
def slot_attention(ctx: LowerContext, node: torch.fx.Node) -> int:
    names = ("q", "k_cache", "v_cache", "slots", "positions", "scale", "window", "sinks")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    if int(args.get("window", 0)) < 0:
        raise Unsupported(f"slot_attention window must be >= 0, got {args['window']}")
    inputs = [ctx.value(args[name]) for name in names[:5]]
    if args.get("sinks") is not None:
        inputs.append(ctx.value(args["sinks"]))
    return ctx.emit("slot_attention", inputs, ctx.meta(node), scale=float(args["scale"]),
                    window=int(args.get("window", 0)))


@lowering(torch.ops.kiln.sdpa.default)
def sdpa_sinks(ctx: LowerContext, node: torch.fx.Node) -> int:
    """kiln::sdpa (attention with per-head sink logits) as kiln's sdpa with its sinks input."""
    names = ("q", "k", "v", "mask", "sinks", "scale")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    dtype, shape = ctx.meta(node)
    inputs = [ctx.value(args["q"]), ctx.value(args["k"]), ctx.value(args["v"]), _mask(ctx, args.get("mask"), dtype),
              ctx.value(args["sinks"])]
    return ctx.emit("sdpa", inputs, (dtype, shape), causal=False, scale=float(args["scale"]))
