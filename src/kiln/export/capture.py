"""Capture: torch.export (non-strict; strict where that fails) and decomposition to Core ATen, keeping the ops
backends run whole."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from kiln.errors import KilnError, TorchExportError, brief

aten = torch.ops.aten
log = logging.getLogger(__name__)

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
    """torch.export, decomposed to Core ATen (but KEEP_WHOLE).

    Non-strict export first: it runs the model's Python as Python, which traces most models. Where it fails inside
    torch (transformers' static cache under run_decompositions, a construct its tracing cannot follow), strict
    export (TorchDynamo) sometimes succeeds, so it is tried next and a warning says so; if it fails too,
    TorchExportError shows both errors. kiln's own errors are never retried: they are about the model, not the tracer.
    """
    try:
        return _export(module, args, kwargs, dynamic_shapes, strict=False)
    except KilnError:
        raise
    except Exception as non_strict:
        log.warning("non-strict torch.export of %s failed (%s); trying strict export", type(module).__name__,
                    brief(non_strict, lines=1, chars=200))
        try:
            ep = _export(module, args, kwargs, dynamic_shapes, strict=True)
        except KilnError:
            raise
        except Exception as strict:
            raise TorchExportError(type(module).__name__, non_strict, strict) from strict
        log.warning("strict torch.export of %s succeeded after non-strict export failed", type(module).__name__)
        return ep


def _export(module: torch.nn.Module, args: tuple, kwargs: dict | None, dynamic_shapes: Any,
            strict: bool) -> torch.export.ExportedProgram:
    ep = torch.export.export(module, _distinct(args), kwargs=kwargs or None, dynamic_shapes=dynamic_shapes,
                             strict=strict)
    return ep.run_decompositions(decomposition_table())


def _distinct(args: tuple) -> tuple:
    """The example arguments with a tensor given twice (an LSTM's h and c made from one zeros tensor) copied:
    torch.export would otherwise trace the two inputs as one, and the program would read one where the model reads
    the other."""
    seen: set[int] = set()
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and id(a) in seen:
            a = a.clone()
        seen.add(id(a))
        out.append(a)
    return tuple(out)


def _is_dim(x: Any) -> bool:
    return hasattr(x, "__name__") and type(x).__name__.endswith("Dim")


def _spec_leaves(spec: Any) -> list[Any]:
    """Per-tensor specs in input order: an {axis: Dim} dict or a sequence of Dim/None/int is one tensor's spec."""
    if spec is None or _is_dim(spec):
        return [spec]
    if isinstance(spec, dict):
        if all(isinstance(k, int) for k in spec):
            return [spec]
        return [leaf for v in spec.values() for leaf in _spec_leaves(v)]
    if isinstance(spec, (tuple, list)):
        if any(_is_dim(v) for v in spec) and all(v is None or isinstance(v, int) or _is_dim(v) for v in spec):
            return [spec]
        return [leaf for v in spec for leaf in _spec_leaves(v)]
    return [spec]


def user_dim_names(dynamic_shapes: Any, placeholders: list[torch.fx.Node]) -> dict[str, str]:
    """torch symbol name (e.g. 's17') -> the name of the user's Dim at that position, where one was given."""
    if dynamic_shapes is None:
        return {}
    names: dict[str, str] = {}
    for node, spec in zip(placeholders, _spec_leaves(dynamic_shapes)):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(spec, (dict, tuple, list)):
            continue
        items = spec.items() if isinstance(spec, dict) else enumerate(spec)
        for axis, dim in items:
            size = val.shape[axis] if isinstance(axis, int) and axis < val.dim() else None
            if _is_dim(dim) and isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                names.setdefault(str(size.node.expr), dim.__name__)
    return names
