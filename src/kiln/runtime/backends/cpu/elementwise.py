"""Elementwise kernels: unary, binary, comparisons, where, clamp, cast. Table-driven where the op is a ufunc."""

from __future__ import annotations

import math

import numpy as np

from kiln.runtime.backends import array_api
from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.registry import CPU_KERNELS, in_float32, kernel


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


_ERFC_COEFFS = (1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587, -0.82215223,
                0.17087277)


def _erfc_of_abs(x: np.ndarray, work: type) -> np.ndarray:
    """erfc(|x|) for a 1-d x, in dtype `work`: the Chebyshev fit from Numerical Recipes (fractional error below
    1.2e-7, no SciPy needed). Evaluated in place (Horner): temporaries, not arithmetic, are what cost here."""
    z = np.abs(x, dtype=work)
    t = z * work(0.5)
    t += 1
    np.reciprocal(t, out=t)
    p = t * work(_ERFC_COEFFS[-1])
    for c in _ERFC_COEFFS[-2::-1]:
        p += work(c)
        p *= t
    p -= work(1.26551223)
    z *= z
    p -= z
    np.exp(p, out=p)
    p *= t
    return p


def _erf(x: np.ndarray) -> np.ndarray:
    """erf = sign(x) * (1 - erfc(|x|)), in float64 so float32 results are exact to their last bit or two."""
    flat = x.reshape(-1)  # 1-d, so that 0-d inputs also give arrays to work in place on
    e = _erfc_of_abs(flat, np.float64)
    np.subtract(1, e, out=e)
    return np.copysign(e, flat, out=e).astype(x.dtype, copy=False).reshape(x.shape)


def _relu(x: np.ndarray) -> np.ndarray:
    y = native.clamp(x, 0.0, None) if x.dtype == np.float32 else None
    return np.maximum(x, x.dtype.type(0)) if y is None else y


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    return np.clip(x + 3, 0, 6) / 6


_UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "reciprocal": lambda x: 1 / x, "sigmoid": _sigmoid, "tanh": np.tanh,
    "relu": lambda x: _relu(x), "erf": _erf, "sin": np.sin, "cos": np.cos,
    "floor": np.floor, "ceil": np.ceil, "round": np.round, "sign": np.sign, "silu": lambda x: x * _sigmoid(x),
    "hardswish": lambda x: x * _hardsigmoid(x), "hardsigmoid": _hardsigmoid, "log1p": np.log1p,
    "expm1": np.expm1, "trunc": np.trunc,
}


def _compiled_first(name: str, fallback):
    """The compiled helper for float32 (one pass over memory instead of NumPy's several), else `fallback`."""
    def run(x: np.ndarray) -> np.ndarray:
        y = native.unary(name, x)
        return fallback(x) if y is None else y
    run.__name__ = name
    return run


for _name, _fn in _UNARY.items():
    CPU_KERNELS.add(_name, in_float32(_compiled_first(_name, _fn) if _name in native.UNARY else _fn))

CPU_KERNELS.add("logical_not", np.logical_not)
CPU_KERNELS.add("bitwise_not", np.invert)
CPU_KERNELS.add("isnan", np.isnan)


@kernel("gelu")
@in_float32
def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    y = native.unary("gelu_tanh" if approximate == "tanh" else "gelu_erf", x)
    if y is not None:
        return y
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    # 1 + erf(x/sqrt(2)) is erfc(|x|/sqrt(2)) for x < 0 and 2 - erfc(...) otherwise: taken from erfc directly, the
    # left tail has no cancellation, so float32 arithmetic (5x faster than float64) keeps float32 accuracy.
    flat = x.reshape(-1)
    e = _erfc_of_abs(flat * flat.dtype.type(1 / math.sqrt(2)), flat.dtype.type)
    np.subtract(2, e, out=e, where=flat >= 0)
    e *= flat
    e *= flat.dtype.type(0.5)
    return e.reshape(x.shape)


@kernel("leaky_relu")
def leaky_relu(x: np.ndarray, negative_slope: float) -> np.ndarray:
    return np.where(x > 0, x, x * x.dtype.type(negative_slope))


@kernel("clamp")
def clamp(x: np.ndarray, min: float | None, max: float | None) -> np.ndarray:
    """np.maximum/np.minimum propagate NaN as torch.clamp does, in one pass each (the compiled helper: one pass)."""
    if x.dtype == np.float32 and (min is not None or max is not None):
        y = native.clamp(x, min, max)
        if y is not None:
            return y
    out = x if min is None else np.maximum(x, x.dtype.type(min))
    out = out if max is None else np.minimum(out, x.dtype.type(max))
    return out if out is not x else x.copy()


@kernel("cast")
def cast(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(dtype.numpy)


_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "pow": np.power, "maximum": np.maximum,
    "minimum": np.minimum, "remainder": np.remainder, "fmod": np.fmod, "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor, "logical_and": np.logical_and,
    "logical_or": np.logical_or, "logical_xor": np.logical_xor, "atan2": np.arctan2,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal,
}
for _name, _fn in _BINARY.items():
    CPU_KERNELS.add(_name, _fn)


@kernel("div")
def div(a: np.ndarray, b: np.ndarray, rounding_mode: str) -> np.ndarray:
    return array_api.div(np, a, b, rounding_mode)


@kernel("where")
def where(cond: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(cond, a, b)


# ---- math functions (A1) ----
def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc(x) = erfc(|x|) for x >= 0, 2 - erfc(|x|) below: no cancellation in the right tail."""
    flat = x.reshape(-1)
    e = _erfc_of_abs(flat, np.float64)
    np.subtract(2, e, out=e, where=flat < 0)
    return np.where(np.isnan(flat), flat, e).astype(x.dtype, copy=False).reshape(x.shape)


_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                   -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                0.00943887047, 1.00167406, 2.83297682)


def _erfinv(x: np.ndarray) -> np.ndarray:
    """Giles' single-precision approximation ("Approximating the erfinv function", 2010; relative error below 4e-7),
    evaluated in float64; +-inf at +-1 and NaN outside [-1, 1] as PyTorch gives them."""
    xd = x.astype(np.float64)
    w = -np.log((1 - xd) * (1 + xd))
    central = w < 5
    wc, wt = w - 2.5, np.sqrt(np.where(central, 5.0, w)) - 3
    pc, pt = np.full_like(xd, _ERFINV_CENTRAL[0]), np.full_like(xd, _ERFINV_TAIL[0])
    for cc, ct in zip(_ERFINV_CENTRAL[1:], _ERFINV_TAIL[1:], strict=True):
        pc = pc * wc + cc
        pt = pt * wt + ct
    out = np.where(central, pc, pt) * xd
    out = np.where(np.abs(xd) == 1, np.copysign(np.inf, xd), out)
    return out.astype(x.dtype, copy=False)


_MATH = {"acos": np.arccos, "asin": np.arcsin, "atan": np.arctan, "acosh": np.arccosh, "asinh": np.arcsinh,
         "atanh": np.arctanh, "cosh": np.cosh, "sinh": np.sinh, "tan": np.tan, "log10": np.log10, "log2": np.log2,
         "exp2": np.exp2, "erfinv": _erfinv, "erfc": _erfc}
for _name, _fn in _MATH.items():
    CPU_KERNELS.add(_name, in_float32(_fn))
CPU_KERNELS.add("isinf", np.isinf)


@kernel("elu")
@in_float32
def elu(x: np.ndarray, alpha: float, scale: float, input_scale: float) -> np.ndarray:
    t = x.dtype.type
    neg = np.expm1(np.minimum(x, t(0)) * t(input_scale)) * t(alpha * scale)
    return np.where(x > 0, x * t(scale), neg)


@kernel("gated_activation")
def gated_activation(gate: np.ndarray, up: np.ndarray, activation: str) -> np.ndarray:
    """act(gate) * up with the product written into act's output (no third array): the activation kernels always
    return new memory, never gate itself."""
    if activation == "silu":
        out = CPU_KERNELS.kernels["silu"](gate)
    else:
        out = gelu(gate, "tanh" if activation == "gelu_tanh" else "none")
    out = np.asarray(out)  # (NumPy gives 0-d results as scalars)
    out *= up
    return out
