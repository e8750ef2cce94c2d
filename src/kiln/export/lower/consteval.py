"""Export-time evaluation of values that depend only on constants.

A few ops have a result shape that depends on data (nonzero, boolean-mask indexing, repeat_interleave with a
tensor of counts). kiln programs have shapes fixed by their inputs, so such an op can be lowered only when its data
is known at export: a parameter, a buffer, a literal tensor in the code, or anything computed from those alone.
This module finds that data by running the fx subgraph behind a value with real tensors.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kiln.export.lower.registry import LowerContext

MAX_ELEMENTS = 1 << 24
"""Larger intermediate results are not evaluated at export (they would cost more than they save)."""

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def constant_data(ctx: LowerContext, arg: Any) -> torch.Tensor | None:
    """The tensor an fx argument holds when it depends on constants only, else None."""
    cache = _CACHE.setdefault(ctx, {})
    return _evaluate(ctx, arg, cache, 0)


def _evaluate(ctx: LowerContext, arg: Any, cache: dict, depth: int) -> Any:
    if isinstance(arg, (list, tuple)):
        items = [_evaluate(ctx, a, cache, depth) for a in arg]
        return None if any(i is None and a is not None for i, a in zip(items, arg)) else type(arg)(items)
    if not isinstance(arg, torch.fx.Node):
        return None if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)) else arg
    if arg in cache:
        return cache[arg]
    cache[arg] = None  # also guards against cycles
    result = None
    value = ctx.env.get(arg)
    val = arg.meta.get("val")
    if isinstance(value, int) and value in ctx.constant_data:
        result = ctx.constant_data[value]
    elif isinstance(val, (int, float, bool)) and not isinstance(val, torch.SymInt):
        result = val
    elif depth < 64 and arg.op == "call_function" and _pure(arg.target):
        if isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape) and \
                val.numel() > MAX_ELEMENTS:
            return None
        args = _evaluate(ctx, list(arg.args), cache, depth + 1)
        kwargs = {k: _evaluate(ctx, v, cache, depth + 1) for k, v in arg.kwargs.items()}
        if args is not None and all(v is not None or arg.kwargs[k] is None for k, v in kwargs.items()):
            try:
                result = arg.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - anything it cannot run is simply not a constant
                result = None
    cache[arg] = result
    return result


def _pure(target: Any) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded not in target.tags
    return target.__module__ in ("_operator", "operator")
