"""Lowering of view and shape ops. Every op that only changes the shape becomes one `reshape`."""

from __future__ import annotations

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, fake, lowering, ndim_of, norm_dim

aten = torch.ops.aten

INT64_MAX = 9223372036854775807

RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.flatten.using_ints,
            aten.view_copy.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims, aten.unsqueeze_copy.default,
            aten.unflatten.int)


@lowering(*RESHAPES)
def reshape(ctx: LowerContext, node: torch.fx.Node) -> int:
    _, shape = ctx.meta(node)
    return ctx.reshape(ctx.value(node.args[0]), shape)


@lowering(aten.permute.default, aten.permute_copy.default)
def permute(ctx: LowerContext, node: torch.fx.Node) -> int:
    ndim = ndim_of(node.args[0])
    perm = tuple(norm_dim(d, ndim) for d in node.args[1])
    x = ctx.value(node.args[0])
    if perm == tuple(range(ndim)):
        return x
    return ctx.emit("permute", [x], ctx.meta(node), perm=perm)


@lowering(aten.transpose.int, aten.t.default, aten.transpose_copy.int, aten.t_copy.default)
def transpose(ctx: LowerContext, node: torch.fx.Node) -> int:
    ndim = ndim_of(node.args[0])
    x = ctx.value(node.args[0])
    if ndim < 2:
        return x
    a, b = (node.args[1], node.args[2]) if len(node.args) > 2 else (0, 1)
    perm = list(range(ndim))
    a, b = norm_dim(a, ndim), norm_dim(b, ndim)
    perm[a], perm[b] = perm[b], perm[a]
    if a == b:
        return x
    return ctx.emit("permute", [x], ctx.meta(node), perm=tuple(perm))


@lowering(aten.expand.default, aten.expand_copy.default)
def expand(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    x = ctx.value(node.args[0])
    if tuple(ctx.shape(x)) == tuple(shape):
        return x
    return ctx.emit("expand", [x], (dtype, shape), shape=shape)


def _bound(ctx: LowerContext, value, size) -> int | str:
    """A slice bound clamped to [0, size] as PyTorch does, symbolically when it must be."""
    if value is None:
        return 0
    v = ctx.symint(value)
    if isinstance(v, int) and isinstance(size, int):
        if v < 0:
            v += size
        return min(max(v, 0), size)
    if isinstance(v, int):
        if v >= INT64_MAX // 2:
            return size
        return f"max(0, {size} - {-v})" if v < 0 else f"min({v}, {size})"
    return f"min(max(0, {v}), {size})"


@lowering(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(ctx: LowerContext, node: torch.fx.Node) -> int:
    args = list(node.args) + [None] * (5 - len(node.args))
    x_arg, dim, start, end, step = args[:5]
    ndim = ndim_of(x_arg)
    dim = norm_dim(dim or 0, ndim)
    x = ctx.value(x_arg)
    size = ctx.shape(x)[dim]
    start_b = _bound(ctx, start, size)
    end_b = size if end is None else _bound(ctx, end, size)
    step = 1 if step is None else int(step)
    if start_b == 0 and end_b == size and step == 1:
        return x
    return ctx.emit("slice", [x], ctx.meta(node), dim=dim, start=start_b, end=end_b, step=step)


@lowering(aten.select.int, aten.select_copy.int)
def select(ctx: LowerContext, node: torch.fx.Node) -> int:
    x_arg, dim, index = node.args
    ndim = ndim_of(x_arg)
    dim = norm_dim(dim, ndim)
    x = ctx.value(x_arg)
    size = ctx.shape(x)[dim]
    index = ctx.symint(index)
    if isinstance(index, int) and index < 0:
        if not isinstance(size, int):
            start = f"{size} - {-index}"
        else:
            start = size + index
    else:
        start = index
    end = start + 1 if isinstance(start, int) else f"{start} + 1"
    dtype, shape = ctx.meta(node)
    piece_shape = tuple(1 if d == dim else s for d, s in enumerate(ctx.shape(x)))
    piece = ctx.emit("slice", [x], (dtype, piece_shape), dim=dim, start=start, end=end, step=1)
    return ctx.reshape(piece, shape)


@lowering(aten.cat.default, aten.concat.default)
def cat(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    tensors = [t for t in node.args[0] if not (fake(t).dim() == 1 and fake(t).shape[0] == 0)]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = norm_dim(dim, len(shape))
    inputs = [ctx.value(t, dtype) for t in tensors]
    if len(inputs) == 1:
        return inputs[0]
    return ctx.emit("cat", inputs, (dtype, shape), dim=dim)


@lowering(aten.split_with_sizes.default, aten.split.Tensor, aten.split_with_sizes_copy.default,
          aten.split_copy.Tensor, aten.unbind.int, aten.chunk.default)
def split(ctx: LowerContext, node: torch.fx.Node) -> list[int]:
    """Each piece is a slice (the pieces are views in PyTorch and in NumPy)."""
    x_arg = node.args[0]
    ndim = ndim_of(x_arg)
    unbind = node.target == aten.unbind.int
    dim = node.args[1] if unbind and len(node.args) > 1 else (node.args[2] if len(node.args) > 2 else 0)
    dim = norm_dim(node.kwargs.get("dim", dim), ndim)
    x = ctx.value(x_arg)
    outs, start = [], 0
    for dtype, shape in ctx.metas(node):
        length = 1 if unbind else shape[dim]
        if not isinstance(length, int) or not isinstance(start, int):
            raise Unsupported("split into pieces of symbolic size")
        piece_shape = tuple(length if d == dim else s for d, s in enumerate(ctx.shape(x)))
        piece = ctx.emit("slice", [x], (dtype, piece_shape), dim=dim, start=start, end=start + length, step=1)
        outs.append(ctx.reshape(piece, shape))
        start += length
    return outs


@lowering(aten.flip.default)
def flip(ctx: LowerContext, node: torch.fx.Node) -> int:
    ndim = ndim_of(node.args[0])
    dims = tuple(sorted(norm_dim(d, ndim) for d in node.args[1]))
    return ctx.emit("flip", [ctx.value(node.args[0])], ctx.meta(node), dims=dims)


PAD_MODES = {aten.constant_pad_nd.default: "constant", aten.reflection_pad1d.default: "reflect",
             aten.reflection_pad2d.default: "reflect", aten.reflection_pad3d.default: "reflect",
             aten.replication_pad1d.default: "replicate", aten.replication_pad2d.default: "replicate",
             aten.replication_pad3d.default: "replicate"}


@lowering(*PAD_MODES)
def pad(ctx: LowerContext, node: torch.fx.Node) -> int:
    mode = PAD_MODES[node.target]
    pads = tuple(int(p) for p in node.args[1])
    value = float(node.args[2]) if mode == "constant" and len(node.args) > 2 else 0.0
    return ctx.emit("pad", [ctx.value(node.args[0])], ctx.meta(node), pads=pads, mode=mode, value=value)


@lowering(aten.tril.default, aten.triu.default)
def triangle(ctx: LowerContext, node: torch.fx.Node) -> int:
    op = "tril" if node.target == aten.tril.default else "triu"
    diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
    return ctx.emit(op, [ctx.value(node.args[0])], ctx.meta(node), diagonal=int(diagonal))


@lowering(aten.repeat.default)
def repeat(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Tile: view x as [1, s0, 1, s1, ...], expand to [r0, s0, r1, s1, ...], then merge each pair."""
    dtype, shape = ctx.meta(node)
    reps = [ctx.symint(r) for r in node.args[1]]
    x = ctx.value(node.args[0])
    sizes = (1,) * (len(reps) - len(ctx.shape(x))) + tuple(ctx.shape(x))
    paired = tuple(d for s in sizes for d in (1, s))
    expanded = tuple(d for r, s in zip(reps, sizes) for d in (r, s))
    x = ctx.reshape(x, paired)
    x = ctx.emit("expand", [x], (dtype, expanded), shape=expanded)
    return ctx.reshape(x, shape)
