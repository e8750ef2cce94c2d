"""Lowering of strided views: as_strided, diagonal, unfold. Each becomes one `as_strided` window over the input's
elements in row-major order, so the runtime can return a view (no copy) when its input is contiguous."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering, ndim_of, norm_dim

aten = torch.ops.aten

Dim = int | str


def _mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if a == 1 or b == 1:
        return b if a == 1 else a
    return f"({a})*({b})"


def _add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if a == 0 or b == 0:
        return b if a == 0 else a
    return f"({a}) + ({b})"


def contiguous_strides(shape: tuple) -> list[Dim]:
    strides: list[Dim] = []
    step: Dim = 1
    for size in reversed(shape):
        strides.append(step)
        step = _mul(step, size)
    return strides[::-1]


def _window(ctx: LowerContext, node: torch.fx.Node, x: int, size: tuple, stride: list, offset: Dim) -> int:
    return ctx.emit("as_strided", [x], ctx.meta(node), size=tuple(size), stride=tuple(stride), offset=offset)


@lowering(aten.as_strided.default, aten.as_strided_copy.default)
def as_strided(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Only windows over a contiguous input: strides into any other layout name memory that kiln does not keep."""
    x_arg, size, stride = node.args[:3]
    offset_arg = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    val = fake(x_arg)
    if not val.is_contiguous():
        raise Unsupported("as_strided over a non-contiguous tensor reads its memory layout, which kiln does not keep; "
                          "call .contiguous() before as_strided")
    base = val.storage_offset()
    offset = ctx.symint(offset_arg) if offset_arg is not None else 0
    if offset_arg is not None:
        if not isinstance(offset, int) or not isinstance(base, int):
            raise Unsupported("as_strided with a symbolic storage offset")
        offset -= base
        if offset < 0:
            raise Unsupported("as_strided window starting before its input (it reads the storage of a larger tensor)")
    sizes, strides = ctx.symints(size), ctx.symints(stride)
    if any(isinstance(s, int) and s < 0 for s in strides):
        raise Unsupported("as_strided with a negative stride")
    numel = val.numel()
    if all(isinstance(v, int) for v in (*sizes, *strides, numel)) and 0 not in sizes:
        last = offset + sum((n - 1) * s for n, s in zip(sizes, strides))
        if last >= numel:
            raise Unsupported(f"as_strided window reaches element {last} of a tensor of {numel} (it reads the "
                              "storage of a larger tensor, which kiln does not keep)")
    return _window(ctx, node, ctx.value(x_arg), sizes, list(strides), offset)


@lowering(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(ctx: LowerContext, node: torch.fx.Node) -> int:
    x_arg = node.args[0]
    offset = node.args[1] if len(node.args) > 1 else node.kwargs.get("offset", 0)
    ndim = ndim_of(x_arg)
    d1 = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim1", 0), ndim)
    d2 = norm_dim(node.args[3] if len(node.args) > 3 else node.kwargs.get("dim2", 1), ndim)
    if d1 == d2:
        raise Unsupported("diagonal with dim1 == dim2")
    x = ctx.value(x_arg)
    shape = ctx.shape(x)
    strides = contiguous_strides(shape)
    _, out_shape = ctx.meta(node)
    rest = [d for d in range(ndim) if d not in (d1, d2)]
    start = _mul(offset, strides[d2]) if offset >= 0 else _mul(-offset, strides[d1])
    if out_shape[-1] == 0:
        start = 0
    return _window(ctx, node, x, out_shape, [strides[d] for d in rest] + [_add(strides[d1], strides[d2])], start)


@lowering(aten.unfold.default, aten.unfold_copy.default)
def unfold(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Sliding windows of `size` every `step` along dim, as a new last dim."""
    x_arg, dim, size, step = node.args[:4]
    ndim = ndim_of(x_arg)
    if ndim == 0:
        raise Unsupported("unfold of a 0-d tensor")
    dim = norm_dim(dim, ndim)
    x = ctx.value(x_arg)
    strides = contiguous_strides(ctx.shape(x))
    _, out_shape = ctx.meta(node)
    window = list(strides)
    window[dim] = _mul(strides[dim], int(step))
    return _window(ctx, node, x, out_shape, window + [strides[dim]], 0)
