"""Lowering of convolution and pooling."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering

aten = torch.ops.aten


def _ints(values, n: int, default: int | None = None) -> tuple[int, ...]:
    values = list(values) if values is not None else []
    if not values:
        if default is None:
            return ()
        values = [default]
    if len(values) == 1:
        values = values * n
    return tuple(int(v) for v in values)


@lowering(aten.convolution.default)
def convolution(ctx: LowerContext, node: torch.fx.Node) -> int:
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = node.args
    nsp = fake(w).dim() - 2
    if isinstance(padding, str):
        raise Unsupported(f"string padding {padding!r}")
    return ctx.emit("conv", [ctx.value(x), ctx.value(w), ctx.optional(b)], ctx.meta(node),
                    stride=_ints(stride, nsp), padding=_ints(padding, nsp), dilation=_ints(dilation, nsp),
                    groups=int(groups), transposed=bool(transposed),
                    output_padding=_ints(output_padding, nsp) if transposed else ())


MAX_POOL = {aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
            aten.max_pool2d.default: 2, aten.max_pool1d.default: 1}


@lowering(*MAX_POOL)
def max_pool(ctx: LowerContext, node: torch.fx.Node):
    nsp = MAX_POOL[node.target]
    args = list(node.args) + [None] * (6 - len(node.args))
    x, kernel, stride, padding, dilation, ceil_mode = args[:6]
    kernel = _ints(kernel, nsp)
    out = ctx.emit("max_pool", [ctx.value(x)], ctx.metas(node)[0] if "with_indices" in str(node.target)
                   else ctx.meta(node), kernel=kernel, stride=_ints(stride, nsp) or kernel,
                   padding=_ints(padding, nsp, 0), dilation=_ints(dilation, nsp, 1), ceil_mode=bool(ceil_mode))
    return [out, None] if "with_indices" in str(node.target) else out


AVG_POOL = {aten.avg_pool2d.default: 2, aten.avg_pool1d.default: 1, aten.avg_pool3d.default: 3}


@lowering(*AVG_POOL)
def avg_pool(ctx: LowerContext, node: torch.fx.Node) -> int:
    nsp = AVG_POOL[node.target]
    args = list(node.args) + [None] * (7 - len(node.args))
    x, kernel, stride, padding, ceil_mode, count_include_pad, divisor = args[:7]
    kernel = _ints(kernel, nsp)
    return ctx.emit("avg_pool", [ctx.value(x)], ctx.meta(node), kernel=kernel, stride=_ints(stride, nsp) or kernel,
                    padding=_ints(padding, nsp, 0), ceil_mode=bool(ceil_mode),
                    count_include_pad=True if count_include_pad is None else bool(count_include_pad),
                    divisor=None if divisor is None else int(divisor))


@lowering(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool1d.default
          if hasattr(aten, "_adaptive_avg_pool1d") else aten.adaptive_avg_pool1d.default,
          aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool3d.default)
def adaptive_avg_pool(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Adaptive pooling whose windows are uniform: a mean (output 1, any input size, symbolic too) or a plain
    average pool (static sizes that the output divides)."""
    x = node.args[0]
    out_size = [int(s) for s in node.args[1]]
    in_shape = list(fake(x).shape)
    nsp = len(out_size)
    spatial = in_shape[-nsp:]
    dtype, shape = ctx.meta(node)
    v = ctx.value(x)
    if all(o == 1 for o in out_size):
        dims = tuple(range(len(in_shape) - nsp, len(in_shape)))
        return ctx.emit("mean", [v], (dtype, shape), dims=dims, keepdim=True)
    if any(not isinstance(s, int) for s in spatial):
        raise Unsupported(f"adaptive average pooling to {out_size} over symbolic spatial sizes (only output 1 is "
                          "supported there)")
    if all(s % o == 0 for s, o in zip(spatial, out_size, strict=True)):
        kernel = tuple(s // o for s, o in zip(spatial, out_size, strict=True))
        return ctx.emit("avg_pool", [v], (dtype, shape), kernel=kernel, stride=kernel, padding=(0,) * nsp)
    return ctx.emit("adaptive_pool", [v], (dtype, shape), output_size=tuple(out_size), mode="avg")


@lowering(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default, aten.adaptive_max_pool1d.default)
def adaptive_max_pool(ctx: LowerContext, node: torch.fx.Node):
    """Adaptive max pooling (PyTorch's start/end window rule); the indices output is not supported."""
    out_size = tuple(int(s) for s in node.args[1])
    spatial = list(fake(node.args[0]).shape)[-len(out_size):]
    if any(not isinstance(s, int) for s in spatial):
        raise Unsupported(f"adaptive max pooling over symbolic spatial sizes {spatial}")
    out = ctx.emit("adaptive_pool", [ctx.value(node.args[0])], ctx.metas(node)[0], output_size=out_size, mode="max")
    return [out, None]
