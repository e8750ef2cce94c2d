"""CUDA kernels written with CuPy: the elementwise table, matrix products on cuBLAS, views, and what an LLM step
needs (embedding, RMSNorm/LayerNorm, softmax, RoPE, gated activation, attention, in-place KV-cache writes).

Each follows its CPU kernel's semantics (kiln.runtime.backends.cpu; the op set's docstrings are the contract);
the op tests run both on every op. Float16/bfloat16 math runs in float32 and is rounded back, as PyTorch does.
Ops without a kernel here run on the host (see kiln.runtime.backends.cuda).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np
from cupyx.scipy.special import erf as _erf
from cupyx.scipy.special import erfc as _erfc

from kiln.runtime.backends import array_api
from kiln.runtime.backends.base import KernelRegistry
from kiln.runtime.backends.cuda import nvrtc

CUDA_KERNELS = KernelRegistry("cuda")
kernel = CUDA_KERNELS.register


class OnHost(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a CUDA kernel for arguments it does not handle: the backend runs the op's CPU kernel on the host
    instead (and reports it in host_ops), as for ops that have no CUDA kernel at all."""

LOW_PRECISION = (np.dtype(np.float16),)
try:  # bfloat16 arrays exist in CuPy builds that know ml_dtypes
    import ml_dtypes

    LOW_PRECISION += (np.dtype(ml_dtypes.bfloat16),)
except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
    pass


def _upcast(*arrays: Any) -> tuple[Any, ...]:
    return tuple(a.astype(cp.float32) if a is not None and a.dtype in LOW_PRECISION else a for a in arrays)


def _in_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(x: Any, *args: Any, **kwargs: Any) -> Any:
        if x.dtype in LOW_PRECISION:
            return fn(x.astype(cp.float32), *args, **kwargs).astype(x.dtype)
        return fn(x, *args, **kwargs)
    run.__name__ = fn.__name__
    return run


# ---- elementwise ----
def _sigmoid(x: Any) -> Any:
    e = cp.exp(-cp.abs(x))
    return cp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


_UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": cp.negative, "abs": cp.abs, "exp": cp.exp, "log": cp.log, "sqrt": cp.sqrt, "sin": cp.sin, "cos": cp.cos,
    "tanh": cp.tanh, "floor": cp.floor, "ceil": cp.ceil, "trunc": cp.trunc, "log1p": cp.log1p, "expm1": cp.expm1,
    "rsqrt": lambda x: 1 / cp.sqrt(x), "reciprocal": lambda x: 1 / x, "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x), "relu": lambda x: cp.maximum(x, x.dtype.type(0)), "erf": _erf,
}
for _name, _fn in _UNARY.items():
    CUDA_KERNELS.add(_name, _in_float32(_fn))
CUDA_KERNELS.add("logical_not", cp.logical_not)
CUDA_KERNELS.add("isnan", cp.isnan)

_BINARY = {
    "add": cp.add, "sub": cp.subtract, "mul": cp.multiply, "maximum": cp.maximum, "minimum": cp.minimum,
    "bitwise_and": cp.bitwise_and, "bitwise_or": cp.bitwise_or, "bitwise_xor": cp.bitwise_xor,
    "remainder": cp.remainder, "logical_and": cp.logical_and, "logical_or": cp.logical_or,
    "logical_xor": cp.logical_xor,
    "eq": cp.equal, "ne": cp.not_equal, "lt": cp.less, "le": cp.less_equal, "gt": cp.greater, "ge": cp.greater_equal,
}
for _name, _fn in _BINARY.items():
    CUDA_KERNELS.add(_name, _fn)


@kernel("where")
def where(cond: Any, a: Any, b: Any) -> Any:
    """(CuPy promotes bfloat16 operands to float32; the op set's where keeps the inputs' one dtype.)"""
    return cp.where(cond, a, b).astype(a.dtype, copy=False)


@kernel("cast")
def cast(x: Any, dtype: Any) -> Any:
    return x.astype(dtype.numpy)


def _gelu(x: Any, approximate: str) -> Any:
    if approximate == "tanh":
        return 0.5 * x * (1 + cp.tanh(x.dtype.type(math.sqrt(2 / math.pi)) * (x + x.dtype.type(0.044715) * x * x * x)))
    return 0.5 * x * _erfc(-x * x.dtype.type(1 / math.sqrt(2)))  # = 1 + erf(x / sqrt 2), exact in the left tail


@kernel("gelu")
@_in_float32
def gelu(x: Any, approximate: str) -> Any:
    return _gelu(x, approximate)


_GATES = {"silu": lambda g: g * _sigmoid(g), "gelu": lambda g: _gelu(g, "none"),
          "gelu_tanh": lambda g: _gelu(g, "tanh")}


def _contiguous_f32(*arrays: Any) -> bool:
    return all(a.dtype == cp.float32 and a.flags.c_contiguous for a in arrays)


def _grid(n: int, block: int = 256) -> tuple[int]:
    return (max(1, min((n + block - 1) // block, 65535)),)


@kernel("gated_activation")
def gated_activation(gate: Any, up: Any, activation: str) -> Any:
    if activation == "silu" and gate.shape == up.shape and _contiguous_f32(gate, up):
        out = cp.empty_like(gate)
        nvrtc.function("fused", "silu_mul_f32")(_grid(gate.size), (256,), (gate, up, out, cp.int64(gate.size)))
        return out
    dtype = gate.dtype
    g, u = _upcast(gate, up)
    return (_GATES[activation](g) * u).astype(dtype, copy=False)


# ---- matrix products (cuBLAS) ----
_BF16 = LOW_PRECISION[-1] if len(LOW_PRECISION) > 1 else None


@kernel("matmul")
def matmul(a: Any, b: Any) -> Any:
    """(CuPy's matmul has no bfloat16: computed in float32 and rounded, until a gemmEx path exists.)"""
    if a.dtype == _BF16:
        return cp.matmul(a.astype(cp.float32), b.astype(cp.float32)).astype(a.dtype)
    return cp.matmul(a, b)


@kernel("linear")
def linear(x: Any, weight: Any, bias: Any) -> Any:
    """x @ W^T with W^T as a transposed view: cuBLAS reads the [out, in] weight as it is, no copy per call."""
    dtype, lead = x.dtype, x.shape[:-1]
    if dtype == _BF16:
        x, weight, bias = (None if t is None else t.astype(cp.float32) for t in (x, weight, bias))
    out = cp.matmul(x.reshape(-1, x.shape[-1]), weight.T)  # 2-d: one cuBLAS gemm, not CuPy's batched path
    if bias is not None:
        out += bias
    return out.reshape(*lead, weight.shape[0]).astype(dtype, copy=False)


# ---- views and layout ----
@kernel("reshape")
def reshape(x: Any, shape: Any) -> Any:
    return x.reshape(shape)


@kernel("permute")
def permute(x: Any, perm: Any) -> Any:
    return x.transpose(perm)


@kernel("expand")
def expand(x: Any, shape: Any) -> Any:
    return cp.broadcast_to(x, shape)


@kernel("slice")
def slice_(x: Any, dim: int, start: int, end: int, step: int) -> Any:
    return x[(slice(None),) * dim + (slice(start, end, step),)]


@kernel("cat")
def cat(*xs: Any, dim: int) -> Any:
    return cp.concatenate(xs, axis=dim)


@kernel("copy")
def copy(x: Any) -> Any:
    return x.copy()


# ---- gathers and cache writes ----
@kernel("embedding")
def embedding(weight: Any, indices: Any) -> Any:
    return cp.take(weight, indices, axis=0)


def _target(x: Any, in_place: bool) -> Any:
    """The state buffer itself when the program marked the write in place and x owns its memory, else a copy."""
    return x if in_place and x.base is None and x.flags.c_contiguous else x.copy()


def _last_writer(index: Any) -> Any:
    """For each position j of a 1-d index, the last position k with index[k] == index[j].

    A GPU scatter with repeated indices lets any of the writers win; PyTorch (and the CPU backend) keep the last.
    Giving every writer of a slot the last writer's value makes the race harmless, without a host round trip to
    drop the repeats. Quadratic in the index length, which is a chunk of tokens for a KV cache.
    """
    n = index.shape[0]
    same = index[:, None] == index[None, :]
    return cp.max(cp.where(same, cp.arange(n)[None, :], -1), axis=1)


def _write(out: Any, dim: int, index: Any, source: Any) -> Any:
    if index.ndim == 1 and index.shape[0] > 1:
        source = cp.broadcast_to(source, out[(slice(None),) * dim + (index,)].shape)
        source = cp.take(source, _last_writer(index), axis=dim)
    out[(slice(None),) * dim + (index,)] = source
    return out


@kernel("index_copy")
def index_copy(x: Any, index: Any, source: Any, dim: int, in_place: bool) -> Any:
    return _write(_target(x, in_place), dim, index, source)


@kernel("slice_scatter")
def slice_scatter(x: Any, source: Any, dim: int, start: int, end: int, step: int, in_place: bool) -> Any:
    out = _target(x, in_place)
    out[(slice(None),) * dim + (slice(start, end, step),)] = source
    return out


@kernel("index_put")
def index_put(x: Any, values: Any, *indices: Any, dims: Any, accumulate: bool, in_place: bool) -> Any:
    """Only the KV-cache form (one 1-d integer index, no accumulation) runs here; others go to the host."""
    if accumulate or len(indices) != 1 or len(dims) != 1 or indices[0].dtype == cp.bool_ or indices[0].ndim != 1:
        raise OnHost
    return _write(_target(x, in_place), dims[0], indices[0], values)


# ---- normalization and softmax ----
@kernel("rms_norm")
def rms_norm(x: Any, weight: Any, axes: int, eps: float | None) -> Any:
    dtype = x.dtype
    if eps is None:
        eps = float(np.finfo(dtype).eps)
    d = x.shape[-1] if x.ndim else 1
    if axes == 1 and x.ndim and x.size and _contiguous_f32(x) and (
            weight is None or (_contiguous_f32(weight) and weight.size == d)):
        out = cp.empty_like(x)
        block = min(1024, 32 * ((d + 31) // 32))
        args = (x, x if weight is None else weight, out, np.int32(d), np.float32(eps), np.int32(weight is not None))
        nvrtc.function("fused", "rms_norm_f32")((x.size // d,), (block,), args)
        return out
    xf, weight = _upcast(x, weight)
    dims = tuple(range(x.ndim - axes, x.ndim))
    out = xf * (1 / cp.sqrt(cp.mean(xf * xf, axis=dims, keepdims=True) + xf.dtype.type(eps)))
    if weight is not None:
        out = out * weight
    return out.astype(dtype, copy=False)


@kernel("layer_norm")
def layer_norm(x: Any, weight: Any, bias: Any, axes: int, eps: float) -> Any:
    dtype = x.dtype
    xf, weight, bias = _upcast(x, weight, bias)
    dims = tuple(range(x.ndim - axes, x.ndim))
    centered = xf - xf.mean(axis=dims, keepdims=True)
    out = centered / cp.sqrt(cp.mean(centered * centered, axis=dims, keepdims=True) + xf.dtype.type(eps))
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(dtype, copy=False)


@kernel("softmax")
@_in_float32
def softmax(x: Any, dim: int) -> Any:
    e = cp.exp(x - cp.max(x, axis=dim, keepdims=True))
    e /= cp.sum(e, axis=dim, keepdims=True)
    return e


# ---- attention ----
@kernel("rope")
def rope(x: Any, cos: Any, sin: Any, interleaved: bool = False) -> Any:
    dtype = x.dtype
    xf, cos, sin = _upcast(x, cos, sin)
    if interleaved:
        rotated = cp.empty_like(xf)
        rotated[..., 0::2] = -xf[..., 1::2]
        rotated[..., 1::2] = xf[..., 0::2]
    else:
        half = xf.shape[-1] // 2
        rotated = cp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(dtype, copy=False)


@kernel("sdpa")
def sdpa(q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None) -> Any:
    """softmax(q k^T * scale + mask) v with batched cuBLAS products; GQA by grouping q heads per kv head.

    Unlike the CPU kernel it attends every cache slot: narrowing to the visible keys needs the mask on the host,
    and that synchronization per layer cost more than it saved (SmolLM2-shaped decode at 128 of 512 slots on an
    H100: 78.6 ms with it, 73.1 without); a fused decode kernel that skips unwritten slots on the device is the way
    to get that back."""
    dtype = q.dtype
    q, k, v, mask = _upcast(q, k, v, mask)
    return array_api.sdpa(cp, q, k, v, mask, causal, scale).astype(dtype, copy=False)
