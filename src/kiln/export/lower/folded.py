"""Ops whose result is fixed at export: index lists computed from int arguments alone."""

from __future__ import annotations

import torch

from kiln.export.lower.consteval import constant_data
from kiln.export.lower.registry import LowerContext, Unsupported, lowering

aten = torch.ops.aten


@lowering(aten.triu_indices.default, aten.tril_indices.default)
def triangle_indices(ctx: LowerContext, node: torch.fx.Node) -> int:
    """[2, N] coordinates of a triangle: a constant, since its arguments are ints."""
    data = constant_data(ctx, node)
    if data is None:
        raise Unsupported("triangle indices over symbolic sizes")
    return ctx.constant(data, node.name)

