"""The shape and dtype rule of every op: what a node's outputs must be, given its inputs and attributes.

Why: the loader's structural checks (reader.py) prove that a node's value ids and attribute types are in range, but
not that the shapes fit: a file whose table was edited could declare a [3, 4] linear over a [5, 7] weight, and the
damage would surface inside a kernel (a NumPy error, or an allocation of exabytes). The verifier (verify.py) runs
these rules over every method at concrete bindings of its symbols and compares what they give with what the file
declares. The writer runs the same verifier, so kiln never writes a file its own loader rejects.

Rules work on concrete shapes (tuples of ints; the verifier resolves symbolic dims and SYMINT attributes first),
so each is plain arithmetic. A rule raises RuleError saying which requirement failed; it returns one Spec per
output. Families of ops share one rule (a registry, not an if-chain).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.ir.dtypes import DType
from kiln.registry import register_once

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    """A value at a concrete binding: its dtype and shape."""

    dtype: DType
    shape: Shape

    def __str__(self) -> str:
        return f"{self.dtype.name}{list(self.shape)}"


class RuleError(ValueError):
    """A node's inputs or attributes break its op's rule."""


Rule = Callable[[list["Spec | None"], dict[str, Any]], list[Spec]]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    return register_once(RULES, "shape rule", names)


CHOICES: dict[tuple[str, str], frozenset[str]] = {
    ("adaptive_pool", "mode"): frozenset({"avg", "max"}),
    ("conv", "activation"): frozenset({"none", "clamp", "hardswish"}),
    ("div", "rounding_mode"): frozenset({"none", "trunc", "floor"}),
    ("embedding_bag", "mode"): frozenset({"sum", "mean", "max"}),
    ("gated_activation", "activation"): frozenset({"silu", "gelu", "gelu_tanh"}),
    ("gated_linear", "activation"): frozenset({"silu", "gelu", "gelu_tanh"}),
    ("add_rms_norm_linear", "activation"): frozenset({"", "silu", "gelu", "gelu_tanh"}),
    ("gated_quantized_linear", "activation"): frozenset({"silu", "gelu", "gelu_tanh"}),
    ("gated_gathered_linear", "activation"): frozenset({"silu", "gelu", "gelu_tanh"}),
    ("add_rms_norm_quantized_linear", "activation"): frozenset({"", "silu", "gelu", "gelu_tanh"}),
    ("gelu", "approximate"): frozenset({"none", "tanh"}),
    ("grid_sample", "mode"): frozenset({"bilinear", "nearest"}),
    ("grid_sample", "padding_mode"): frozenset({"zeros", "border", "reflection"}),
    ("pad", "mode"): frozenset({"constant", "reflect", "replicate"}),
    ("scatter", "reduce"): frozenset({"none", "add"}),
    ("scatter_reduce", "reduce"): frozenset({"sum", "mean", "prod", "amax", "amin"}),
    ("upsample", "mode"): frozenset({"nearest", "linear"}),
}
"""The values a string attribute may take (the op's doc lists them; a kernel meets no other)."""


def need(condition: bool, message: str) -> None:
    if not condition:
        raise RuleError(message)


def numel(shape: Shape) -> int:
    return math.prod(shape)


def broadcast(*shapes: Shape) -> Shape:
    """NumPy's broadcasting of shapes (right-aligned; size 1 stretches)."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        sizes = {s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0}
        sizes.discard(1)
        need(len(sizes) <= 1, f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def axis(dim: int, rank: int, what: str = "dim") -> int:
    need(0 <= dim < max(rank, 1), f"{what} {dim} is out of range for rank {rank}")
    return dim


def present(specs: list[Spec | None], count: int) -> list[Spec]:
    need(all(s is not None for s in specs[:count]), "a required input is absent")
    return specs  # type: ignore[return-value]


def same_dtype(*specs: Spec | None) -> DType:
    dtypes = {s.dtype for s in specs if s is not None}
    need(len(dtypes) == 1, f"inputs of different dtypes ({', '.join(sorted(d.name for d in dtypes))})")
    return dtypes.pop()


def floating(spec: Spec, what: str = "input") -> None:
    need(spec.dtype.is_float, f"{what} is {spec.dtype.name}, not a float dtype")


def integral(spec: Spec, what: str = "input") -> None:
    need(not spec.dtype.is_float, f"{what} is {spec.dtype.name}, not an integer or bool dtype")


def indices(*specs: Spec | None) -> None:
    """Index tensors are integers (not floats, not bools)."""
    for spec in specs:
        need(spec is None or (not spec.dtype.is_float and spec.dtype != DType.bool),
             f"an index is {spec.dtype.name if spec else ''}, not an integer dtype")


def numeric(spec: Spec, what: str = "input") -> None:
    need(spec.dtype != DType.bool, f"{what} is bool, not a number")


# ---- elementwise ----

UNARY_FLOAT = ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "elu", "erf", "erfc", "erfinv", "exp",
               "exp2", "expm1", "gelu", "hardsigmoid", "hardswish", "leaky_relu", "log", "log10", "log1p", "log2",
               "reciprocal", "rsqrt", "sigmoid", "silu", "sin", "sinh", "sqrt", "tan", "tanh")
"""Functions of real numbers: a float input (the exporter casts integers first, as PyTorch promotes them)."""
UNARY_NUMBER = ("abs", "ceil", "clamp", "floor", "neg", "relu", "round", "sign", "trunc")


@rule(*UNARY_FLOAT)
def _unary_float(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    floating(x)
    return [x]


@rule(*UNARY_NUMBER)
def _unary_number(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    numeric(x)
    return [x]


@rule("copy")
def _copy(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    return [x]


@rule("bitwise_not")
def _bitwise_not(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    integral(x)
    return [x]


@rule("isinf", "isnan", "logical_not")
def _unary_bool(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    return [Spec(DType.bool, x.shape)]


@rule("add", "sub", "mul", "div", "pow", "maximum", "minimum", "fmod", "remainder")
def _binary(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    a, b = present(ins, 2)
    return [Spec(same_dtype(a, b), broadcast(a.shape, b.shape))]


@rule("atan2")
def _binary_float(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    a, b = present(ins, 2)
    floating(a)
    return [Spec(same_dtype(a, b), broadcast(a.shape, b.shape))]


@rule("bitwise_and", "bitwise_or", "bitwise_xor")
def _binary_bits(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    a, b = present(ins, 2)
    integral(a)
    return [Spec(same_dtype(a, b), broadcast(a.shape, b.shape))]


@rule("eq", "ne", "lt", "le", "gt", "ge")
def _compare(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    a, b = present(ins, 2)
    same_dtype(a, b)
    return [Spec(DType.bool, broadcast(a.shape, b.shape))]


@rule("logical_and", "logical_or", "logical_xor")
def _logical(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    a, b = present(ins, 2)
    return [Spec(DType.bool, broadcast(a.shape, b.shape))]


@rule("where")
def _where(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    cond, a, b = present(ins, 3)
    need(cond.dtype == DType.bool, f"cond is {cond.dtype.name}, not bool")
    return [Spec(same_dtype(a, b), broadcast(cond.shape, a.shape, b.shape))]


@rule("cast")
def _cast(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    return [Spec(attrs["dtype"], x.shape)]


@rule("gated_activation")
def _gated_activation(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    gate, up = present(ins, 2)
    need(gate.shape == up.shape, f"gate {list(gate.shape)} and up {list(up.shape)} differ")
    return [Spec(same_dtype(gate, up), gate.shape)]


# ---- reductions and scans ----

def reduced(x: Spec, dims: Sequence[int], keepdim: bool) -> Shape:
    rank = len(x.shape)
    dims = tuple(dims) or tuple(range(rank))
    for d in dims:
        axis(d, rank)
    need(len(set(dims)) == len(dims), f"dims {list(dims)} repeat a dim")
    if keepdim:
        return tuple(1 if i in dims else s for i, s in enumerate(x.shape))
    return tuple(s for i, s in enumerate(x.shape) if i not in dims)


def accumulated(dtype: DType) -> DType:
    """Sums and products of integers or bools accumulate in int64, as PyTorch's do."""
    return dtype if dtype.is_float else DType.int64


def reduction(dtype_of: Callable[[DType], DType], float_only: bool = False) -> Rule:
    """The rule of a reduction over `dims` (all when empty), the output's dtype from the input's."""
    def fn(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
        (x,) = present(ins, 1)
        if float_only:
            floating(x)
        return [Spec(dtype_of(x.dtype), reduced(x, attrs["dims"], attrs["keepdim"]))]
    return fn


rule("amax", "amin")(reduction(lambda d: d))
rule("mean", "var")(reduction(lambda d: d, float_only=True))
rule("sum", "prod")(reduction(accumulated))
rule("all", "any")(reduction(lambda d: DType.bool))


@rule("argmax", "argmin")
def _arg_reduce(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    dim = attrs["dim"]
    if dim is None:
        shape = tuple(1 for _ in x.shape) if attrs["keepdim"] else ()
    else:
        shape = reduced(x, (dim,), attrs["keepdim"])
    return [Spec(DType.int64, shape)]


@rule("logcumsumexp", "softmax", "log_softmax")
def _along(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    axis(attrs["dim"], len(x.shape))
    floating(x)
    return [x]


@rule("cumsum", "cumprod")
def _scan_accumulated(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    axis(attrs["dim"], len(x.shape))
    return [Spec(accumulated(x.dtype), x.shape)]


@rule("cummax", "cummin", "sort")
def _along_with_indices(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    axis(attrs["dim"], len(x.shape))
    return [x, Spec(DType.int64, x.shape)]


@rule("topk")
def _topk(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    dim, k = axis(attrs["dim"], len(x.shape)), attrs["k"]
    size = x.shape[dim] if x.shape else 1
    need(0 <= k <= size, f"k {k} is outside [0, {size}]")
    shape = tuple(k if i == dim else s for i, s in enumerate(x.shape))
    return [Spec(x.dtype, shape), Spec(DType.int64, shape)]


@rule("route_experts")
def _route_experts(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (logits,) = present(ins, 1)
    need(len(logits.shape) >= 1 and logits.dtype.is_float, "logits must be a float tensor of at least one dim")
    k, experts = attrs["k"], logits.shape[-1]
    need(0 < k <= experts if isinstance(experts, int) else k > 0, f"k {k} is outside [1, {experts}]")
    need(attrs["dtype"].is_float, f"the weights' dtype must be a float type, not {attrs['dtype']}")
    shape = tuple(logits.shape[:-1]) + (k,)
    return [Spec(attrs["dtype"], shape), Spec(DType.int64, shape)]


@rule("add_rms_norm_route_experts")
def _add_rms_norm_route_experts(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, residual, norm_weight, weight, bias = ins + [None] * (5 - len(ins))
    need(x is not None and residual is not None and weight is not None, "a required input is absent")
    need(x.shape == residual.shape, f"x {list(x.shape)} and residual {list(residual.shape)} differ")
    need(attrs["axes"] == 1, "the norm is over the last dim (axes 1)")
    normalized(x, norm_weight, 1)
    rows = Spec(x.dtype, (numel(x.shape[:-1]), x.shape[-1]))
    _, experts = linear_rows(rows, weight, bias)
    weights, indices = _route_experts([Spec(same_dtype(x, weight, bias), (rows.shape[0], experts))], attrs)
    return [x, x, weights, indices]


# ---- creation ----

@rule("arange")
def _arange(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    start, end, step = attrs["start"], attrs["end"], attrs["step"]
    need(step != 0, "step is 0")
    return [Spec(attrs["dtype"], (max(0, -(-(end - start) // step)),))]


@rule("arange_float")
def _arange_float(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    need(attrs["length"] >= 0, f"length {attrs['length']} is negative")
    return [Spec(attrs["dtype"], (attrs["length"],))]


@rule("full")
def _full(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    shape = tuple(attrs["shape"])
    need(all(d >= 0 for d in shape), f"shape {list(shape)} has a negative dim")
    return [Spec(attrs["dtype"], shape)]


# ---- shapes and layout ----

@rule("reshape")
def _reshape(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    shape = list(attrs["shape"])
    need(shape.count(-1) <= 1 and all(d >= -1 for d in shape), f"shape {shape} is not a shape")
    if -1 in shape:
        rest = numel(tuple(d for d in shape if d != -1))
        need(rest > 0 and numel(x.shape) % rest == 0, f"{list(x.shape)} cannot be reshaped to {shape}")
        shape[shape.index(-1)] = numel(x.shape) // rest
    need(numel(tuple(shape)) == numel(x.shape), f"{list(x.shape)} ({numel(x.shape)} elements) cannot be reshaped "
                                                f"to {shape}")
    return [Spec(x.dtype, tuple(shape))]


@rule("expand")
def _expand(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    shape = list(attrs["shape"])
    need(len(shape) >= len(x.shape), f"cannot expand rank {len(x.shape)} to rank {len(shape)}")
    offset = len(shape) - len(x.shape)
    for i, d in enumerate(shape):
        own = x.shape[i - offset] if i >= offset else None
        if d == -1:
            need(own is not None, "-1 in a new leading dim")
            shape[i] = own
        else:
            need(d >= 0 and (own is None or own in (1, d)), f"cannot expand {list(x.shape)} to {list(attrs['shape'])}")
    return [Spec(x.dtype, tuple(shape))]


@rule("permute")
def _permute(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    perm = list(attrs["perm"])
    need(sorted(perm) == list(range(len(x.shape))), f"perm {perm} is not a permutation of rank {len(x.shape)}")
    return [Spec(x.dtype, tuple(x.shape[p] for p in perm))]


def slice_length(size: int, start: int, end: int, step: int) -> int:
    need(step >= 1, f"step {step} is not positive")
    return len(range(*slice(start, end, step).indices(size)))


@rule("slice")
def _slice(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    dim = axis(attrs["dim"], len(x.shape))
    length = slice_length(x.shape[dim], attrs["start"], attrs["end"], attrs["step"])
    return [Spec(x.dtype, x.shape[:dim] + (length,) + x.shape[dim + 1:])]


@rule("slice_scatter")
def _slice_scatter(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, source = present(ins, 2)
    dim = axis(attrs["dim"], len(x.shape))
    length = slice_length(x.shape[dim], attrs["start"], attrs["end"], attrs["step"])
    expected = x.shape[:dim] + (length,) + x.shape[dim + 1:]
    need(source.shape == expected, f"source {list(source.shape)} is not the slice's {list(expected)}")
    return [Spec(same_dtype(x, source), x.shape)]


@rule("cat")
def _cat(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    xs = present(ins, len(ins))
    need(len(xs) >= 1, "no inputs")
    dtype = same_dtype(*xs)
    # PyTorch lets a 1-d empty tensor join anything; it contributes nothing
    parts = [x for x in xs if not (x.shape == (0,) and any(len(o.shape) != 1 for o in xs))] or xs[:1]
    rank = len(parts[0].shape)
    dim = axis(attrs["dim"], rank)
    for x in parts:
        need(len(x.shape) == rank and all(a == b for i, (a, b) in enumerate(zip(x.shape, parts[0].shape)) if i != dim),
             f"shapes {' and '.join(str(list(x.shape)) for x in parts)} do not join along dim {dim}")
    total = sum(x.shape[dim] for x in parts)
    return [Spec(dtype, parts[0].shape[:dim] + (total,) + parts[0].shape[dim + 1:])]


@rule("flip")
def _flip(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    for d in attrs["dims"]:
        axis(d, len(x.shape))
    return [x]


@rule("tril", "triu")
def _triangle(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    need(len(x.shape) >= 2, f"rank {len(x.shape)} < 2")
    return [x]


@rule("pad")
def _pad(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    pads = list(attrs["pads"])
    need(len(pads) % 2 == 0 and len(pads) // 2 <= len(x.shape), f"pads {pads} do not fit rank {len(x.shape)}")
    shape = list(x.shape)
    for i in range(len(pads) // 2):
        d = len(shape) - 1 - i
        shape[d] += pads[2 * i] + pads[2 * i + 1]
        need(shape[d] >= 0, f"pads {pads} crop dim {d} below 0")
        if attrs["mode"] == "reflect":
            need(max(pads[2 * i], pads[2 * i + 1]) < x.shape[d], f"reflect pads {pads} reach past dim {d}")
        elif attrs["mode"] == "replicate":
            need(x.shape[d] > 0, f"replicate pads an empty dim {d}")
    return [Spec(x.dtype, tuple(shape))]


@rule("as_strided")
def _as_strided(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    size, stride, offset = tuple(attrs["size"]), tuple(attrs["stride"]), attrs["offset"]
    need(len(size) == len(stride), f"size {list(size)} and stride {list(stride)} differ in rank")
    need(all(s >= 0 for s in size) and all(s >= 0 for s in stride) and offset >= 0, "negative size, stride or offset")
    if numel(size):
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        need(last < numel(x.shape), f"the window reaches element {last} of {numel(x.shape)}")
    return [Spec(x.dtype, size)]


# ---- indexing ----

@rule("index_select")
def _index_select(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, index = present(ins, 2)
    dim = axis(attrs["dim"], len(x.shape))
    need(len(index.shape) <= 1 and not index.dtype.is_float, f"index {index} is not a 1-d integer tensor")
    return [Spec(x.dtype, x.shape[:dim] + (numel(index.shape),) + x.shape[dim + 1:])]


@rule("index")
def _index(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, *indices = present(ins, len(ins))
    dims = list(attrs["dims"])
    need(len(dims) == len(indices) and dims == sorted(set(dims)), f"dims {dims} do not match {len(indices)} indices")
    for d in dims:
        axis(d, len(x.shape))
    need(all(not i.dtype.is_float and i.dtype != DType.bool for i in indices), "an index is not an integer tensor")
    picked = broadcast(*(i.shape for i in indices)) if indices else ()
    # as aten.index: indexed dims next to each other put the result where they were, else in front
    adjacent = dims == list(range(dims[0], dims[0] + len(dims))) if dims else True
    rest = [s for i, s in enumerate(x.shape) if i not in dims]
    if not dims:
        return [x]
    if adjacent:
        head = [s for i, s in enumerate(x.shape) if i < dims[0]]
        return [Spec(x.dtype, tuple(head) + picked + tuple(rest[len(head):]))]
    return [Spec(x.dtype, picked + tuple(rest))]


@rule("index_put")
def _index_put(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, values, *indices = present(ins, len(ins))
    need(len(attrs["dims"]) == len(indices), f"dims {list(attrs['dims'])} do not match {len(indices)} indices")
    for d in attrs["dims"]:
        axis(d, len(x.shape))
    return [Spec(same_dtype(x, values), x.shape)]


@rule("index_copy")
def _index_copy(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, index, source = present(ins, 3)
    dim = axis(attrs["dim"], len(x.shape))
    indices(index)
    need(len(index.shape) <= 1, f"index {index} is not 1-d")
    expected = x.shape[:dim] + (numel(index.shape),) + x.shape[dim + 1:]
    need(source.shape == expected or (not x.shape and numel(source.shape) == numel(index.shape)),
         f"source {list(source.shape)} is not {list(expected)}")
    return [Spec(same_dtype(x, source), x.shape)]


@rule("gather")
def _gather(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, index = present(ins, 2)
    axis(attrs["dim"], len(x.shape))
    indices(index)
    need(len(index.shape) == len(x.shape), f"index rank {len(index.shape)} is not x's {len(x.shape)}")
    return [Spec(x.dtype, index.shape)]


@rule("scatter", "scatter_reduce")
def _scatter(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, index, source = present(ins, 3)
    axis(attrs["dim"], len(x.shape))
    indices(index)
    need(len(index.shape) == len(x.shape), f"index rank {len(index.shape)} is not x's {len(x.shape)}")
    return [Spec(same_dtype(x, source), x.shape)]


@rule("masked_scatter")
def _masked_scatter(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, mask, source = present(ins, 3)
    need(mask.dtype == DType.bool, f"mask is {mask.dtype.name}")
    return [Spec(same_dtype(x, source), broadcast(x.shape, mask.shape))]


@rule("nonzero_static")
def _nonzero_static(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    need(attrs["size"] >= 0, f"size {attrs['size']} is negative")
    return [Spec(DType.int64, (attrs["size"], len(x.shape)))]


@rule("searchsorted")
def _searchsorted(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    ordered, values = present(ins, 2)
    need(len(ordered.shape) >= 1, "sorted is a scalar")
    return [Spec(attrs["dtype"], values.shape)]


@rule("embedding")
def _embedding(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    weight, ids = present(ins, 2)
    indices(ids)
    need(len(weight.shape) == 2, f"weight {weight} is not 2-d")
    return [Spec(weight.dtype, ids.shape + weight.shape[1:])]


@rule("embedding_bag")
def _embedding_bag(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    weight, ids, offsets = present(ins, 3)[:3]
    indices(ids, offsets)
    need(len(weight.shape) == 2 and len(offsets.shape) == 1, "weight is not 2-d or offsets not 1-d")
    bags = offsets.shape[0] - (1 if attrs["include_last_offset"] else 0)
    need(bags >= 0, "no bags")
    return [Spec(weight.dtype, (bags, weight.shape[1]))]


# ---- linear algebra ----

def linear_rows(x: Spec, weight: Spec, bias: Spec | None) -> tuple[Shape, int]:
    need(len(weight.shape) == 2 and len(x.shape) >= 1, f"weight {weight} is not 2-d or x is a scalar")
    need(x.shape[-1] == weight.shape[1], f"x {list(x.shape)} does not multiply weight {list(weight.shape)}")
    need(bias is None or bias.shape == (weight.shape[0],), f"bias {bias} is not [{weight.shape[0]}]")
    return x.shape[:-1], weight.shape[0]


@rule("linear")
def _linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, weight, bias = present(ins, 2) + [None] * (3 - len(ins))
    lead, n = linear_rows(x, weight, bias)
    return [Spec(same_dtype(x, weight, bias), lead + (n,))]


def gated_out(n: int) -> int:
    need(n % 2 == 0, f"a stacked gate/up weight of {n} rows")
    return n // 2


@rule("gated_linear")
def _gated_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, weight, bias = present(ins, 2) + [None] * (3 - len(ins))
    lead, n = linear_rows(x, weight, bias)
    return [Spec(same_dtype(x, weight, bias), lead + (gated_out(n),))]


@rule("matmul")
def _matmul(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    a, b = present(ins, 2)
    need(len(a.shape) >= 1 and len(b.shape) >= 1, "a scalar operand")
    sa = (1,) + a.shape if len(a.shape) == 1 else a.shape
    sb = b.shape + (1,) if len(b.shape) == 1 else b.shape
    need(sa[-1] == sb[-2], f"{list(a.shape)} does not multiply {list(b.shape)}")
    out = broadcast(sa[:-2], sb[:-2]) + (sa[-2], sb[-1])
    if len(a.shape) == 1:
        out = out[:-2] + out[-1:]
    if len(b.shape) == 1:
        out = out[:-1]
    return [Spec(same_dtype(a, b), out)]


def quantized_weight(q: Spec, scale: Spec, zero: Spec | None, bits: int, group: int) -> tuple[int, int]:
    """(N, K) of a quantized weight, after checking its parts' shapes."""
    need(bits in (4, 8), f"bits {bits} is not 4 or 8")
    need(len(q.shape) == 2 and len(scale.shape) == 2, "q or scale is not 2-d")
    n, k = q.shape[0], q.shape[1] * (2 if bits == 4 else 1)
    need(group > 0 and k % group == 0, f"group_size {group} does not divide K {k}")
    need(scale.shape == (n, k // group), f"scale {list(scale.shape)} is not [{n}, {k // group}]")
    need(zero is None or zero.shape == scale.shape, f"zero {zero} is not scale's shape")
    need(q.dtype == (DType.uint8 if bits == 4 else DType.int8), f"q is {q.dtype.name} for {bits} bits")
    floating(scale, "scale")
    return n, k


def quantized_rows(x: Spec | None, q: Spec | None, scale: Spec | None, zero: Spec | None, bias: Spec | None,
                   attrs: dict[str, Any]) -> tuple[Shape, int]:
    """(x's leading dims, N) of a quantized linear, after checking its parts."""
    need(x is not None and q is not None and scale is not None, "a required input is absent")
    n, k = quantized_weight(q, scale, zero, attrs["bits"], attrs["group_size"])
    need(len(x.shape) >= 1 and x.shape[-1] == k, f"x {list(x.shape)} does not multiply a [{n}, {k}] weight")
    need(bias is None or bias.shape == (n,), f"bias {bias} is not [{n}]")
    return x.shape[:-1], n


@rule("quantized_linear")
def _quantized_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, q, scale, zero, bias = ins + [None] * (5 - len(ins))
    lead, n = quantized_rows(x, q, scale, zero, bias, attrs)
    return [Spec(scale.dtype, lead + (n,))]


@rule("gated_quantized_linear")
def _gated_quantized_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, q, scale, zero, bias = ins + [None] * (5 - len(ins))
    lead, n = quantized_rows(x, q, scale, zero, bias, attrs)
    return [Spec(scale.dtype, lead + (gated_out(n),))]


def gathered_rows(x: Spec | None, index: Spec | None, experts: int, n: int, k: int, bias: Spec | None) -> int:
    """S, the rows of a gathered linear, after checking x, the index and the bias against E experts of [N, K]."""
    need(x is not None and index is not None, "a required input is absent")
    indices(index)
    need(len(x.shape) == 2 and x.shape[1] == k, f"x {list(x.shape)} is not [S, {k}]")
    need(index.shape == x.shape[:1], f"index {list(index.shape)} is not [{x.shape[0]}]")
    need(experts > 0, "no experts")
    need(bias is None or bias.shape == (experts, n), f"bias {bias} is not [{experts}, {n}]")
    return x.shape[0]


def combined_rows(rows: Any, combine: Spec | None) -> Any:
    """The output rows of a gathered linear: S, or T where combine [T, k] sums each token's k rows."""
    if combine is None:
        return rows
    need(len(combine.shape) == 2, f"combine {list(combine.shape)} is not [T, k]")
    tokens, k = combine.shape
    if all(isinstance(d, int) for d in (rows, tokens, k)):
        need(tokens * k == rows, f"combine {list(combine.shape)} does not cover the {rows} rows")
    return tokens


@rule("gathered_linear")
def _gathered_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, weight, index, bias, combine = ins + [None] * (5 - len(ins))
    need(weight is not None and len(weight.shape) == 3, f"weight {weight} is not [E, N, K]")
    experts, n, k = weight.shape
    rows = gathered_rows(x, index, experts, n, k, bias)
    floating(weight, "weight")
    return [Spec(same_dtype(x, weight, bias, combine), (combined_rows(rows, combine), n))]


@rule("gated_gathered_linear")
def _gated_gathered_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (out,) = _gathered_linear(ins[:4], attrs)
    return [Spec(out.dtype, (out.shape[0], gated_out(out.shape[1])))]


@rule("gathered_quantized_linear")
def _gathered_quantized_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, q, scale, zero, index, bias, combine = ins + [None] * (7 - len(ins))
    need(q is not None and scale is not None and len(q.shape) == 3 and len(scale.shape) == 3,
         "q or scale is absent or not 3-d")
    experts = q.shape[0]
    need(scale.shape[0] == experts and (zero is None or zero.shape[:1] == (experts,)),
         f"scale {scale} or zero {zero} is not of {experts} experts")
    n, k = quantized_weight(Spec(q.dtype, q.shape[1:]), Spec(scale.dtype, scale.shape[1:]),
                            None if zero is None else Spec(zero.dtype, zero.shape[1:]), attrs["bits"],
                            attrs["group_size"])
    rows = gathered_rows(x, index, experts, n, k, bias)
    need(combine is None or combine.dtype == scale.dtype, f"combine is {combine and combine.dtype}, not scale's dtype")
    return [Spec(scale.dtype, (combined_rows(rows, combine), n))]


@rule("quantized_embedding")
def _quantized_embedding(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    q, scale, zero, ids = ins + [None] * (4 - len(ins))
    need(q is not None and scale is not None and ids is not None, "a required input is absent")
    indices(ids)
    _, d = quantized_weight(q, scale, zero, attrs["bits"], attrs["group_size"])
    return [Spec(scale.dtype, ids.shape + (d,))]


# ---- normalization ----

def normalized(x: Spec, weight: Spec | None, axes: int) -> None:
    need(1 <= axes <= len(x.shape), f"axes {axes} is outside [1, {len(x.shape)}]")
    need(weight is None or numel(weight.shape) == numel(x.shape[len(x.shape) - axes:]),
         f"weight {weight} does not cover the last {axes} dims of {list(x.shape)}")


@rule("rms_norm", "layer_norm")
def _norm(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, weight, *rest = ins + [None] * (3 - len(ins))
    need(x is not None, "x is absent")
    normalized(x, weight, attrs["axes"])
    for extra in rest:
        need(extra is None or numel(extra.shape) == numel(x.shape[len(x.shape) - attrs["axes"]:]), "bias size")
    return [x]


@rule("add_rms_norm")
def _add_rms_norm(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, residual, weight = ins + [None] * (3 - len(ins))
    need(x is not None and residual is not None and x.shape == residual.shape, "x and residual differ")
    normalized(x, weight, attrs["axes"])
    return [x, x]


@rule("add_rms_norm_linear")
def _add_rms_norm_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, residual, norm_weight, weight, bias = ins + [None] * (5 - len(ins))
    need(x is not None and residual is not None and weight is not None, "a required input is absent")
    need(x.shape == residual.shape, f"x {list(x.shape)} and residual {list(residual.shape)} differ")
    normalized(x, norm_weight, attrs["axes"])
    lead, n = linear_rows(x, weight, bias)
    return [x, Spec(same_dtype(x, weight), lead + ((gated_out(n),) if attrs["activation"] else (n,)))]


@rule("add_rms_norm_quantized_linear")
def _add_rms_norm_quantized_linear(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, residual, norm_weight, q, scale, zero, bias = ins + [None] * (7 - len(ins))
    need(x is not None and residual is not None, "a required input is absent")
    need(x.shape == residual.shape, f"x {list(x.shape)} and residual {list(residual.shape)} differ")
    normalized(x, norm_weight, attrs["axes"])
    lead, n = quantized_rows(x, q, scale, zero, bias, attrs)
    return [x, Spec(scale.dtype, lead + ((gated_out(n),) if attrs["activation"] else (n,)))]


@rule("batch_norm")
def _batch_norm(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, *params = ins
    need(x is not None and len(x.shape) >= 2, "x is absent or below rank 2")
    for p in params:
        need(p is None or numel(p.shape) == x.shape[1], f"a parameter of {p} for {x.shape[1]} channels")
    return [x]


@rule("group_norm")
def _group_norm(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, *params = ins
    need(x is not None and len(x.shape) >= 2, "x is absent or below rank 2")
    need(attrs["groups"] > 0 and x.shape[1] % attrs["groups"] == 0, f"{attrs['groups']} groups of {x.shape[1]}")
    for p in params:
        need(p is None or numel(p.shape) == x.shape[1], f"a parameter of {p} for {x.shape[1]} channels")
    return [x]


# ---- convolution, pooling, resampling ----

def spatial(x: Spec, count: int, what: str) -> None:
    need(count >= 1 and len(x.shape) >= count + 1, f"{what} of {count} dims over x {list(x.shape)}")


def per_dim(values: Sequence[int], count: int, what: str, default: int | None = None) -> list[int]:
    values = list(values)
    if not values and default is not None:
        return [default] * count
    need(len(values) == count, f"{what} {values} for {count} dims")
    return values


@rule("conv")
def _conv(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, weight, bias = ins + [None] * (3 - len(ins))
    need(x is not None and weight is not None, "x or weight is absent")
    k = len(weight.shape) - 2
    need(k >= 1 and len(x.shape) == k + 2, f"x {list(x.shape)} and weight {list(weight.shape)} ranks")
    groups = attrs["groups"]
    need(groups >= 1 and x.shape[1] % groups == 0, f"{groups} groups of {x.shape[1]} channels")
    stride = per_dim(attrs["stride"], k, "stride")
    dilation = per_dim(attrs["dilation"], k, "dilation")
    padding = per_dim(attrs["padding"], k, "padding")
    need(all(s >= 1 for s in stride) and all(d >= 1 for d in dilation) and all(p >= 0 for p in padding),
         "stride, dilation or padding out of range")
    kernel = weight.shape[2:]
    if attrs["transposed"]:
        need(weight.shape[0] == x.shape[1], f"weight {list(weight.shape)} for {x.shape[1]} input channels")
        out_channels = weight.shape[1] * groups
        extra = per_dim(attrs["output_padding"], k, "output_padding", default=0)
        sizes = [(i - 1) * s - 2 * p + d * (kk - 1) + e + 1
                 for i, s, p, d, kk, e in zip(x.shape[2:], stride, padding, dilation, kernel, extra)]
    else:
        need(weight.shape[1] * groups == x.shape[1], f"weight {list(weight.shape)} for {x.shape[1]} channels in "
                                                     f"{groups} groups")
        need(weight.shape[0] % groups == 0, f"{weight.shape[0]} outputs in {groups} groups")
        out_channels = weight.shape[0]
        end = per_dim(attrs["padding_end"], k, "padding_end", default=None) if attrs["padding_end"] else padding
        sizes = [(i + p + q - d * (kk - 1) - 1) // s + 1
                 for i, s, p, q, d, kk in zip(x.shape[2:], stride, padding, end, dilation, kernel)]
    need(all(s >= 0 for s in sizes), f"output size {sizes} is negative")
    need(bias is None or numel(bias.shape) == out_channels, f"bias {bias} for {out_channels} channels")
    return [Spec(same_dtype(x, weight, bias), x.shape[:1] + (out_channels,) + tuple(sizes))]


def pooled(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
    need(kernel >= 1 and stride >= 1 and pad >= 0 and dilation >= 1, "kernel, stride, padding or dilation")
    need(2 * pad <= dilation * (kernel - 1) + 1, f"padding {pad} is more than half the window")
    span = size + 2 * pad - dilation * (kernel - 1) - 1
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    need(out >= 1, f"a window of {kernel} does not fit {size}")
    return out


def pool(x: Spec, attrs: dict[str, Any], dilation: Sequence[int] | None) -> Spec:
    kernel = list(attrs["kernel"])
    spatial(x, len(kernel), "a pool")
    stride = per_dim(attrs["stride"], len(kernel), "stride")
    padding = per_dim(attrs["padding"], len(kernel), "padding")
    dilation = per_dim(dilation, len(kernel), "dilation") if dilation is not None else [1] * len(kernel)
    lead = x.shape[:len(x.shape) - len(kernel)]
    sizes = tuple(pooled(i, k, s, p, d, attrs["ceil_mode"])
                  for i, k, s, p, d in zip(x.shape[len(lead):], kernel, stride, padding, dilation))
    return Spec(x.dtype, lead + sizes)


@rule("max_pool")
def _max_pool(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    return [pool(x, attrs, attrs["dilation"])]


@rule("avg_pool")
def _avg_pool(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    need(attrs["divisor"] is None or attrs["divisor"] != 0, "divisor 0")
    return [pool(x, attrs, None)]


@rule("adaptive_pool")
def _adaptive_pool(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    size = tuple(attrs["output_size"])
    spatial(x, len(size), "an adaptive pool")
    need(all(s >= 1 for s in size) and all(i >= 1 for i in x.shape[len(x.shape) - len(size):]),
         f"output size {list(size)} of {list(x.shape)}")
    return [Spec(x.dtype, x.shape[:len(x.shape) - len(size)] + size)]


@rule("upsample")
def _upsample(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    (x,) = present(ins, 1)
    size = tuple(attrs["size"])
    spatial(x, len(size), "an upsample")
    need(all(s >= 0 for s in size), f"size {list(size)}")
    return [Spec(x.dtype, x.shape[:len(x.shape) - len(size)] + size)]


@rule("grid_sample")
def _grid_sample(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, grid = present(ins, 2)
    need(len(x.shape) == 4 and len(grid.shape) == 4 and grid.shape[3] == 2 and grid.shape[0] == x.shape[0],
         f"x {list(x.shape)} and grid {list(grid.shape)} are not [N, C, H, W] and [N, Ho, Wo, 2]")
    return [Spec(same_dtype(x, grid), x.shape[:2] + grid.shape[1:3])]


# ---- attention ----

@rule("sdpa")
def _sdpa(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    q, k, v, mask, sinks = ins + [None] * (5 - len(ins))
    need(q is not None and k is not None and v is not None, "q, k or v is absent")
    need(len(q.shape) >= 2 and len(k.shape) == len(q.shape) == len(v.shape), "q, k and v ranks")
    need(q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2], f"q {list(q.shape)}, k {list(k.shape)} and "
                                                                      f"v {list(v.shape)} do not fit")
    lead_q, lead_k = q.shape[:-2], k.shape[:-2]
    if len(lead_q) >= 1 and lead_k != lead_q:  # grouped heads: k/v's head dim divides q's
        need(lead_k[-1] >= 1 and lead_q[-1] % lead_k[-1] == 0, f"{lead_q[-1]} query heads over {lead_k[-1]}")
        broadcast(lead_q[:-1], lead_k[:-1])
    need(lead_k == v.shape[:-2], f"k {list(k.shape)} and v {list(v.shape)} differ")
    if mask is not None:  # [..., L, S] or broadcast to it, bool (keep) or q's float dtype (added)
        need(len(mask.shape) >= 2 and mask.dtype in (DType.bool, q.dtype), f"mask {mask} is not a [..., L, S] bool "
                                                                           f"or {q.dtype.name} mask")
        need(broadcast(mask.shape, q.shape[:-1] + (k.shape[-2],)) == q.shape[:-1] + (k.shape[-2],),
             f"mask {mask} does not broadcast to the scores' {list(q.shape[:-1] + (k.shape[-2],))}")
    if sinks is not None:  # one logit per q head
        need(len(q.shape) >= 3 and sinks.shape == (q.shape[-3],) and sinks.dtype.is_float,
             f"sinks {sinks} is not one float per q head of q {list(q.shape)}")
    return [Spec(same_dtype(q, k, v), q.shape[:-1] + (v.shape[-1],))]


@rule("rope")
def _rope(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    x, cos, sin = present(ins, 3)
    need(len(x.shape) >= 1 and x.shape[-1] % 2 == 0, f"x {list(x.shape)} has an odd last dim")
    broadcast(x.shape, cos.shape, sin.shape)
    return [x]


@rule("rope_cache_update")
def _rope_cache_update(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    q, k, v, cos, sin, k_cache, v_cache, *where = present(ins, len(ins))
    need(len(attrs["dims"]) == len(where) and len(where) >= 1, f"dims {list(attrs['dims'])} for {len(where)} indices")
    for x in (q, k):
        need(x.shape and x.shape[-1] % 2 == 0 and broadcast(x.shape, cos.shape, sin.shape) == x.shape,
             f"cos {cos} and sin {sin} do not rotate {x}")
    for value, cache in ((k, k_cache), (v, v_cache)):
        (written,) = _index([cache, *where], {"dims": attrs["dims"]})
        need(broadcast(value.shape, written.shape) == written.shape, f"{value} does not fill the cache's {written}")
    same_dtype(q, k, v, k_cache, v_cache)
    return [q, k_cache, v_cache]


@rule("norm_rope_cache_update")
def _norm_rope_cache_update(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    q, k, v, cos, sin, k_cache, v_cache, q_weight, k_weight, *where = present(ins, len(ins))
    for x, weight in ((q, q_weight), (k, k_weight)):
        need(weight.shape == x.shape[-1:], f"norm weight {weight} for rows of {x}")
    same_dtype(q, q_weight, k_weight)
    return _rope_cache_update([q, k, v, cos, sin, k_cache, v_cache, *where], attrs)


@rule("slot_attention")
def _slot_attention(ins: list[Spec | None], attrs: dict[str, Any]) -> list[Spec]:
    q, k_cache, v_cache, slots, positions = present(ins[:5], 5)
    sinks = ins[5] if len(ins) > 5 else None
    need(len(q.shape) == 4 and len(k_cache.shape) == 4 and len(v_cache.shape) == 4, "q and caches are not 4-d")
    b, hq, t, e = q.shape
    need(k_cache.shape[3] == e and k_cache.shape[:3] == v_cache.shape[:3], "caches do not fit q")
    need(k_cache.shape[2] >= 1 and hq % k_cache.shape[2] == 0, f"{hq} query heads over {k_cache.shape[2]}")
    need(slots.shape == (b,) and positions.shape == (b, t), f"slots {slots} / positions {positions} for {b}x{t}")
    need(slots.dtype == DType.int64 and positions.dtype == DType.int64, "slots and positions are not int64")
    need(attrs["window"] >= 0, "negative window")
    need(sinks is None or (sinks.shape == (hq,) and sinks.dtype.is_float), f"sinks {sinks} is not one float a q head")
    return [Spec(same_dtype(q, k_cache, v_cache), (b, hq, t, v_cache.shape[3]))]
