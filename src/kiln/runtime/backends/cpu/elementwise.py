"""The CPU's own elementwise kernels: compiled float32 loops (one pass over memory instead of NumPy's several) and
the functions NumPy lacks (erf, erfc, erfinv without SciPy). Every other elementwise op is portable
(kiln.runtime.backends.array_api.elementwise)."""

from __future__ import annotations

import math

import numpy as np

from kiln.runtime.backends.array_api import elementwise as portable
from kiln.runtime.backends.array_api.elementwise import ERFC_COEFFICIENTS, ERFC_OFFSET
from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.registry import CPU_KERNELS, in_float32, kernel


def _erfc_of_abs(x: np.ndarray, work: type) -> np.ndarray:
    """erfc(|x|) for a 1-d x, in dtype `work`: the Chebyshev fit from Numerical Recipes (fractional error below
    1.2e-7, no SciPy needed). Evaluated in place (Horner): temporaries, not arithmetic, are what cost here."""
    z = np.abs(x, dtype=work)
    t = z * work(0.5)
    t += 1
    np.reciprocal(t, out=t)
    p = t * work(ERFC_COEFFICIENTS[-1])
    for c in ERFC_COEFFICIENTS[-2::-1]:
        p += work(c)
        p *= t
    p -= work(ERFC_OFFSET)
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


def _compiled_first(name: str, fallback):
    """The compiled helper for float32, else `fallback`."""
    def run(x: np.ndarray) -> np.ndarray:
        y = native.unary(name, x)
        return fallback(x) if y is None else y
    run.__name__ = name
    return run


_OWN_UNARY = {"erf": _erf, "relu": _relu} | {
    name: lambda x, fn=portable.UNARY[name]: fn(np, x) for name in native.UNARY if name in portable.UNARY}
for _name, _fn in _OWN_UNARY.items():
    CPU_KERNELS.add(_name, in_float32(_compiled_first(_name, _fn) if _name in native.UNARY else _fn))


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


@kernel("clamp")
def clamp(x: np.ndarray, min: float | None, max: float | None) -> np.ndarray:
    """The compiled helper for float32 (one pass), else the portable kernel."""
    if x.dtype == np.float32 and (min is not None or max is not None):
        y = native.clamp(x, min, max)
        if y is not None:
            return y
    return portable.clamp(np, x, min, max)


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


CPU_KERNELS.add("erfc", in_float32(_erfc))
CPU_KERNELS.add("erfinv", in_float32(_erfinv))


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
