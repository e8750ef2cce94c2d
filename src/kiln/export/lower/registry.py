"""The lowering registry and the context handlers use to emit kiln nodes for one ATen node.

A handler is registered for one or more ATen targets (OpOverloads or Python operators); registering a target twice
is an error. It reads the fx node, emits kiln nodes through the context, and returns the kiln value(s) standing for
the node's result, or raises Unsupported with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.export.symbols import SymbolTable, Unsupported
from kiln.ir import ops
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Node, Value, ValueKind
from kiln.registry import register_once

Handler = Callable[["LowerContext", torch.fx.Node], Any]
HANDLERS: dict[Any, Handler] = {}

_TORCH_DTYPES = {
    torch.float32: DType.float32, torch.float16: DType.float16, torch.bfloat16: DType.bfloat16,
    torch.float64: DType.float64, torch.int8: DType.int8, torch.int16: DType.int16, torch.int32: DType.int32,
    torch.int64: DType.int64, torch.uint8: DType.uint8, torch.bool: DType.bool,
}
TORCH_OF = {v: k for k, v in _TORCH_DTYPES.items()}


def kiln_dtype(dtype: torch.dtype) -> DType:
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype} is not supported by kiln") from None


def lowering(*targets: Any) -> Callable[[Handler], Handler]:
    return register_once(HANDLERS, "lowering", targets)


def target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


class LowerContext:
    """Emits kiln values and nodes for one method; maps fx nodes to the kiln values that stand for them."""

    def __init__(self, symbols: SymbolTable, constant: Callable[[torch.Tensor, str], int]):
        self.symbols = symbols
        self._constant = constant  # (tensor, name) -> program constant index (deduplicated)
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.env: dict[torch.fx.Node, Any] = {}
        self.source = ""
        self._scalars: dict[tuple, int] = {}
        self.constant_data: dict[int, torch.Tensor] = {}

    # ---- values ----
    def new_value(self, name: str, dtype: DType, shape: tuple, kind: ValueKind = ValueKind.TEMP, ref: int = -1) -> int:
        self.values.append(Value(name, dtype, tuple(shape), kind, ref))
        return len(self.values) - 1

    def constant(self, tensor: torch.Tensor, name: str) -> int:
        t = tensor.detach().contiguous()
        ref = self._constant(t, name)
        v = self.new_value(name, kiln_dtype(t.dtype), tuple(t.shape), ValueKind.CONSTANT, ref)
        self.constant_data[v] = t  # export-time data, for ops whose result shape depends on it (consteval.py)
        return v

    def scalar(self, value: Any, dtype: DType) -> int:
        """A 0-d constant of dtype, shared by all uses of the same number in this method."""
        key = (repr(value), dtype)
        if key not in self._scalars:
            t = torch.tensor(value, dtype=TORCH_OF[dtype])
            self._scalars[key] = self.constant(t, f"scalar_{dtype.name}_{value}")
        return self._scalars[key]

    def value(self, arg: Any, dtype: DType | None = None) -> int:
        """The kiln value of a tensor argument, or a number as a 0-d constant of `dtype` (cast if given)."""
        if isinstance(arg, torch.fx.Node):
            v = self.env.get(arg)
            if v is None and isinstance(arg.meta.get("val"), (int, torch.SymInt)):
                return self.sym_scalar(arg.meta["val"], DType.int64 if dtype is None else dtype)
            if not isinstance(v, int):
                raise Unsupported(f"argument {arg.name} is not a tensor value")
            return self.cast(v, dtype) if dtype is not None else v
        if isinstance(arg, (bool, int, float)):
            if dtype is None:
                raise Unsupported(f"number {arg!r} used where a tensor is needed and no dtype is known")
            return self.scalar(arg, dtype)
        raise Unsupported(f"argument of type {type(arg).__name__} cannot be a tensor")

    def sym_scalar(self, size: int | torch.SymInt, dtype: DType) -> int:
        """A size (x.shape[0], x.numel()) used as a tensor: a 0-d value of dtype. A symbolic size becomes an arange
        of length one from the size's expression, so the runtime computes it from the bound symbols."""
        dim = self.symbols.dim(size)
        if isinstance(dim, int):
            return self.scalar(dim, dtype)
        v = self.emit("arange", [], (DType.int64, (1,)), start=dim, end=f"({dim}) + 1", step=1, dtype=DType.int64)
        return self.cast(self.reshape(v, ()), dtype)

    def optional(self, arg: Any, dtype: DType | None = None) -> int:
        return NO_VALUE if arg is None else self.value(arg, dtype)

    def dtype(self, v: int) -> DType:
        return self.values[v].dtype

    def shape(self, v: int) -> tuple:
        return self.values[v].shape

    def symint(self, arg: Any) -> int | str:
        """An int argument that may be symbolic (a SymInt-valued fx node or a SymInt)."""
        if isinstance(arg, torch.fx.Node):
            val = arg.meta.get("val")
            if isinstance(val, (int, torch.SymInt)):
                return self.symbols.dim(val)
            raise Unsupported(f"{arg.name} is not an integer")
        if isinstance(arg, (int, torch.SymInt)):
            return self.symbols.dim(arg)
        raise Unsupported(f"expected an int, got {type(arg).__name__}")

    def symints(self, args: Any) -> tuple:
        return tuple(self.symint(a) for a in args)

    # ---- nodes ----
    def emit(self, op: str, inputs: list[int], out: list[tuple[DType, tuple]] | tuple[DType, tuple], name: str = "",
             **attrs: Any) -> Any:
        """Append a node; returns its output value (or list of them when `out` is a list)."""
        opdef = ops.get(op)
        for key in attrs:
            if key not in opdef.attr_map:
                raise ValueError(f"kiln op {op!r} has no attribute {key!r}")
        outs_spec = out if isinstance(out, list) else [out]
        outputs = [self.new_value(f"{name or op}_{len(self.values)}", dt, shape) for dt, shape in outs_spec]
        self.nodes.append(Node(op, list(inputs), outputs, {k: v for k, v in attrs.items() if v is not None},
                               source=self.source))
        return outputs if isinstance(out, list) else outputs[0]

    def cast(self, v: int, dtype: DType) -> int:
        if self.dtype(v) == dtype:
            return v
        return self.emit("cast", [v], (dtype, self.shape(v)), dtype=dtype)

    def reshape(self, v: int, shape: tuple) -> int:
        if tuple(self.shape(v)) == tuple(shape):
            return v
        return self.emit("reshape", [v], (self.dtype(v), tuple(shape)), shape=tuple(shape))

    # ---- fx node metadata ----
    def meta(self, node: torch.fx.Node) -> tuple[DType, tuple]:
        """dtype and kiln shape of a node's (single tensor) result."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise Unsupported(f"{node.name} has no tensor result")
        return kiln_dtype(val.dtype), self.symbols.shape(val.shape)

    def metas(self, node: torch.fx.Node) -> list[tuple[DType, tuple]]:
        vals = node.meta.get("val")
        return [(kiln_dtype(v.dtype), self.symbols.shape(v.shape)) for v in vals]


def fake(arg: Any) -> Any:
    """The example value (FakeTensor, SymInt or number) of an argument."""
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def ndim_of(arg: Any) -> int:
    return fake(arg).dim()


def norm_dim(dim: int, ndim: int) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < max(ndim, 1):
        raise Unsupported(f"dimension {dim} out of range for a {ndim}-d tensor")
    return d


def norm_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    if dims is None:
        return ()
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(norm_dim(d, ndim) for d in dims))


__all__ = ["HANDLERS", "LowerContext", "Unsupported", "fake", "kiln_dtype", "lowering", "ndim_of", "norm_dim",
           "norm_dims", "target_name", "TORCH_OF"]
