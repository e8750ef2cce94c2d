"""Capture: torch.export (non-strict) and decomposition to Core ATen, keeping the ops backends run whole."""

from __future__ import annotations

import inspect
from typing import Any

import torch

aten = torch.ops.aten

KEEP_WHOLE = (
    aten.linear.default, aten.scaled_dot_product_attention.default, aten.layer_norm.default,
    aten.rms_norm.default, aten.gelu.default, aten.silu.default, aten.hardswish.default, aten.hardsigmoid.default,
)
"""Ops that Core ATen would decompose but that a backend runs better as one kernel."""


def decomposition_table() -> Any:
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        if op in table:
            del table[op]
    return table


class BoundMethod(torch.nn.Module):
    """Exposes `module.<function>` as `forward` so any method of a model can be exported.

    The wrapped module's parameters keep their names under the prefix `target.`, which the exporter strips, so
    the constants and state buffers of every method line up by name.
    """

    PREFIX = "target."

    def __init__(self, module: torch.nn.Module, function: str):
        super().__init__()
        self.target = module
        self._function = function

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.target, self._function)(*args, **kwargs)


def bound(module: torch.nn.Module, function: str) -> torch.nn.Module:
    """`module` itself for "forward", else a BoundMethod whose forward has the function's signature."""
    if function == "forward":
        return module
    fn = getattr(module, function, None)
    if not callable(fn):
        raise AttributeError(f"{type(module).__name__} has no method {function!r} to export")
    cls = type(f"Bound_{function}", (BoundMethod,), {})
    wrapper = cls(module, function)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    forward.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    wrapper.forward = forward  # type: ignore[method-assign]
    return wrapper


def capture(module: torch.nn.Module, args: tuple, kwargs: dict | None = None,
            dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
    ep = torch.export.export(module, tuple(args), kwargs=kwargs or None, dynamic_shapes=dynamic_shapes,
                             strict=False)
    return ep.run_decompositions(decomposition_table())


def user_dim_names(example_args: tuple, example_kwargs: dict | None, dynamic_shapes: Any,
                   placeholders: list[torch.fx.Node]) -> dict[str, str]:
    """torch symbol name (e.g. 's17') -> the name of the user's Dim at that position, where one was given."""
    if dynamic_shapes is None:
        return {}
    specs: list[Any] = []
    if isinstance(dynamic_shapes, dict) and example_kwargs is not None and all(
            k in example_kwargs for k in dynamic_shapes):
        specs = [dynamic_shapes.get(k) for k in example_kwargs]
    elif isinstance(dynamic_shapes, dict):
        specs = list(dynamic_shapes.values())
    else:
        specs = list(dynamic_shapes)
    names: dict[str, str] = {}
    for node, spec in zip(placeholders, specs):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or spec is None:
            continue
        items = spec.items() if isinstance(spec, dict) else enumerate(spec)
        for axis, dim in items:
            name = getattr(dim, "__name__", None)
            size = val.shape[axis] if axis < val.dim() else None
            if name and isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                names.setdefault(str(size.node.expr), name)
    return names
