"""Elementwise kernels for both backends: table-driven where the op is one function of the array module.

Float16/bfloat16 math runs in float32 and is rounded back (in_float32). Backends register their own kernels where
they have faster ones (the CPU's compiled float32 loops) or functions the other module lacks (erf on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.runtime.backends.array_api.core import PORTABLE, in_float32, portable

ERFC_COEFFICIENTS = (1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
                     -0.82215223, 0.17087277)
ERFC_OFFSET = 1.26551223
"""erfc(z) = t * exp(-z^2 - ERFC_OFFSET + t * (c0 + t * (c1 + ...))) with t = 1 / (1 + z / 2), z >= 0: the
Chebyshev fit from Numerical Recipes (fractional error below 1.2e-7), for the backends whose array module lacks an
accurate erfc (1 - erf(z) loses the right tail to cancellation)."""


def sigmoid(xp: Any, x: Any) -> Any:
    """1 / (1 + e^-x) without overflow for large |x|."""
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def hardsigmoid(xp: Any, x: Any) -> Any:
    return xp.clip(x + 3, 0, 6) / 6


_SAME_NAME = {  # kiln op -> the array module's function
    "neg": "negative", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "sin": "sin", "cos": "cos",
    "tan": "tan", "tanh": "tanh", "floor": "floor", "ceil": "ceil", "trunc": "trunc", "round": "round",
    "sign": "sign", "log1p": "log1p", "expm1": "expm1", "acos": "arccos", "asin": "arcsin", "atan": "arctan",
    "acosh": "arccosh", "asinh": "arcsinh", "atanh": "arctanh", "cosh": "cosh", "sinh": "sinh", "log10": "log10",
    "log2": "log2", "exp2": "exp2",
}


def _named(function: str) -> Callable[[Any, Any], Any]:
    def run(xp: Any, x: Any) -> Any:
        return getattr(xp, function)(x)
    run.__name__ = function
    return run


UNARY: dict[str, Callable[[Any, Any], Any]] = {name: _named(f) for name, f in _SAME_NAME.items()} | {
    "rsqrt": lambda xp, x: 1 / xp.sqrt(x), "reciprocal": lambda xp, x: 1 / x, "sigmoid": sigmoid,
    "silu": lambda xp, x: x * sigmoid(xp, x), "relu": lambda xp, x: xp.maximum(x, x.dtype.type(0)),
    "hardswish": lambda xp, x: x * hardsigmoid(xp, x), "hardsigmoid": hardsigmoid,
}
"""Float unary ops as fn(xp, x) in x's dtype (float32 or wider); registered below through in_float32."""

for _name, _fn in UNARY.items():
    PORTABLE.add(_name, in_float32(_fn))

_EXACT = {"logical_not": "logical_not", "bitwise_not": "invert", "isnan": "isnan", "isinf": "isinf"}
for _name, _function in _EXACT.items():
    PORTABLE.add(_name, _named(_function))

_BINARY = {
    "add": "add", "sub": "subtract", "mul": "multiply", "pow": "power", "maximum": "maximum", "minimum": "minimum",
    "remainder": "remainder", "fmod": "fmod", "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or",
    "bitwise_xor": "bitwise_xor", "logical_and": "logical_and", "logical_or": "logical_or",
    "logical_xor": "logical_xor", "atan2": "arctan2", "eq": "equal", "ne": "not_equal", "lt": "less",
    "le": "less_equal", "gt": "greater", "ge": "greater_equal",
}


def _binary(function: str) -> Callable[[Any, Any, Any], Any]:
    def run(xp: Any, a: Any, b: Any) -> Any:
        return getattr(xp, function)(a, b)
    run.__name__ = function
    return run


for _name, _function in _BINARY.items():
    PORTABLE.add(_name, _binary(_function))


@portable("div")
def div(xp: Any, a: Any, b: Any, rounding_mode: str) -> Any:
    """a / b: true division, or rounded toward -inf ("floor") or toward zero ("trunc", on integers too, where
    floor division alone would round negative quotients the wrong way)."""
    if rounding_mode == "floor":
        return xp.floor_divide(a, b)
    if rounding_mode == "trunc":
        if a.dtype.kind == "f" or xp.result_type(a, b).kind == "f":
            return xp.trunc(a / b).astype(a.dtype)
        q = xp.floor_divide(a, b)
        return q + ((xp.remainder(a, b) != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
    return xp.true_divide(a, b)


@portable("where")
def where(xp: Any, cond: Any, a: Any, b: Any) -> Any:
    """(CuPy promotes bfloat16 operands to float32; the op set's where keeps the inputs' one dtype.)"""
    return xp.where(cond, a, b).astype(a.dtype, copy=False)


@portable("cast")
def cast(xp: Any, x: Any, dtype: Any) -> Any:
    return x.astype(dtype.numpy)


@portable("clamp")
def clamp(xp: Any, x: Any, min: float | None, max: float | None) -> Any:  # noqa: A002 - the op set's names
    """maximum/minimum propagate NaN as torch.clamp does."""
    out = x if min is None else xp.maximum(x, x.dtype.type(min))
    out = out if max is None else xp.minimum(out, x.dtype.type(max))
    return out if out is not x else x.copy()


@portable("leaky_relu")
@in_float32
def leaky_relu(xp: Any, x: Any, negative_slope: float) -> Any:
    return xp.where(x > 0, x, x * x.dtype.type(negative_slope))


@portable("elu")
@in_float32
def elu(xp: Any, x: Any, alpha: float, scale: float, input_scale: float) -> Any:
    t = x.dtype.type
    neg = xp.expm1(xp.minimum(x, t(0)) * t(input_scale)) * t(alpha * scale)
    return xp.where(x > 0, x * t(scale), neg)
