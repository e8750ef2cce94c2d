"""Convolution and pooling over N spatial dims (channels first), as aten.convolution and the pooling ops.

Convolution is im2col + one GEMM per group: the patch matrix is built tap by tap (one strided block copy per kernel
offset, so every copy moves a whole output plane) in the layout [C*K, out] that makes the weight [O, C*K] multiply it
directly into channels-first output, with no transpose after. 1x1 kernels skip im2col, and depthwise convolutions
(and pooling) accumulate tap by tap, where a GEMM would have nothing to share.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np

from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel, upcast


def _tap_slices(taps: tuple[int, ...], stride, dilation, out_sp) -> tuple[slice, ...]:
    """Slices of a padded input that give, for every output position o, the element o * stride + taps * dilation."""
    return tuple(slice(t * d, t * d + (size - 1) * s + 1, s)
                 for t, d, s, size in zip(taps, dilation, stride, out_sp, strict=True))


def _pad_spatial(x: np.ndarray, before: tuple[int, ...], after: tuple[int, ...], value: float) -> np.ndarray:
    """x with the trailing len(before) dims padded by `value` (a fill and one block copy: faster than np.pad)."""
    if not any(before) and not any(after):
        return x
    nsp = len(before)
    lead = x.shape[:-nsp]
    shape = lead + tuple(s + b + a for s, b, a in zip(x.shape[-nsp:], before, after, strict=True))
    out = np.full(shape, value, dtype=x.dtype)
    out[(Ellipsis,) + tuple(slice(b, b + s) for b, s in zip(before, x.shape[-nsp:], strict=True))] = x
    return out


def _conv_out(size: int, k: int, s: int, p: int, d: int, p_end: int | None = None) -> int:
    return (size + p + (p if p_end is None else p_end) - d * (k - 1) - 1) // s + 1


@kernel("conv")
def conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, stride, padding, dilation, groups: int,
         transposed: bool, output_padding, padding_end, activation: str, activation_min: float | None,
         activation_max: float | None) -> np.ndarray:
    dtype = x.dtype
    x, weight, bias = upcast(x, weight, bias)
    padding_end = tuple(padding_end) or tuple(padding)
    act = (activation, activation_min, activation_max)
    out = None if transposed else _conv2d_compiled(x, weight, bias, stride, padding, padding_end, dilation, groups,
                                                   act)
    if out is None:
        if transposed:
            if padding_end != tuple(padding):
                raise ValueError("a transposed convolution takes symmetric padding only")
            out = _conv_transposed(x, weight, stride, padding, dilation, groups, output_padding)
        else:
            out = _conv_forward(x, weight, stride, padding, padding_end, dilation, groups)
        _epilogue(out, bias, *act)
    return out.astype(dtype, copy=False) if dtype in LOW_PRECISION else out


def _epilogue(out: np.ndarray, bias: np.ndarray | None, activation: str, lo: float | None,
              hi: float | None) -> None:
    """Add the bias per channel and apply the fused activation to a (freshly allocated) conv output, in place: one
    compiled pass for float32, NumPy passes otherwise."""
    lib = native.library()
    if lib is not None and out.dtype == np.float32 and out.flags.c_contiguous and native.float32_contiguous(bias):
        size = int(np.prod(out.shape[2:]))
        lib.kiln_bias_activate_f32(out.ctypes.data, native.address(bias), out.shape[0] * out.shape[1], out.shape[1],
                                   size, native.ACTIVATION_CODES[activation], *native.bounds(lo, hi))
        return
    if bias is not None:
        out += bias.reshape((1, -1) + (1,) * (out.ndim - 2))
    if activation == "clamp":
        if lo is not None:
            np.maximum(out, out.dtype.type(lo), out=out)
        if hi is not None:
            np.minimum(out, out.dtype.type(hi), out=out)
    elif activation == "hardswish":
        out *= np.clip(out + 3, 0, 6) / 6
    elif activation != "none":
        raise ValueError(f"unknown conv activation {activation!r}")


def _conv2d_compiled(x, weight, bias, stride, padding, padding_end, dilation, groups, act) -> np.ndarray | None:
    """2-d float32 convolution through the compiled helpers (bias and activation included), or None where they do
    not apply.

    Depthwise runs entirely compiled (5-10x NumPy's tap loop on 7x7 to 28x28 maps, on par with PyTorch's); 3x3
    stride-1 convolutions on maps big enough use Winograd F(2x2, 3x3); other kernels bigger than 1x1 build im2col
    compiled, without a padded copy of the input, and multiply with BLAS.
    """
    lib = native.library()
    if lib is None or x.ndim != 4 or not native.float32_contiguous(weight, bias) or x.dtype != np.float32:
        return None
    n, c, h, w = x.shape
    o, cg, kh, kw = weight.shape
    oh, ow = (_conv_out(*args) for args in zip((h, w), (kh, kw), stride, padding, dilation, padding_end))
    if oh <= 0 or ow <= 0 or n == 0 or c == 0:
        return None
    x = np.ascontiguousarray(x)
    activation, lo, hi = act
    if cg == 1 and groups == c == o:
        out = np.empty((n, c, oh, ow), dtype=np.float32)
        lib.kiln_dwconv2d_f32(x.ctypes.data, weight.ctypes.data, native.address(bias), out.ctypes.data, n * c, c, h,
                              w, kh, kw, *stride, *padding, *dilation, oh, ow, native.ACTIVATION_CODES[activation],
                              *native.bounds(lo, hi))
        return out
    if kh == kw == 1 and not any(padding) and not any(padding_end):
        return None  # already one GEMM on the (strided) input
    if (kh, kw, *stride, *dilation, groups) == (3, 3, 1, 1, 1, 1, 1) and min(c, o) >= _WINOGRAD_MIN_CHANNELS \
            and n * ((oh + 1) // 2) * ((ow + 1) // 2) >= _WINOGRAD_MIN_TILES:
        return _winograd_3x3(lib, x, weight, bias, padding, oh, ow, act)
    # im2col + GEMM in bands of output rows, each band's patch matrix small enough to stay in cache
    k = cg * kh * kw
    band = max(1, min(oh, _IM2COL_BAND_BYTES // (4 * c * kh * kw * ow)))
    cols = np.empty(c * kh * kw * band * ow, dtype=np.float32)
    out = np.empty((n, o, oh * ow), dtype=np.float32)
    w_groups = weight.reshape(groups, o // groups, k)
    for b in range(n):
        for r0 in range(0, oh, band):
            r1 = min(oh, r0 + band)
            length = (r1 - r0) * ow
            part = cols[:c * kh * kw * length].reshape(c * kh * kw, length)
            lib.kiln_im2col2d_f32(x[b].ctypes.data, part.ctypes.data, c, h, w, kh, kw, *stride, *padding, *dilation,
                                  r0, r1, ow)
            target = out[b, :, r0 * ow:r1 * ow].reshape(groups, o // groups, length)
            np.matmul(w_groups, part.reshape(groups, k, length), out=target)
    out = out.reshape(n, o, oh, ow)
    _epilogue(out, bias, *act)
    return out


_IM2COL_BAND_BYTES = 1 << 20
"""Patch-matrix size per band of output rows: about half this machine's 2 MiB L2, so the GEMM reads it from cache."""

_WINOGRAD_MIN_TILES = 32
"""Winograd reads 16/9 of the weight bytes; below this many 2x2 output tiles (ResNet's 7x7 maps: 16), the
transformed weights' traffic costs more than the multiplies it saves, and im2col + one GEMM is faster (measured:
64-256 channels at 56x56..14x14, 1.4-2.2x faster than im2col; 512 channels at 7x7, 6% slower)."""
_WINOGRAD_MIN_CHANNELS = 8

_WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
_winograd_weights: dict[int, tuple[weakref.ref, np.ndarray]] = {}
"""U = G g G^T per weight array (by identity, dropped with the array): program constants are transformed once."""


def _winograd_weight(weight: np.ndarray) -> np.ndarray:
    key = id(weight)
    cached = _winograd_weights.get(key)
    if cached is not None and cached[0]() is weight:
        return cached[1]
    o, c = weight.shape[:2]
    u = np.einsum("ai,ocij,bj->aboc", _WINOGRAD_G, weight.astype(np.float64), _WINOGRAD_G)
    u = np.ascontiguousarray(u.reshape(16, o, c), dtype=np.float32)
    _winograd_weights[key] = (weakref.ref(weight, lambda _, key=key: _winograd_weights.pop(key, None)), u)
    return u


def _winograd_3x3(lib, x, weight, bias, padding, oh, ow, act) -> np.ndarray:
    """3x3 stride-1 convolution as Winograd F(2x2, 3x3): input transform (compiled), 16 GEMMs (BLAS), output
    transform with bias and activation (compiled)."""
    n, c, h, w = x.shape
    o = weight.shape[0]
    th, tw = (oh + 1) // 2, (ow + 1) // 2
    tiles = n * th * tw
    v = np.empty((16, c, tiles), dtype=np.float32)
    lib.kiln_winograd23_input_f32(x.ctypes.data, v.ctypes.data, n, c, h, w, padding[0], padding[1], th, tw)
    m = np.matmul(_winograd_weight(weight), v)
    out = np.empty((n, o, oh, ow), dtype=np.float32)
    activation, lo, hi = act
    lib.kiln_winograd23_output_f32(m.ctypes.data, native.address(bias), out.ctypes.data, n, o, oh, ow, th, tw,
                                   native.ACTIVATION_CODES[activation], *native.bounds(lo, hi))
    return out


def _conv_forward(x, weight, stride, padding, padding_end, dilation, groups):
    n, c = x.shape[:2]
    o, cg = weight.shape[:2]
    ks = weight.shape[2:]
    nsp = len(ks)
    out_sp = tuple(_conv_out(x.shape[2 + i], ks[i], stride[i], padding[i], dilation[i], padding_end[i])
                   for i in range(nsp))
    if all(k == 1 for k in ks) and not any(padding) and not any(padding_end) and groups == 1:
        xs = x[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)]
        res = np.matmul(weight.reshape(o, c), xs.reshape(n, c, -1))
        return res.reshape((n, o) + out_sp)
    if cg == 1 and groups == c == o and 0 not in out_sp:
        return _depthwise(x, weight, stride, padding, padding_end, dilation, out_sp)
    xp = _pad_spatial(x, tuple(padding), tuple(padding_end), 0.0)
    cols = np.empty((n, c) + tuple(ks) + out_sp, dtype=np.result_type(x, weight))  # im2col: [n, c, *k, *out]
    for taps in itertools.product(*(range(k) for k in ks)):
        cols[(slice(None), slice(None)) + taps] = xp[(slice(None), slice(None)) + _tap_slices(taps, stride, dilation,
                                                                                                out_sp)]
    kk = int(np.prod(ks))
    length = int(np.prod(out_sp))
    cols = cols.reshape(n, groups, cg * kk, length)
    res = np.matmul(weight.reshape(groups, o // groups, cg * kk), cols)  # [n, groups, o/groups, length]
    return res.reshape((n, o) + out_sp)


_DEPTHWISE_BLOCK_BYTES = 1 << 19
"""Channels per step of the depthwise loop are chosen so one output block is about this big and stays in cache
across all kernel taps (measured ~1.5x faster than whole-array passes on EfficientNet-lite0's layers)."""


def _phases(x: np.ndarray, ks, stride, padding, padding_end, dilation, out_sp):
    """The zero-padded input split by stride phase, flattened per channel, and each tap's (phase, flat offset).

    Padded position j * s + f of a dim lands in phase f at index j, so a strided convolution becomes stride 1 inside
    each phase. With phases of shape q, output position o (row-major index m in a grid [out_0, *q[1:]], whose extra
    columns are dropped at the end) reads flat element m + offset of its tap's phase: every tap is one contiguous
    1-d slice, so NumPy runs long inner loops even on 7x7 feature maps, with no stride-2 reads.
    Returns (buffer [n, c, phases, length], phase per tap, offset per tap, m, q).
    """
    n, c = x.shape[:2]
    nsp = len(ks)
    q = tuple(-(-(size + p + e) // s) for size, p, e, s in zip(x.shape[2:], padding, padding_end, stride, strict=True))
    pitch = [int(np.prod(q[i + 1:])) for i in range(nsp)]
    phases: dict[tuple[int, ...], int] = {}
    phase_of, offsets = [], []
    for taps in itertools.product(*(range(k) for k in ks)):
        pos = [t * d for t, d in zip(taps, dilation, strict=True)]
        phase_of.append(phases.setdefault(tuple(p % s for p, s in zip(pos, stride, strict=True)), len(phases)))
        offsets.append(sum((p // s) * pi for p, s, pi in zip(pos, stride, pitch, strict=True)))
    m = out_sp[0] * pitch[0]
    size = int(np.prod(q))
    buf = np.zeros((n, c, len(phases), max(size, max(offsets) + m)), dtype=x.dtype)
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


def _depthwise(x, weight, stride, padding, padding_end, dilation, out_sp):
    """groups == channels == out channels: one multiply-add per kernel tap, channel block by channel block."""
    n, c = x.shape[:2]
    dtype = np.result_type(x, weight)
    buf, phase_of, offsets, m, q = _phases(x.astype(dtype, copy=False), weight.shape[2:], stride, padding,
                                           padding_end, dilation, out_sp)
    w = weight.reshape(c, -1)
    out = np.empty((n, c, m), dtype=dtype)
    block = max(1, _DEPTHWISE_BLOCK_BYTES // (dtype.itemsize * m))
    tmp = np.empty((min(block, c), m), dtype=dtype)
    for b in range(n):
        for c0 in range(0, c, block):
            c1 = min(c, c0 + block)
            ob, tb, xb, wb = out[b, c0:c1], tmp[:c1 - c0], buf[b, c0:c1], w[c0:c1]
            for i, (phase, off) in enumerate(zip(phase_of, offsets, strict=True)):
                xs = xb[:, phase, off:off + m]
                if i == 0:
                    np.multiply(xs, wb[:, i:i + 1], out=ob)
                else:
                    np.multiply(xs, wb[:, i:i + 1], out=tb)
                    ob += tb
    out = out.reshape((n, c, out_sp[0]) + q[1:])[(slice(None), slice(None)) + tuple(slice(0, s) for s in out_sp)]
    return np.ascontiguousarray(out)


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
            sl = _tap_slices(taps, stride, dilation, x.shape[2:])
            out[(slice(None), slice(g * og, (g + 1) * og)) + sl] += contrib
    crop = tuple(slice(p, full[i] - p) for i, p in enumerate(padding))
    return out[(slice(None), slice(None)) + crop]


def _pool_geometry(in_sp, kernel_size, stride, padding, dilation, ceil_mode):
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


def _reduce_taps(xp: np.ndarray, kernel_size, stride, dilation, out_sp, ufunc: np.ufunc) -> np.ndarray:
    """ufunc-reduce every pooling window, one whole-output ufunc call per kernel tap (fast strided views, unlike a
    reduction over a window view's tiny trailing axes)."""
    nsp = len(kernel_size)
    lead = (slice(None),) * (xp.ndim - nsp)
    out = None
    for taps in itertools.product(*(range(k) for k in kernel_size)):
        xs = xp[lead + _tap_slices(taps, stride, dilation, out_sp)]
        if out is None:
            out = xs.copy()
        else:
            ufunc(out, xs, out=out)
    return out


@kernel("max_pool")
def max_pool(x: np.ndarray, kernel, stride, padding, dilation, ceil_mode: bool) -> np.ndarray:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    out_sp, extra = _pool_geometry(x.shape[-nsp:], kernel, stride, padding, dilation, ceil_mode)
    lib = native.library()
    if lib is not None and nsp == 2 and x.dtype == np.float32 and x.ndim >= 2 and 0 not in out_sp and x.size:
        x = np.ascontiguousarray(x)
        out = np.empty(x.shape[:-2] + out_sp, dtype=np.float32)
        lib.kiln_maxpool2d_f32(x.ctypes.data, out.ctypes.data, x.size // (x.shape[-1] * x.shape[-2]), *x.shape[-2:],
                               *kernel, *stride, *padding, *dilation, *out_sp)
        return out
    fill = -np.inf if x.dtype.kind == "f" or x.dtype in LOW_PRECISION else np.iinfo(x.dtype).min
    xp = _pad_spatial(x, tuple(padding), tuple(p + e for p, e in zip(padding, extra, strict=True)), fill)
    # np.maximum propagates NaN as torch's max pooling does.
    return _reduce_taps(xp, tuple(kernel), stride, tuple(dilation), out_sp, np.maximum)


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
    after = tuple(p + e for p, e in zip(padding, extra, strict=True))
    xp = _pad_spatial(x, tuple(padding), after, 0.0)
    total = _reduce_taps(xp, tuple(kernel), stride, ones, out_sp, np.add)
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


@kernel("adaptive_pool")
def adaptive_pool(x: np.ndarray, output_size, mode: str) -> np.ndarray:
    """Separable: an N-d box mean (or max) is the 1-d one along each axis in turn. Output index o of an axis of
    size I pools [floor(o*I/O), ceil((o+1)*I/O)), PyTorch's rule; averages accumulate in float32 for half inputs."""
    dtype = x.dtype
    (out,) = upcast(x) if mode == "avg" else (x,)
    nsp = len(output_size)
    reduce = np.mean if mode == "avg" else np.max
    for i, o_size in enumerate(output_size):
        axis = x.ndim - nsp + i
        size = out.shape[axis]
        parts = []
        for o in range(o_size):
            start, end = (o * size) // o_size, -((-(o + 1) * size) // o_size)
            window = out[(slice(None),) * axis + (slice(start, end),)]
            parts.append(reduce(window, axis=axis, keepdims=True))
        out = np.concatenate(parts, axis=axis)
    return out.astype(dtype, copy=False)
