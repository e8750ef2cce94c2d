"""Convolution and pooling over N spatial dims (channels first), as aten.convolution and the pooling ops.

Convolution is im2col through a strided window view and one tensordot per group (BLAS), with direct paths for
1x1 kernels and depthwise convolutions, where im2col would only copy.
"""

from __future__ import annotations

import itertools

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel, upcast


def _windows(x: np.ndarray, kernel_size: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...],
             out: tuple[int, ...]) -> np.ndarray:
    """View of x [..., *spatial] as [..., *out, *kernel]: element (o, k) is x[o * stride + k * dilation]."""
    nsp = len(kernel_size)
    lead_shape, lead_strides = x.shape[:-nsp], x.strides[:-nsp]
    sp_strides = x.strides[-nsp:]
    shape = lead_shape + tuple(out) + tuple(kernel_size)
    strides = lead_strides + tuple(s * st for s, st in zip(sp_strides, stride)) + tuple(
        s * d for s, d in zip(sp_strides, dilation))
    return as_strided(x, shape, strides, writeable=False)


def _pad_spatial(x: np.ndarray, before: tuple[int, ...], after: tuple[int, ...], value: float) -> np.ndarray:
    if not any(before) and not any(after):
        return x
    nsp = len(before)
    widths = [(0, 0)] * (x.ndim - nsp) + list(zip(before, after))
    return np.pad(x, widths, constant_values=value)


def _conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


@kernel("conv")
def conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, stride, padding, dilation, groups: int,
         transposed: bool, output_padding) -> np.ndarray:
    dtype = x.dtype
    x, weight, bias = upcast(x, weight, bias)
    if transposed:
        out = _conv_transposed(x, weight, stride, padding, dilation, groups, output_padding)
    else:
        out = _conv_forward(x, weight, stride, padding, dilation, groups)
    if bias is not None:
        out += bias.reshape((1, -1) + (1,) * (out.ndim - 2))
    return out.astype(dtype, copy=False) if dtype in LOW_PRECISION else out


def _conv_forward(x, weight, stride, padding, dilation, groups):
    n, c = x.shape[:2]
    o, cg = weight.shape[:2]
    ks = weight.shape[2:]
    nsp = len(ks)
    out_sp = tuple(_conv_out(x.shape[2 + i], ks[i], stride[i], padding[i], dilation[i]) for i in range(nsp))
    if all(k == 1 for k in ks) and not any(padding) and groups == 1:
        xs = x[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)]
        res = np.matmul(weight.reshape(o, c), xs.reshape(n, c, -1))
        return res.reshape((n, o) + out_sp)
    xp = _pad_spatial(x, tuple(padding), tuple(padding), 0.0)
    if cg == 1 and groups == c:
        return _depthwise(xp, weight, stride, dilation, out_sp)
    win = _windows(xp, ks, stride, dilation, out_sp)  # [n, c, *out, *k]
    og = o // groups
    parts = []
    k_axes = list(range(2 + nsp, 2 + 2 * nsp))
    for g in range(groups):
        wg = weight[g * og:(g + 1) * og]
        xg = win[:, g * cg:(g + 1) * cg]
        res = np.tensordot(xg, wg, axes=([1] + k_axes, [1] + list(range(2, 2 + nsp))))  # [n, *out, og]
        parts.append(np.moveaxis(res, -1, 1))
    return parts[0] if groups == 1 else np.concatenate(parts, axis=1)


def _depthwise(xp, weight, stride, dilation, out_sp):
    """groups == channels: one multiply-add per kernel tap over strided views of the padded input."""
    n, c = xp.shape[:2]
    o = weight.shape[0]
    mult = o // c
    if mult > 1:
        xp = np.repeat(xp, mult, axis=1)
    out = np.zeros((n, o) + out_sp, dtype=np.result_type(xp, weight))
    for taps in itertools.product(*(range(k) for k in weight.shape[2:])):
        sl = tuple(slice(t * d, t * d + (size - 1) * s + 1, s) for t, d, s, size in zip(taps, dilation, stride, out_sp))
        w = weight[(slice(None), 0) + taps].reshape((1, o) + (1,) * len(out_sp))
        out += xp[(slice(None), slice(None)) + sl] * w
    return out


def _conv_transposed(x, weight, stride, padding, dilation, groups, output_padding):
    """The adjoint of convolution: every input element scatters weight * x into the output."""
    n, c = x.shape[:2]
    og = weight.shape[1]
    ks = weight.shape[2:]
    nsp = len(ks)
    op = tuple(output_padding) if output_padding else (0,) * nsp
    full = tuple((x.shape[2 + i] - 1) * stride[i] + dilation[i] * (ks[i] - 1) + 1 + op[i] for i in range(nsp))
    out = np.zeros((n, og * groups) + full, dtype=np.result_type(x, weight))
    cg = c // groups
    for g in range(groups):
        xg = x[:, g * cg:(g + 1) * cg]
        wg = weight[g * cg:(g + 1) * cg]  # [cg, og, *k]
        for taps in itertools.product(*(range(k) for k in ks)):
            contrib = np.tensordot(xg, wg[(slice(None), slice(None)) + taps], axes=([1], [0]))  # [n, *sp, og]
            contrib = np.moveaxis(contrib, -1, 1)
            sl = tuple(slice(t * d, t * d + (x.shape[2 + i] - 1) * s + 1, s)
                       for i, (t, d, s) in enumerate(zip(taps, dilation, stride)))
            out[(slice(None), slice(g * og, (g + 1) * og)) + sl] += contrib
    crop = tuple(slice(p, full[i] - p) for i, p in enumerate(padding))
    return out[(slice(None), slice(None)) + crop]


def _pool_geometry(in_sp, kernel_size, stride, padding, dilation, ceil_mode):
    """Output sizes as PyTorch computes them, and the extra right padding that ceil_mode needs."""
    outs, extra = [], []
    for size, k, s, p, d in zip(in_sp, kernel_size, stride, padding, dilation):
        span = size + 2 * p - d * (k - 1) - 1
        out = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        outs.append(out)
        extra.append(max(0, (out - 1) * s + d * (k - 1) + 1 - (size + 2 * p)))
    return tuple(outs), tuple(extra)


@kernel("max_pool")
def max_pool(x: np.ndarray, kernel, stride, padding, dilation, ceil_mode: bool) -> np.ndarray:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    out_sp, extra = _pool_geometry(x.shape[-nsp:], kernel, stride, padding, dilation, ceil_mode)
    fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    xp = _pad_spatial(x, tuple(padding), tuple(p + e for p, e in zip(padding, extra)), fill)
    win = _windows(xp, tuple(kernel), stride, tuple(dilation), out_sp)
    return win.max(axis=tuple(range(-nsp, 0)))


@kernel("avg_pool")
def avg_pool(x: np.ndarray, kernel, stride, padding, ceil_mode: bool, count_include_pad: bool,
             divisor: int | None) -> np.ndarray:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    ones = (1,) * nsp
    dtype = x.dtype
    (x,) = upcast(x)
    in_sp = x.shape[-nsp:]
    out_sp, extra = _pool_geometry(in_sp, kernel, stride, padding, ones, ceil_mode)
    after = tuple(p + e for p, e in zip(padding, extra))
    xp = _pad_spatial(x, tuple(padding), after, 0.0)
    axes = tuple(range(-nsp, 0))
    total = _windows(xp, tuple(kernel), stride, ones, out_sp).sum(axis=axes)
    if divisor is not None:
        return (total / divisor).astype(dtype, copy=False)
    # Count of the elements each window covers: inside the padded input (count_include_pad) or the real input.
    counts = np.ones(1, dtype=np.float64)
    for i in range(nsp):
        size, k, s, p = in_sp[i], kernel[i], stride[i], padding[i]
        starts = np.arange(out_sp[i]) * s - p
        lo, hi = (-p, size + p) if count_include_pad else (0, size)
        c = np.minimum(starts + k, hi) - np.maximum(starts, lo)
        counts = np.multiply.outer(counts, c) if i else c.astype(np.float64)
    return (total / counts).astype(dtype, copy=False)
