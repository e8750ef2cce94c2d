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
from kiln.runtime.backends.array_api import LOW_PRECISION
from kiln.runtime.backends.array_api import upcast as _upcast
from kiln.runtime.backends.base import KernelRegistry
from kiln.runtime.backends.cuda import cublas, nvrtc

CUDA_KERNELS = KernelRegistry("cuda")
kernel = CUDA_KERNELS.register


class OnHost(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a CUDA kernel for arguments it does not handle: the backend runs the op's CPU kernel on the host
    instead (and reports it in host_ops), as for ops that have no CUDA kernel at all."""


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


@kernel("div")
def div(a: Any, b: Any, rounding_mode: str) -> Any:
    return array_api.div(cp, a, b, rounding_mode)


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


def _contiguous(*arrays: Any) -> bool:
    return all(a.flags.c_contiguous for a in arrays)


def _grid(n: int, block: int = 256) -> tuple[int]:
    return (max(1, min((n + block - 1) // block, 65535)),)


_GATE_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def _rows(x: Any) -> Any | None:
    """x as [rows, last dim] with unit stride along a row (a view whenever the leading dims collapse, as they do
    for the slices of a fused projection), or None."""
    if x.ndim == 0 or x.shape[-1] == 0:
        return None
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.strides[1] == x.itemsize else None


@kernel("gated_activation")
def gated_activation(gate: Any, up: Any, activation: str) -> Any:
    if gate.shape == up.shape and gate.size and nvrtc.supports(gate, up):
        g, u = _rows(gate), _rows(up)
        if g is not None and u is not None:
            out = cp.empty(gate.shape, dtype=gate.dtype)
            d = gate.shape[-1]
            nvrtc.function("fused", "gated", gate.dtype)(
                _grid(gate.size), (256,), (g, u, out, np.int64(g.shape[0]), np.int32(d),
                                           np.int64(g.strides[0] // g.itemsize), np.int64(u.strides[0] // u.itemsize),
                                           np.int32(_GATE_CODES[activation])))
            return out
    dtype = gate.dtype
    g, u = _upcast(gate, up)
    return (_GATES[activation](g) * u).astype(dtype, copy=False)


# ---- matrix products (cuBLAS) ----
def _matmul(a: Any, b: Any) -> Any:
    """a @ b on cuBLAS (kiln.runtime.backends.cuda.cublas: capturable, bfloat16 included); 1-d operands as
    one-row / one-column matrices; integer products through CuPy (cuBLAS has none)."""
    if not (a.dtype == b.dtype and cublas.supports(a.dtype)):
        return cp.matmul(a, b)
    if a.ndim == 1:
        return _matmul(a[None], b)[..., 0, :]
    if b.ndim == 1:
        return _matmul(a, b[:, None])[..., 0]
    return cublas.matmul(a, b)


@kernel("matmul")
def matmul(a: Any, b: Any) -> Any:
    return _matmul(a, b)


@kernel("linear")
def linear(x: Any, weight: Any, bias: Any) -> Any:
    """x @ W^T with W^T as a transposed view: cuBLAS reads the [out, in] weight as it is, no copy per call. The
    bias is added inside the product (beta = 1), rounded once, as PyTorch's addmm does."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # 2-d: one gemm, not a batch of them
    if not (x.dtype == weight.dtype and cublas.supports(x.dtype)):
        out = cp.matmul(x2, weight.T)
        if bias is not None:
            out += bias
    else:
        out = None
        if bias is not None:
            out = cp.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype)
            out[...] = bias
        out = cublas.matmul(x2, weight.T, out=out, accumulate=bias is not None)
    return out.reshape(*lead, weight.shape[0])


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
    extra = () if weight is None else (weight,)
    if axes == 1 and x.ndim and x.size and _contiguous(x, *extra) and nvrtc.supports(x, *extra) and (
            weight is None or weight.size == d):
        out = cp.empty_like(x)
        block = min(1024, 32 * ((d + 31) // 32))
        args = (x, x if weight is None else weight, out, np.int32(d), np.float32(eps), np.int32(weight is not None))
        nvrtc.function("fused", "rms_norm", dtype)((x.size // d,), (block,), args)
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
    return array_api.layer_norm(cp, xf, weight, bias, axes, eps).astype(dtype, copy=False)


@kernel("softmax")
@_in_float32
def softmax(x: Any, dim: int) -> Any:
    return array_api.softmax(cp, x, dim)


# ---- attention ----
@kernel("rope")
def rope(x: Any, cos: Any, sin: Any, interleaved: bool = False) -> Any:
    if 1 <= x.ndim <= 4 and x.size and x.shape[-1] % 2 == 0 and cos.shape == sin.shape and cos.ndim <= x.ndim \
            and nvrtc.supports(x, cos, sin):
        return _rope_fused(x, cos, sin, interleaved)
    dtype = x.dtype
    xf, cos, sin = _upcast(x, cos, sin)
    return (xf * cos + array_api.rotate(cp, xf, interleaved) * sin).astype(dtype, copy=False)


def _elements(strides: tuple[int, ...], itemsize: int, ndim: int = 4) -> list[np.int64]:
    """Strides in elements, padded in front to `ndim` dims (a padded dim has size 1, so its stride is unused)."""
    return [np.int64(0)] * (ndim - len(strides)) + [np.int64(s // itemsize) for s in strides]


def _rope_fused(x: Any, cos: Any, sin: Any, interleaved: bool) -> Any:
    """One kernel reading x in any layout (q and k arrive as transposed views) and cos/sin broadcast in place."""
    shape = (1,) * (4 - x.ndim) + x.shape
    cos_b, sin_b = cp.broadcast_to(cos, x.shape), cp.broadcast_to(sin, x.shape)
    if cos_b.strides != sin_b.strides:
        sin_b = cp.ascontiguousarray(sin_b)
        cos_b = cp.ascontiguousarray(cos_b)
    out = cp.empty(x.shape, dtype=x.dtype)
    args = (x, cos_b, sin_b, out, np.int32(shape[1]), np.int32(shape[2]), np.int32(shape[3]),
            *_elements(x.strides, x.itemsize), *_elements(cos_b.strides, cos_b.itemsize),
            np.int64(x.size), np.int32(bool(interleaved)))
    nvrtc.function("fused", "rope", x.dtype)(_grid(x.size), (256,), args)
    return out


@kernel("sdpa")
def sdpa(q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None) -> Any:
    """softmax(q k^T * scale + mask) v with batched cuBLAS products; GQA by grouping q heads per kv head.

    Unlike the CPU kernel it attends every cache slot: narrowing to the visible keys needs the mask on the host,
    and that synchronization per layer cost more than it saved (SmolLM2-shaped decode at 128 of 512 slots on an
    H100: 78.6 ms with it, 73.1 without); a fused decode kernel that skips unwritten slots on the device is the way
    to get that back."""
    if _decode_attention_applies(q, k, v, mask, causal):
        return _decode_attention(q, k, v, mask, scale)
    dtype = q.dtype
    q, k, v, mask = _upcast(q, k, v, mask)
    return array_api.sdpa(cp, q, k, v, mask, causal, scale, matmul=_matmul).astype(dtype, copy=False)


ATTN_CHUNK, ATTN_MAX_E, ATTN_MAX_G, ATTN_THREADS = 32, 256, 16, 256  # as fused.cu defines them
COMBINE_THREADS, COMBINE_MAX_SPLITS = 256, 2048


def _decode_attention_applies(q: Any, k: Any, v: Any, mask: Any, causal: bool) -> bool:
    """One query per head over a cache in its own layout: the split-key kernel of fused.cu."""
    if causal or q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[2] != 1 or not nvrtc.supports(q, k, v):
        return False
    if k.shape[2] > ATTN_CHUNK * COMBINE_MAX_SPLITS:
        return False
    b, hq, _, e = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != e or e > ATTN_MAX_E or k.shape[2] == 0:
        return False
    if hq % k.shape[1] or hq // k.shape[1] > ATTN_MAX_G or k.strides[3] != k.itemsize or v.strides[3] != v.itemsize:
        return False
    return mask is None or (mask.ndim <= 4 and (mask.dtype == cp.bool_ or mask.dtype.kind == "f"))


def _decode_attention(q: Any, k: Any, v: Any, mask: Any, scale: float | None) -> Any:
    """Keys split in chunks of ATTN_CHUNK, each block serving the q heads of one kv head (k and v read once per
    group) and skipping the keys the mask hides (a static cache's unwritten slots cost no reads); a second kernel
    combines the chunks' softmax partials."""
    b, hq, _, e = q.shape
    hkv, seq = k.shape[1], k.shape[2]
    q = cp.ascontiguousarray(q)
    if mask is None:
        kind, mask_b, mstrides = 0, q, [np.int64(0)] * 3
    else:
        kind = 1 if mask.dtype == cp.bool_ else 2
        if kind == 2 and mask.dtype != cp.float32:
            mask = mask.astype(cp.float32)
        mask_b = cp.broadcast_to(mask, (b, hq, 1, seq))
        ms = _elements(mask_b.strides, mask_b.itemsize)
        mstrides = [ms[0], ms[1], ms[3]]
    splits = (seq + ATTN_CHUNK - 1) // ATTN_CHUNK
    part = cp.empty((b, hq, splits, e + 2), dtype=cp.float32)
    ks, vs = _elements(k.strides, k.itemsize), _elements(v.strides, v.itemsize)
    scale = 1 / math.sqrt(e) if scale is None else scale
    nvrtc.function("fused", "attend_split", q.dtype)(
        (splits, hkv, b), (ATTN_THREADS,),
        (q, k, v, mask_b, part, np.int32(hq // hkv), np.int32(seq), np.int32(e), np.float32(scale),
         ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], np.int32(kind), *mstrides, np.int32(splits)))
    out = cp.empty((b, hq, 1, e), dtype=q.dtype)
    nvrtc.function("fused", "attend_combine", q.dtype)(
        (b * hq,), (COMBINE_THREADS,), (part, out, np.int32(e), np.int32(splits)))
    return out
