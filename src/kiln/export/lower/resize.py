"""Lowering of resampling ops: upsampling (nearest, bilinear) and grid sampling."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering

aten = torch.ops.aten

UPSAMPLE = {aten.upsample_nearest2d.vec: ("nearest", 2), aten.upsample_bilinear2d.vec: ("linear", 2),
            aten.upsample_nearest1d.vec: ("nearest", 1), aten.upsample_nearest3d.vec: ("nearest", 3),
            aten.upsample_linear1d.vec: ("linear", 1), aten.upsample_trilinear3d.vec: ("linear", 3)}


@lowering(*UPSAMPLE)
def upsample(ctx: LowerContext, node: torch.fx.Node) -> int:
    """`.vec` forms: (x, output_size, [align_corners,] scale_factors). The output size comes from the node's shape
    (symbolic under dynamic shapes); given scale factors set the source-coordinate scale as PyTorch does."""
    mode, nsp = UPSAMPLE[node.target]
    dtype, shape = ctx.meta(node)
    args = list(node.args)
    align = False
    if mode == "linear":
        align = bool(node.kwargs.get("align_corners", args[2] if len(args) > 2 else False))
        scales = node.kwargs.get("scale_factors", args[3] if len(args) > 3 else None)
    else:
        scales = node.kwargs.get("scale_factors", args[2] if len(args) > 2 else None)
    if scales is not None and any(not isinstance(s, (int, float)) for s in scales):
        raise Unsupported("symbolic scale factors")
    return ctx.emit("upsample", [ctx.value(args[0])], (dtype, shape), size=tuple(shape[-nsp:]), mode=mode,
                    align_corners=align, scales=tuple(float(s) for s in scales) if scales else ())


GRID_MODES = {0: "bilinear", 1: "nearest"}
GRID_PADDING = {0: "zeros", 1: "border", 2: "reflection"}


@lowering(aten.grid_sampler_2d.default)
def grid_sampler_2d(ctx: LowerContext, node: torch.fx.Node) -> int:
    x, grid, mode, padding, align = node.args
    if mode not in GRID_MODES:
        raise Unsupported(f"grid_sample mode {mode} (bicubic); kiln supports bilinear and nearest")
    if not fake(grid).dtype.is_floating_point:
        raise Unsupported("grid_sample with a non-float grid")
    dtype, shape = ctx.meta(node)
    return ctx.emit("grid_sample", [ctx.value(x), ctx.value(grid, dtype)], (dtype, shape), mode=GRID_MODES[mode],
                    padding_mode=GRID_PADDING[padding], align_corners=bool(align))
