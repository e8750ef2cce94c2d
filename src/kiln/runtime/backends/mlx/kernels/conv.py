"""Convolution on MLX's convolution (channels last: the input is moved to [N, *spatial, C] and the result back,
the weight to [O, *k, C/groups], once per program where it is a constant: prepare.py), transposed convolution as
the convolution of the stride-dilated input with the flipped kernel, and pooling composed tap by tap from strided
slices (MLX has no pooling primitive; inside a compiled method the taps fuse into one elementwise kernel)."""

from __future__ import annotations

import itertools
from typing import Any

import mlx.core as mx
import numpy as np

from kiln.runtime.backends.array_api.conv import pool_geometry, tap_slices
from kiln.runtime.backends.mlx.arrays import FLOATS, LOW_PRECISION
from kiln.runtime.backends.mlx.registry import kernel, upcast


def weight_channels_last(weight: mx.array, groups: int, transposed: bool) -> mx.array:
    """kiln's [O, C/g, *k] (transposed: [C, O/g, *k]) as MLX's [O, *k, C/g]."""
    nsp = weight.ndim - 2
    if not transposed:
        return mx.moveaxis(weight, 1, -1)
    c, og = weight.shape[:2]
    w = weight.reshape((groups, c // groups, og) + tuple(weight.shape[2:]))
    w = mx.transpose(w, (0, 2) + tuple(range(3, 3 + nsp)) + (1,))  # [g, O/g, *k, C/g]
    return w.reshape((groups * og,) + tuple(weight.shape[2:]) + (c // groups,))


def _epilogue(out: mx.array, bias: mx.array | None, activation: str, lo: float | None,
              hi: float | None) -> mx.array:
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * (out.ndim - 2))
    if activation == "clamp":
        if lo is not None:
            out = mx.maximum(out, lo)
        if hi is not None:
            out = mx.minimum(out, hi)
    elif activation == "hardswish":
        out = out * mx.clip(out + 3, 0, 6) / 6
    elif activation != "none":
        raise ValueError(f"unknown conv activation {activation!r}")
    return out


def convolve(x: mx.array, weight_cl: mx.array, stride: Any, padding: Any, dilation: Any, groups: int,
             transposed: bool, output_padding: Any, padding_end: Any) -> mx.array:
    """The convolution of channels-first x with a channels-last weight (weight_channels_last), channels first."""
    nsp = x.ndim - 2
    ks = weight_cl.shape[1:-1]
    xl = mx.moveaxis(x, 1, -1)
    if not transposed:
        out = mx.conv_general(xl, weight_cl, stride=list(stride), padding=(list(padding), list(padding_end)),
                              kernel_dilation=list(dilation), groups=groups)
    else:
        if tuple(padding_end) != tuple(padding):
            raise ValueError("a transposed convolution takes symmetric padding only")
        extra = tuple(output_padding) or (0,) * nsp
        lo = [d * (k - 1) - p for d, k, p in zip(dilation, ks, padding)]
        hi = [low + e for low, e in zip(lo, extra)]
        out = mx.conv_general(xl, weight_cl, stride=1, padding=([max(v, 0) for v in lo], [max(v, 0) for v in hi]),
                              kernel_dilation=list(dilation), input_dilation=list(stride), groups=groups, flip=True)
        # padding beyond the kernel's reach crops the output instead
        out = out[(slice(None),) + tuple(slice(max(-a, 0), out.shape[1 + i] - max(-b, 0))
                                         for i, (a, b) in enumerate(zip(lo, hi)))]
    return mx.moveaxis(out, -1, 1)


def conv_with(weight_cl: mx.array | None):
    """The conv kernel; with weight_cl (a constant weight already channels last) it ignores the weight input."""
    def conv(x: mx.array, weight: mx.array, bias: mx.array | None = None, *, stride: Any, padding: Any,
             dilation: Any, groups: int, transposed: bool, output_padding: Any, padding_end: Any, activation: str,
             activation_min: float | None, activation_max: float | None) -> mx.array:
        dtype = x.dtype
        w = weight_channels_last(weight, groups, transposed) if weight_cl is None else weight_cl
        x, w, bias = upcast(x, w, bias)
        out = convolve(x, w, stride, padding, dilation, groups, transposed, output_padding,
                       tuple(padding_end) or tuple(padding))
        return _epilogue(out, bias, activation, activation_min, activation_max).astype(dtype)
    return conv


kernel("conv")(conv_with(None))


# ---- pooling ----
def _pad_spatial(x: mx.array, before: Any, after: Any, value: Any) -> mx.array:
    if not any(before) and not any(after):
        return x
    nsp = len(before)
    widths = [(0, 0)] * (x.ndim - nsp) + list(zip(before, after))
    return mx.pad(x, widths, constant_values=mx.array(value, dtype=x.dtype))


def _reduce_taps(padded: mx.array, kernel_size: Any, stride: Any, dilation: Any, out_sp: Any, fn: Any) -> mx.array:
    nsp = len(kernel_size)
    lead = (slice(None),) * (padded.ndim - nsp)
    out = None
    for taps in itertools.product(*(range(k) for k in kernel_size)):
        xs = padded[lead + tap_slices(taps, stride, dilation, out_sp)]
        out = xs if out is None else fn(out, xs)
    return out


@kernel("max_pool")
def max_pool(x: mx.array, kernel: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool) -> mx.array:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    out_sp, extra = pool_geometry(x.shape[-nsp:], kernel, stride, padding, dilation, ceil_mode)
    fill = -np.inf if x.dtype in FLOATS else mx.iinfo(x.dtype).min
    padded = _pad_spatial(x, tuple(padding), tuple(p + e for p, e in zip(padding, extra)), fill)
    return _reduce_taps(padded, tuple(kernel), stride, tuple(dilation), out_sp, mx.maximum)


@kernel("avg_pool")
def avg_pool(x: mx.array, kernel: Any, stride: Any, padding: Any, ceil_mode: bool, count_include_pad: bool,
             divisor: int | None) -> mx.array:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    ones = (1,) * nsp
    dtype = x.dtype
    (x,) = upcast(x)
    in_sp = x.shape[-nsp:]
    out_sp, extra = pool_geometry(in_sp, kernel, stride, padding, ones, ceil_mode)
    padded = _pad_spatial(x, tuple(padding), tuple(p + e for p, e in zip(padding, extra)), 0.0)
    total = _reduce_taps(padded, tuple(kernel), stride, ones, out_sp, mx.add)
    if divisor is not None:
        return (total / divisor).astype(dtype)
    counts = np.ones((), dtype=np.float32)  # the elements each window covers, known from the geometry
    for i in range(nsp):
        size, k, s, p = in_sp[i], kernel[i], stride[i], padding[i]
        starts = np.arange(out_sp[i]) * s - p
        low, high = (-p, size + p) if count_include_pad else (0, size)
        c = (np.minimum(starts + k, high) - np.maximum(starts, low)).reshape((-1,) + (1,) * (nsp - 1 - i))
        counts = counts * c.astype(np.float32)
    return (total / mx.array(counts)).astype(dtype)


@kernel("adaptive_pool")
def adaptive_pool(x: mx.array, output_size: Any, mode: str) -> mx.array:
    """Separable: output index o of an axis of size I pools [floor(o*I/O), ceil((o+1)*I/O)); every window is read
    as the longest one's taps (a shorter window's extra taps repeat its last element for max and count zero for
    the mean); averages accumulate in float32 for half inputs."""
    dtype = x.dtype
    out = upcast(x)[0] if mode == "avg" else x
    nsp = len(output_size)
    for i, o_size in enumerate(output_size):
        axis = x.ndim - nsp + i
        size = out.shape[axis]
        if o_size == 1:
            out = (mx.mean if mode == "avg" else mx.max)(out, axis=axis, keepdims=True)
            continue
        o = np.arange(o_size)
        start = (o * size) // o_size
        length = -((-(o + 1) * size) // o_size) - start
        acc = None
        for k in range(int(length.max())):
            tap = mx.take(out, mx.array((start + np.minimum(k, length - 1)).astype(np.int32)), axis=axis)
            if mode == "avg":
                shape = [1] * out.ndim
                shape[axis] = o_size
                tap = mx.where(mx.array((k < length).reshape(shape)), tap, mx.zeros((), dtype=tap.dtype))
                acc = tap if acc is None else acc + tap
            else:
                acc = tap if acc is None else mx.maximum(acc, tap)
        if mode == "avg":
            shape = [1] * out.ndim
            shape[axis] = o_size
            acc = acc / mx.array(length.astype(np.float32).reshape(shape)).astype(acc.dtype)
        out = acc
    return out.astype(dtype) if dtype in LOW_PRECISION else out
