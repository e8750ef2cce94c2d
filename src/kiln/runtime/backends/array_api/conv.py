"""Convolution and pooling over N spatial dims (channels first), written once for both backends.

Convolution is im2col + one matrix product per group: the patch matrix is built tap by tap (one strided block copy
per kernel offset, so every copy moves a whole output plane) in the layout [C*K, out] that makes the weight
[O, C*K] multiply it directly into channels-first output, with no transpose after. 1x1 kernels skip im2col, and
depthwise convolutions (and pooling) accumulate tap by tap, where a product would have nothing to share. Each
backend registers its own conv around these (the CPU's compiled paths; the GPU's product on its cuBLAS handle).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.runtime.backends.array_api.core import LOW_PRECISION, portable, upcast

Matmul = Callable[[Any, Any], Any]


def tap_slices(taps: tuple[int, ...], stride: Any, dilation: Any, out_sp: Any) -> tuple[slice, ...]:
    """Slices of a padded input that give, for every output position o, the element o * stride + taps * dilation."""
    return tuple(slice(t * d, t * d + (size - 1) * s + 1, s)
                 for t, d, s, size in zip(taps, dilation, stride, out_sp, strict=True))


def pad_spatial(xp: Any, x: Any, before: tuple[int, ...], after: tuple[int, ...], value: float) -> Any:
    """x with the trailing len(before) dims padded by `value` (a fill and one block copy: faster than pad)."""
    if not any(before) and not any(after):
        return x
    nsp = len(before)
    lead = x.shape[:-nsp]
    shape = lead + tuple(s + b + a for s, b, a in zip(x.shape[-nsp:], before, after, strict=True))
    out = xp.full(shape, value, dtype=x.dtype)
    out[(Ellipsis,) + tuple(slice(b, b + s) for b, s in zip(before, x.shape[-nsp:], strict=True))] = x
    return out


def conv_out(size: int, k: int, s: int, p: int, d: int, p_end: int | None = None) -> int:
    return (size + p + (p if p_end is None else p_end) - d * (k - 1) - 1) // s + 1


def convolve(xp: Any, x: Any, weight: Any, stride: Any, padding: Any, padding_end: Any, dilation: Any, groups: int,
             transposed: bool, output_padding: Any, matmul: Matmul | None = None) -> Any:
    """The convolution without bias or activation (x and weight float32 or wider, padding_end resolved)."""
    matmul = matmul or xp.matmul
    if transposed:
        if tuple(padding_end) != tuple(padding):
            raise ValueError("a transposed convolution takes symmetric padding only")
        return _conv_transposed(xp, x, weight, stride, padding, dilation, groups, output_padding, matmul)
    return _conv_forward(xp, x, weight, stride, padding, padding_end, dilation, groups, matmul)


def epilogue(xp: Any, out: Any, bias: Any, activation: str, lo: float | None, hi: float | None) -> None:
    """Add the bias per channel and apply the fused activation to a (freshly allocated) conv output, in place."""
    if bias is not None:
        out += bias.reshape((1, -1) + (1,) * (out.ndim - 2))
    if activation == "clamp":
        if lo is not None:
            xp.maximum(out, out.dtype.type(lo), out=out)
        if hi is not None:
            xp.minimum(out, out.dtype.type(hi), out=out)
    elif activation == "hardswish":
        out *= xp.clip(out + 3, 0, 6) / 6
    elif activation != "none":
        raise ValueError(f"unknown conv activation {activation!r}")


def conv(xp: Any, x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, groups: int,
         transposed: bool, output_padding: Any, padding_end: Any, activation: str, activation_min: float | None,
         activation_max: float | None, matmul: Matmul | None = None) -> Any:
    """The op: float16/bfloat16 computed in float32 and rounded back."""
    dtype = x.dtype
    x, weight, bias = upcast(x, weight, bias)
    out = convolve(xp, x, weight, stride, padding, tuple(padding_end) or tuple(padding), dilation, groups,
                   transposed, output_padding, matmul)
    epilogue(xp, out, bias, activation, activation_min, activation_max)
    return out.astype(dtype, copy=False)


def _conv_forward(xp: Any, x: Any, weight: Any, stride: Any, padding: Any, padding_end: Any, dilation: Any,
                  groups: int, matmul: Matmul) -> Any:
    n, c = x.shape[:2]
    o, cg = weight.shape[:2]
    ks = weight.shape[2:]
    nsp = len(ks)
    out_sp = tuple(conv_out(x.shape[2 + i], ks[i], stride[i], padding[i], dilation[i], padding_end[i])
                   for i in range(nsp))
    if all(k == 1 for k in ks) and not any(padding) and not any(padding_end) and groups == 1:
        xs = x[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)]
        res = matmul(weight.reshape(o, c), xp.ascontiguousarray(xs).reshape(n, c, -1))
        return res.reshape((n, o) + out_sp)
    if cg == 1 and groups == c == o and 0 not in out_sp:
        return depthwise(xp, x, weight, stride, padding, padding_end, dilation, out_sp)
    padded = pad_spatial(xp, x, tuple(padding), tuple(padding_end), 0.0)
    cols = xp.empty((n, c) + tuple(ks) + out_sp, dtype=np.result_type(x.dtype, weight.dtype))  # [n, c, *k, *out]
    for taps in itertools.product(*(range(k) for k in ks)):
        cols[(slice(None), slice(None)) + taps] = padded[(slice(None), slice(None))
                                                         + tap_slices(taps, stride, dilation, out_sp)]
    kk = math.prod(ks)
    length = math.prod(out_sp)
    cols = cols.reshape(n, groups, cg * kk, length)
    res = matmul(weight.reshape(groups, o // groups, cg * kk), cols)  # [n, groups, o/groups, length]
    return res.reshape((n, o) + out_sp)


DEPTHWISE_BLOCK_BYTES = 1 << 19
"""Channels per step of the depthwise loop are chosen so one output block is about this big and stays in cache
across all kernel taps (measured ~1.5x faster than whole-array passes on EfficientNet-lite0's layers)."""


def _phases(xp: Any, x: Any, ks: Any, stride: Any, padding: Any, padding_end: Any, dilation: Any,
            out_sp: Any) -> tuple[Any, list[int], list[int], int, tuple[int, ...]]:
    """The zero-padded input split by stride phase, flattened per channel, and each tap's (phase, flat offset).

    Padded position j * s + f of a dim lands in phase f at index j, so a strided convolution becomes stride 1 inside
    each phase. With phases of shape q, output position o (row-major index m in a grid [out_0, *q[1:]], whose extra
    columns are dropped at the end) reads flat element m + offset of its tap's phase: every tap is one contiguous
    1-d slice, so each tap is one long pass even on 7x7 feature maps, with no stride-2 reads.
    Returns (buffer [n, c, phases, length], phase per tap, offset per tap, m, q).
    """
    n, c = x.shape[:2]
    nsp = len(ks)
    q = tuple(-(-(size + p + e) // s) for size, p, e, s in zip(x.shape[2:], padding, padding_end, stride, strict=True))
    pitch = [math.prod(q[i + 1:]) for i in range(nsp)]
    phases: dict[tuple[int, ...], int] = {}
    phase_of, offsets = [], []
    for taps in itertools.product(*(range(k) for k in ks)):
        pos = [t * d for t, d in zip(taps, dilation, strict=True)]
        phase_of.append(phases.setdefault(tuple(p % s for p, s in zip(pos, stride, strict=True)), len(phases)))
        offsets.append(sum((p // s) * pi for p, s, pi in zip(pos, stride, pitch, strict=True)))
    m = out_sp[0] * pitch[0]
    size = math.prod(q)
    buf = xp.zeros((n, c, len(phases), max(size, max(offsets) + m)), dtype=x.dtype)
    for phase, index in phases.items():
        src, dst = [], []
        for f, s, p, length in zip(phase, stride, padding, x.shape[2:], strict=True):
            j0 = max(0, -(-(p - f) // s))  # first phase index that falls inside x (not in the padding)
            x0 = j0 * s + f - p
            src.append(slice(x0, length, s))
            dst.append(slice(j0, j0 + len(range(x0, length, s))))
        view = buf[:, :, index, :size].reshape((n, c) + q)
        view[(slice(None), slice(None)) + tuple(dst)] = x[(slice(None), slice(None)) + tuple(src)]
    return buf, phase_of, offsets, m, q


def depthwise(xp: Any, x: Any, weight: Any, stride: Any, padding: Any, padding_end: Any, dilation: Any,
              out_sp: Any) -> Any:
    """groups == channels == out channels: one multiply-add per kernel tap, channel block by channel block."""
    n, c = x.shape[:2]
    dtype = np.result_type(x.dtype, weight.dtype)
    buf, phase_of, offsets, m, q = _phases(xp, x.astype(dtype, copy=False), weight.shape[2:], stride, padding,
                                           padding_end, dilation, out_sp)
    w = weight.reshape(c, -1)
    out = xp.empty((n, c, m), dtype=dtype)
    block = max(1, DEPTHWISE_BLOCK_BYTES // (dtype.itemsize * m))
    tmp = xp.empty((min(block, c), m), dtype=dtype)
    for b in range(n):
        for c0 in range(0, c, block):
            c1 = min(c, c0 + block)
            ob, tb, xb, wb = out[b, c0:c1], tmp[:c1 - c0], buf[b, c0:c1], w[c0:c1]
            for i, (phase, off) in enumerate(zip(phase_of, offsets, strict=True)):
                xs = xb[:, phase, off:off + m]
                if i == 0:
                    xp.multiply(xs, wb[:, i:i + 1], out=ob)
                else:
                    xp.multiply(xs, wb[:, i:i + 1], out=tb)
                    ob += tb
    out = out.reshape((n, c, out_sp[0]) + q[1:])[(slice(None), slice(None)) + tuple(slice(0, s) for s in out_sp)]
    return xp.ascontiguousarray(out)


def _conv_transposed(xp: Any, x: Any, weight: Any, stride: Any, padding: Any, dilation: Any, groups: int,
                     output_padding: Any, matmul: Matmul) -> Any:
    """The adjoint of convolution: every input element scatters weight * x into the output, tap by tap."""
    n, c = x.shape[:2]
    og = weight.shape[1]
    ks = weight.shape[2:]
    nsp = len(ks)
    op = tuple(output_padding) if output_padding else (0,) * nsp
    full = tuple((x.shape[2 + i] - 1) * stride[i] + dilation[i] * (ks[i] - 1) + 1 + op[i] for i in range(nsp))
    out = xp.zeros((n, og * groups) + full, dtype=np.result_type(x.dtype, weight.dtype))
    cg = c // groups
    for g in range(groups):
        xg = xp.ascontiguousarray(x[:, g * cg:(g + 1) * cg]).reshape(n, cg, -1)
        wg = weight[g * cg:(g + 1) * cg]  # [cg, og, *k]
        for taps in itertools.product(*(range(k) for k in ks)):
            w_tap = xp.ascontiguousarray(wg[(slice(None), slice(None)) + taps].T)  # [og, cg]
            contrib = matmul(w_tap, xg).reshape((n, og) + tuple(x.shape[2:]))
            sl = tap_slices(taps, stride, dilation, x.shape[2:])
            out[(slice(None), slice(g * og, (g + 1) * og)) + sl] += contrib
    crop = tuple(slice(p, full[i] - p) for i, p in enumerate(padding))
    return out[(slice(None), slice(None)) + crop]


# ---- pooling ----
def pool_geometry(in_sp: Any, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
                  ceil_mode: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Output sizes as PyTorch computes them, and the extra right padding that ceil_mode needs."""
    outs, extra = [], []
    for size, k, s, p, d in zip(in_sp, kernel_size, stride, padding, dilation, strict=True):
        span = size + 2 * p - d * (k - 1) - 1
        out = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        outs.append(out)
        extra.append(max(0, (out - 1) * s + d * (k - 1) + 1 - (size + 2 * p)))
    return tuple(outs), tuple(extra)


def _reduce_taps(xp: Any, padded: Any, kernel_size: Any, stride: Any, dilation: Any, out_sp: Any,
                 function: str) -> Any:
    """Reduce every pooling window with a binary ufunc, one whole-output call per kernel tap (fast strided views,
    unlike a reduction over a window view's tiny trailing axes)."""
    ufunc = getattr(xp, function)
    nsp = len(kernel_size)
    lead = (slice(None),) * (padded.ndim - nsp)
    out = None
    for taps in itertools.product(*(range(k) for k in kernel_size)):
        xs = padded[lead + tap_slices(taps, stride, dilation, out_sp)]
        if out is None:
            out = xs.copy()
        else:
            ufunc(out, xs, out=out)
    return out


@portable("max_pool")
def max_pool(xp: Any, x: Any, kernel: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool) -> Any:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    out_sp, extra = pool_geometry(x.shape[-nsp:], kernel, stride, padding, dilation, ceil_mode)
    fill = -np.inf if x.dtype.kind == "f" or x.dtype in LOW_PRECISION else np.iinfo(x.dtype).min
    padded = pad_spatial(xp, x, tuple(padding), tuple(p + e for p, e in zip(padding, extra, strict=True)), fill)
    # maximum propagates NaN as torch's max pooling does.
    return _reduce_taps(xp, padded, tuple(kernel), stride, tuple(dilation), out_sp, "maximum")


@portable("avg_pool")
def avg_pool(xp: Any, x: Any, kernel: Any, stride: Any, padding: Any, ceil_mode: bool, count_include_pad: bool,
             divisor: int | None) -> Any:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    ones = (1,) * nsp
    dtype = x.dtype
    (x,) = upcast(x)
    in_sp = x.shape[-nsp:]
    out_sp, extra = pool_geometry(in_sp, kernel, stride, padding, ones, ceil_mode)
    after = tuple(p + e for p, e in zip(padding, extra, strict=True))
    padded = pad_spatial(xp, x, tuple(padding), after, 0.0)
    total = _reduce_taps(xp, padded, tuple(kernel), stride, ones, out_sp, "add")
    if divisor is not None:
        return (total / divisor).astype(dtype, copy=False)
    # Count of the elements each window covers: inside the padded input (count_include_pad) or the real input,
    # computed where the data lives (a host table uploaded per call would stop a GPU method from being captured).
    counts = None
    for i in range(nsp):
        size, k, s, p = in_sp[i], kernel[i], stride[i], padding[i]
        starts = xp.arange(out_sp[i], dtype=np.float64) * s - p
        lo, hi = (-p, size + p) if count_include_pad else (0, size)
        c = (xp.minimum(starts + k, hi) - xp.maximum(starts, lo)).reshape((-1,) + (1,) * (nsp - 1 - i))
        counts = c if counts is None else counts * c
    return (total / counts).astype(dtype, copy=False)


@portable("adaptive_pool")
def adaptive_pool(xp: Any, x: Any, output_size: Any, mode: str) -> Any:
    """Separable: an N-d box mean (or max) is the 1-d one along each axis in turn. Output index o of an axis of
    size I pools [floor(o*I/O), ceil((o+1)*I/O)), PyTorch's rule; averages accumulate in float32 for half inputs.
    Every window is read as the longest one's taps (a shorter window's extra taps repeat its last element for max
    and count zero for the mean), with the bounds computed where the data lives: no per-window pieces to join
    and no host table to upload, either of which would stop a GPU method from being captured."""
    dtype = x.dtype
    (out,) = upcast(x) if mode == "avg" else (x,)
    nsp = len(output_size)
    for i, o_size in enumerate(output_size):
        axis = x.ndim - nsp + i
        size = out.shape[axis]
        if o_size == 1:
            out = (xp.mean if mode == "avg" else xp.max)(out, axis=axis, keepdims=True)
            continue
        span = max(-((-(o + 1) * size) // o_size) - (o * size) // o_size for o in range(o_size))
        o = xp.arange(o_size)
        start = (o * size) // o_size
        length = -((-(o + 1) * size) // o_size) - start
        line = xp.moveaxis(out, axis, -1)
        acc = None
        for k in range(span):
            tap = xp.take(line, start + xp.minimum(k, length - 1), axis=-1)
            if mode == "avg":
                tap = xp.where(k < length, tap, tap.dtype.type(0))
                acc = tap if acc is None else acc + tap
            else:
                acc = tap if acc is None else xp.maximum(acc, tap)
        if mode == "avg":
            acc = acc / length.astype(acc.dtype)
        out = xp.moveaxis(acc, -1, axis)
    return out.astype(dtype, copy=False)
