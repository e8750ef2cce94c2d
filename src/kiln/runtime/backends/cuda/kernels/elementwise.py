"""Elementwise kernels of the GPU's own: the error functions from cupyx (NumPy has none), GELU, and the gated
activation fused over the two halves of one projection. The rest are portable."""

from __future__ import annotations

import math
from typing import Any

import cupy as cp
import numpy as np
from cupyx.scipy.special import erf, erfc, erfinv

from kiln.runtime.backends.array_api import bind, in_float32, upcast
from kiln.runtime.backends.array_api.elementwise import sigmoid
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.registry import CUDA_KERNELS, GATE_CODES, grid, kernel, rows

for _name, _fn in {"erf": erf, "erfc": erfc, "erfinv": erfinv}.items():
    CUDA_KERNELS.add(_name, bind(in_float32(lambda xp, x, fn=_fn: fn(x)), cp))


def _gelu(x: Any, approximate: str) -> Any:
    if approximate == "tanh":
        return 0.5 * x * (1 + cp.tanh(x.dtype.type(math.sqrt(2 / math.pi)) * (x + x.dtype.type(0.044715) * x * x * x)))
    return 0.5 * x * erfc(-x * x.dtype.type(1 / math.sqrt(2)))  # = 1 + erf(x / sqrt 2), exact in the left tail


@kernel("gelu")
def gelu(x: Any, approximate: str) -> Any:
    (xf,) = upcast(x)
    return _gelu(xf, approximate).astype(x.dtype, copy=False)


_GATES = {"silu": lambda g: g * sigmoid(cp, g), "gelu": lambda g: _gelu(g, "none"),
          "gelu_tanh": lambda g: _gelu(g, "tanh")}


@kernel("gated_activation")
def gated_activation(gate: Any, up: Any, activation: str) -> Any:
    if gate.shape == up.shape and gate.size and nvrtc.supports(gate, up):
        g, u = rows(gate), rows(up)
        if g is not None and u is not None:
            out = cp.empty(gate.shape, dtype=gate.dtype)
            d = gate.shape[-1]
            nvrtc.function("fused", "gated", gate.dtype)(
                grid(gate.size), (256,), (g, u, out, np.int64(g.shape[0]), np.int32(d),
                                          np.int64(g.strides[0] // g.itemsize), np.int64(u.strides[0] // u.itemsize),
                                          np.int32(GATE_CODES[activation])))
            return out
    dtype = gate.dtype
    g, u = upcast(gate, up)
    return (_GATES[activation](g) * u).astype(dtype, copy=False)
