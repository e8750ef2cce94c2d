"""Elementwise kernels: table-driven where the op is one MLX function, in float32 for float16/bfloat16 where kiln
defines the math there (single rounded operations, add and the like, are exact in the narrow type itself).

MLX lacks an accurate erfc (1 - erf loses the right tail), so erfc and the exact GELU use the same Chebyshev fit
as the CPU backend. MLX's sign of NaN is 0, PyTorch's NaN; the kernel keeps NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kiln.runtime.backends.array_api.elementwise import ERFC_COEFFICIENTS, ERFC_OFFSET
from kiln.runtime.backends.mlx.arrays import is_float, mx_dtype
from kiln.runtime.backends.mlx.registry import MLX_KERNELS, in_float32, kernel, scalar


def _erfc_of_abs(x: mx.array) -> mx.array:
    z = mx.abs(x)
    t = 1 / (1 + 0.5 * z)
    p = mx.full(x.shape, ERFC_COEFFICIENTS[-1], dtype=x.dtype)
    for c in ERFC_COEFFICIENTS[-2::-1]:
        p = p * t + c
    return t * mx.exp(-z * z - ERFC_OFFSET + t * p)


def erfc(x: mx.array) -> mx.array:
    """erfc(x) = erfc(|x|) for x >= 0, 2 - erfc(|x|) below: no cancellation in the right tail."""
    e = _erfc_of_abs(x)
    return mx.where(mx.isnan(x), x, mx.where(x < 0, 2 - e, e))


def sigmoid(x: mx.array) -> mx.array:
    return mx.sigmoid(x)


def hardsigmoid(x: mx.array) -> mx.array:
    return mx.clip(x + 3, 0, 6) / 6


def gelu(x: mx.array, approximate: str = "none") -> mx.array:
    if approximate == "tanh":
        return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    # 1 + erf(x / sqrt(2)) = erfc(-x / sqrt(2)): accurate in the left tail too
    return 0.5 * x * erfc(x * -(1 / math.sqrt(2)))


def _sign(x: mx.array) -> mx.array:
    return mx.where(mx.isnan(x), x, mx.sign(x)) if is_float(x) else mx.sign(x)


UNARY: dict[str, Callable[[mx.array], mx.array]] = {
    "neg": mx.negative, "abs": mx.abs, "exp": mx.exp, "log": mx.log, "sqrt": mx.sqrt, "sin": mx.sin,
    "cos": mx.cos, "tan": mx.tan, "tanh": mx.tanh, "floor": mx.floor, "ceil": mx.ceil, "trunc": mx.trunc,
    "round": mx.round, "sign": _sign, "log1p": mx.log1p, "expm1": mx.expm1, "acos": mx.arccos, "asin": mx.arcsin,
    "atan": mx.arctan, "acosh": mx.arccosh, "asinh": mx.arcsinh, "atanh": mx.arctanh, "cosh": mx.cosh,
    "sinh": mx.sinh, "log10": mx.log10, "log2": mx.log2, "exp2": lambda x: mx.power(scalar(2, x), x),
    "rsqrt": mx.rsqrt, "reciprocal": mx.reciprocal, "sigmoid": sigmoid, "silu": lambda x: x * sigmoid(x),
    "relu": lambda x: mx.maximum(x, scalar(0, x)), "hardswish": lambda x: x * hardsigmoid(x),
    "hardsigmoid": hardsigmoid, "erf": mx.erf, "erfc": erfc, "erfinv": mx.erfinv,
}
"""Unary ops as one function of x; registered through in_float32."""

for _name, _fn in UNARY.items():
    MLX_KERNELS.add(_name, in_float32(_fn))

_EXACT = {"logical_not": mx.logical_not, "bitwise_not": mx.bitwise_invert, "isnan": mx.isnan, "isinf": mx.isinf}
for _name, _fn in _EXACT.items():
    MLX_KERNELS.add(_name, _fn)


def _fmod(a: mx.array, b: mx.array) -> mx.array:
    """C's fmod (the sign of a) from MLX's remainder (the sign of b), which is exact: they differ by b where the
    remainder is nonzero and the signs differ."""
    r = mx.remainder(a, b)
    return mx.where((r != 0) & ((r < 0) != (a < 0)), r - b, r)


_EXACT_BINARY = {
    "add": mx.add, "sub": mx.subtract, "mul": mx.multiply, "maximum": mx.maximum, "minimum": mx.minimum,
    "bitwise_and": mx.bitwise_and, "bitwise_or": mx.bitwise_or, "bitwise_xor": mx.bitwise_xor,
    "logical_and": mx.logical_and, "logical_or": mx.logical_or, "logical_xor": mx.logical_xor, "eq": mx.equal,
    "ne": mx.not_equal, "lt": mx.less, "le": mx.less_equal, "gt": mx.greater, "ge": mx.greater_equal,
}
"""Binary ops that round once (or not at all): the same in the narrow float type as in float32."""
_WIDE_BINARY = {"pow": mx.power, "remainder": mx.remainder, "fmod": _fmod, "atan2": mx.arctan2}
"""Binary ops computed in float32 for float16/bfloat16."""

for _name, _fn in _EXACT_BINARY.items():
    MLX_KERNELS.add(_name, _fn)
for _name, _fn in _WIDE_BINARY.items():
    MLX_KERNELS.add(_name, in_float32(lambda a, b, fn=_fn: fn(a, b.astype(a.dtype))))


@kernel("div")
def div(a: mx.array, b: mx.array, rounding_mode: str) -> mx.array:
    if rounding_mode == "floor":
        return in_float32(mx.floor_divide)(a, b)
    if rounding_mode == "trunc":
        if is_float(a):
            return in_float32(lambda x, y: mx.trunc(x / y))(a, b)
        q = mx.floor_divide(a, b)
        return q + ((mx.remainder(a, b) != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
    return mx.divide(a, b)


@kernel("where")
def where(cond: mx.array, a: mx.array, b: mx.array) -> mx.array:
    return mx.where(cond, a, b)


@kernel("cast")
def cast(x: mx.array, dtype: Any) -> mx.array:
    target = mx_dtype(dtype)
    if target == mx.bool_ and x.dtype != mx.bool_:
        return x != 0
    return x.astype(target)


@kernel("clamp")
def clamp(x: mx.array, min: float | None, max: float | None) -> mx.array:  # noqa: A002 - the op set's names
    """maximum/minimum propagate NaN as torch.clamp does."""
    out = x if min is None else mx.maximum(x, scalar(min, x))
    return out if max is None else mx.minimum(out, scalar(max, x))


@kernel("leaky_relu")
@in_float32
def leaky_relu(x: mx.array, negative_slope: float) -> mx.array:
    return mx.where(x > 0, x, x * negative_slope)


@kernel("elu")
@in_float32
def elu(x: mx.array, alpha: float, scale: float, input_scale: float) -> mx.array:
    return mx.where(x > 0, x * scale, mx.expm1(mx.minimum(x, 0) * input_scale) * (alpha * scale))


@kernel("gelu")
@in_float32
def gelu_kernel(x: mx.array, approximate: str) -> mx.array:
    return gelu(x, approximate)


ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": UNARY["silu"], "gelu": gelu, "gelu_tanh": lambda x: gelu(x, "tanh")}
"""gated_activation's activations, by name."""


@kernel("gated_activation")
def gated_activation(gate: mx.array, up: mx.array, activation: str) -> mx.array:
    return in_float32(ACTIVATIONS[activation])(gate) * up
